"""Expert parallelism: each ep rank holds a slice of every experts module's experts, and routed tokens travel to
the rank that holds their expert and back (ColossalAI's ``MoeHybridParallelPlugin``, dropless).

[Note: experts modules]
Current Hugging Face MoE families (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, ...) keep a layer's experts
in one module whose forward is ``experts(hidden_states [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``,
with the experts' weights fused into parameters whose first dimension is the expert (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``) and the count in ``experts.num_experts``. The router (and any shared expert) lives beside it,
in the sparse MoE block, and stays whole on every rank. So one mechanism serves every family, and any plain module
following the same contract: a module is an experts module when it has an integer ``num_experts`` and parameters
of three dimensions whose first one is ``num_experts``.

[Note: the dispatch around an experts module]
The engine keeps this rank's slice of every parameter whose first dimension is the expert (experts
``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``) and sets ``num_experts`` to ``E/ep``, so the module's own forward, any
experts implementation Hugging Face dispatches to included, computes local experts numbered from 0. A forward
pre-hook receives the routed tokens: it sorts the (token, choice) pairs by expert, exchanges per-rank counts, then
sends each pair's hidden state to its expert's owner with a variable-size all-to-all (differentiable: its backward
is the reverse all-to-all) and hands the module the received rows, each with its local expert and weight 1. A
forward hook sends each row's output back, and weights and sums each token's choices in ascending expert order,
as the module's own loop adds them (so fp32 results are bit-identical to one process). The routing weights
therefore multiply on the token's own rank, where the router's gradient stays. Every rank takes part in every
all-to-all, with zero rows as much as with many, and a rank whose experts received nothing still returns its empty
output through the graph, so the backward all-to-alls pair up too. Dropless: every routed pair is computed (no
capacity factor).

[Note: reducing expert gradients]
The owner's expert gradient already sums every ep peer's tokens (the backward all-to-all brings them). The loss is
the mean over dp ranks of their own losses, so the right gradient is the sum over the expert-data group (the
replicas of these experts in other ep groups) divided by dp: an average over the expert-data group, divided by
``ep_size``. Everything that is not an expert parameter is averaged over dp x sp as before. Under ZeRO the expert
slices stay out of the ZeRO engine (``kept_whole``): they differ between its ranks, so neither its broadcast, nor its
sharding, nor its reduction may touch them; the optimizer steps them as they are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import Shard

from lightning_colossal.distributed import collectives, differentiable
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.parallel.attached import AttachedTechniques
from lightning_colossal.parallel.groups import ExpertGroups

_ROUTED_ARGUMENTS = ("hidden_states", "top_k_index", "top_k_weights")


def experts_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The experts modules of ``model`` ([Note: experts modules]), by qualified name."""
    for name, module in model.named_modules():
        count = getattr(module, "num_experts", None)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            continue
        if any(parameter.dim() == 3 and parameter.shape[0] == count for parameter in module.parameters(recurse=False)):
            yield name, module


@dataclass(frozen=True)
class ExpertSlice:
    """This rank's experts of one parameter: rows ``[start, start + count)`` of a whole tensor of ``whole_shape``."""

    start: int
    count: int
    whole_shape: torch.Size


class ExpertShards:
    """The expert parameters of this rank: which they are, and how checkpoints see them (a DTensor ``Shard(0)`` of the
    whole parameter over the ep group), gather them whole and cut whole tensors back.

    Args:
        groups: the expert-parallel groups.
    """

    def __init__(self, groups: ExpertGroups) -> None:
        self.groups = groups
        self.slices: dict[int, ExpertSlice] = {}
        #: The parameters themselves, by id (for the gradient reduction).
        self.parameters: dict[int, nn.Parameter] = {}
        #: The dispatch hooks; the engine moves them into ``ParallelPlan.attached`` with the policy's techniques.
        self.attached = AttachedTechniques()

    def is_expert(self, key: int) -> bool:
        return key in self.slices

    def describe(self, local: Tensor, key: int) -> Tensor:
        """``local`` (shaped like this rank's slice of parameter ``key``) as a piece of the whole tensor."""
        if key not in self.slices or local.dim() == 0:
            return local
        return sharded_state.piece_of_whole(local, self.groups.ep_mesh, [Shard(0)], self.slices[key].whole_shape)

    def gather(self, local: Tensor, key: int) -> Tensor:
        """The whole tensor of parameter ``key`` from every ep rank's slice (a collective over the ep group)."""
        if key not in self.slices:
            return local
        return collectives.gather_along(local.contiguous(), 0, self.groups.ep_group)

    def local_piece(self, whole: Tensor, key: int) -> Tensor:
        """This rank's rows of a whole tensor of parameter ``key`` (anything else unchanged)."""
        piece = self.slices.get(key)
        if piece is None or whole.dim() == 0 or whole.shape != piece.whole_shape:
            return whole
        return whole[piece.start : piece.start + piece.count]


def parallelize_experts(model: nn.Module, groups: ExpertGroups) -> ExpertShards:
    """Keep this rank's experts of every experts module of ``model`` and attach the token dispatch around each
    ([Note: the dispatch around an experts module]). Refuses a model without experts modules, or whose expert count
    does not divide by ``ep_size``."""
    shards = ExpertShards(groups)
    found = list(experts_modules(model))
    if not found:
        raise ValueError(
            f"ep_size={groups.ep_size}, but the model has no experts module (a module with an integer `num_experts` and"
            " 3-D parameters whose first dimension is the expert, as Hugging Face Mixtral, Qwen2/3-MoE, OLMoE and"
            " DeepSeek keep them): use ep_size=1 for a model without experts."
        )
    for name, module in found:
        count = module.num_experts
        if count % groups.ep_size != 0:
            raise ValueError(
                f"{name or 'the model'} has {count} experts, which do not split evenly over ep_size={groups.ep_size}:"
                f" pick an ep_size that divides {count}."
            )
        local_count = count // groups.ep_size
        start = groups.ep_rank * local_count
        for parameter_name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.dim() == 0 or parameter.shape[0] != count:
                continue  # not one row per expert: stays whole
            piece = nn.Parameter(parameter.detach()[start : start + local_count].clone(), parameter.requires_grad)
            setattr(module, parameter_name, piece)
            shards.slices[id(piece)] = ExpertSlice(start, local_count, parameter.shape)
            shards.parameters[id(piece)] = piece
        # The module's own forward now numbers its experts 0 .. local_count - 1 (the dispatch sends local indices).
        module.num_experts = local_count
        dispatch = ExpertDispatch(groups, local_count)
        shards.attached.before_forward(module, "expert parallelism: dispatch", dispatch.dispatch)
        shards.attached.after_forward(module, "expert parallelism: combine", dispatch.combine)
    return shards


@dataclass
class _Routed:
    """What the combine needs of one dispatch."""

    order: Tensor  # pair positions sorted by expert
    index: Tensor  # [T, K] global expert of each choice
    weights: Tensor  # [T, K]
    sent_rows: list[int]
    received_rows: list[int]
    received: Tensor
    dtype: torch.dtype


class ExpertDispatch:
    """The pair of hooks around one experts module ([Note: the dispatch around an experts module])."""

    def __init__(self, groups: ExpertGroups, local_count: int) -> None:
        self.groups, self.local_count = groups, local_count
        # One entry per forward still waiting for its combine (a recomputation in backward pushes and pops its own).
        self._pending: list[_Routed] = []

    def dispatch(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        values = dict(zip(_ROUTED_ARGUMENTS, args, strict=False)) | kwargs
        missing = [name for name in _ROUTED_ARGUMENTS if name not in values]
        if missing or len(values) != len(_ROUTED_ARGUMENTS):
            raise TypeError(
                f"expert parallelism expects experts modules called as experts(hidden_states, top_k_index,"
                f" top_k_weights) ([Note: experts modules]); {type(module).__name__} got {sorted(values)}. Use"
                " ep_size=1 for this model."
            )
        hidden, index, weights = (values[name] for name in _ROUTED_ARGUMENTS)
        group, ep_size = self.groups.ep_group, self.groups.ep_size
        tokens = index.shape[0]
        # Pairs choice-major (pair = choice * tokens + token), so that each expert's rows come in the order the
        # module's own loop takes them (by choice, then token), which keeps its weight gradient's sum order.
        expert_of_pair = index.t().reshape(-1)
        order = torch.argsort(expert_of_pair, stable=True)
        sorted_experts = expert_of_pair[order]
        owner = torch.div(sorted_experts, self.local_count, rounding_mode="floor")
        send_counts = torch.bincount(owner, minlength=ep_size)
        with Activity("expert-parallel dispatch"):
            # Counts first: each rank learns how many rows it receives from every peer (all of them, also zeros).
            receive_counts = collectives.all_to_all_rows(send_counts, [1] * ep_size, [1] * ep_size, group)
            sent_rows, received_rows = send_counts.tolist(), receive_counts.tolist()
            received = differentiable.all_to_all_rows(hidden[order % tokens], received_rows, sent_rows, group)
            local_experts = collectives.all_to_all_rows(
                sorted_experts - owner * self.local_count, received_rows, sent_rows, group
            )
        self._pending.append(_Routed(order, index, weights, sent_rows, received_rows, received, hidden.dtype))
        unit_weights = weights.new_ones((received.shape[0], 1))
        return (received, local_experts.unsqueeze(1), unit_weights), {}

    def combine(self, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
        routed = self._pending.pop()
        if routed.received.requires_grad and not output.requires_grad:
            # No expert here was hit: keep the output in the graph so this rank's backward all-to-all runs too.
            output = output + routed.received * 0
        with Activity("expert-parallel combine"):
            returned = differentiable.all_to_all_rows(
                output, routed.sent_rows, routed.received_rows, self.groups.ep_group
            )
        inverse = torch.empty_like(routed.order)
        inverse[routed.order] = torch.arange(routed.order.numel(), device=routed.order.device)
        tokens, top_k = routed.index.shape
        per_choice = returned[inverse].view(top_k, tokens, -1).transpose(0, 1)
        # The module's own loop adds each token's choices into zeros in ascending expert order.
        ascending = routed.index.argsort(dim=1)
        combined = torch.zeros_like(per_choice[:, 0]).to(routed.dtype)
        for position in range(top_k):
            choice = ascending[:, position]
            rows = torch.arange(tokens, device=choice.device)
            weighted = per_choice[rows, choice] * routed.weights[rows, choice].unsqueeze(-1)
            combined = combined + weighted.to(routed.dtype)
        return combined


class ExpertGradientAverager:
    """Reduces expert gradients over the expert-data group ([Note: reducing expert gradients]).

    Args:
        shards: this rank's expert parameters.
        parameters: the optimizer's parameters (the experts among them are reduced here).
    """

    def __init__(self, shards: ExpertShards, parameters: list[nn.Parameter]) -> None:
        self.groups = shards.groups
        self.parameters = [parameter for parameter in parameters if shards.is_expert(id(parameter))]

    def average(self) -> None:
        for parameter in self.parameters:
            if parameter.grad is None:
                # No token reached these experts anywhere: a zero gradient, as the whole model would have.
                parameter.grad = torch.zeros_like(parameter)
        gradients = [parameter.grad for parameter in self.parameters]
        if not gradients:
            return
        with torch.no_grad():
            flat = torch.cat([gradient.reshape(-1) for gradient in gradients])
            if self.groups.expert_data_group is not None:
                with Activity("averaging expert gradients"):
                    collectives.sum_within_group(flat, self.groups.expert_data_group)
            flat /= self.groups.expert_data_size * self.groups.ep_size
            offset = 0
            for gradient in gradients:
                gradient.copy_(flat[offset : offset + gradient.numel()].view_as(gradient))
                offset += gradient.numel()

    def gradients(self) -> list[Tensor]:
        return [parameter.grad for parameter in self.parameters if parameter.grad is not None]
