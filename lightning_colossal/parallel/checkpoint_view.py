"""The hybrid model as checkpoints see it: the whole model's names, each tensor-parallel shard as a piece of the
whole parameter, and whole weights and optimizer state cut back into this rank's pieces.

[Note: fused shards are saved whole]
A fused parameter (GPT-2's ``c_attn``: q, k and v blocks, each split over the tensor-parallel ranks) is not one
contiguous piece of the whole tensor on any rank, and DCP only stores contiguous pieces (it rejects torch's
``_StridedShard``). Such parameters, and their ZeRO masters and optimizer state, are gathered into whole tensors
for a checkpoint. Loading fills those whole tensors in place, so the view remembers (weakly: a saved state dict
must not stay alive) which local tensor each came from and cuts the loaded values back in ``restore_gathered``.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, Shard
from torch.optim import Optimizer

from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_parts.rows import ShardSpec
from lightning_colossal.engine_parts.sharded_state import ShardedMaster
from lightning_colossal.parallel.experts import ExpertShards
from lightning_colossal.parallel.groups import HybridGroups
from lightning_colossal.parallel.names import ParameterNames, key_of
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.tensor_parallel import (
    ParallelContext,
    TensorParallelPlacement,
    describe_shard,
    full_from_shards,
    piece_like,
    shard_of,
)


class CheckpointView:
    """Describes and loads the weights and optimizer state of ``root`` after the engine split it.

    Args:
        root: the module whose parameter names checkpoints use (the LightningModule).
        plan: how the policy split each parameter.
        context: the tensor-parallel groups.
        groups: every group of this rank (pipeline and data-parallel ones for merging and describing).
        names: the whole model's names and shapes (see [Note: names survive parallelisation] in ``names.py``).
        experts: expert parallelism's slices (``experts.py``), seen as ``Shard(0)`` pieces of the whole parameters
            over the ep group, or ``None``.
    """

    def __init__(
        self,
        root: nn.Module,
        plan: ParallelPlan,
        context: ParallelContext,
        groups: HybridGroups,
        names: ParameterNames,
        experts: ExpertShards | None = None,
    ) -> None:
        self.root, self.plan, self.context, self.groups, self.names = root, plan, context, groups, names
        self.experts = experts
        # Whole tensors handed out for fused parameters (see [Note: fused shards are saved whole]).
        self._gathered: list[tuple[weakref.ref[Tensor], Tensor, TensorParallelPlacement, ShardSpec | None]] = []

    # ---------------------------------------------------------------------------------------------- weights
    def whole_tensor_of(self, local: Tensor, key: int) -> Tensor:
        """``local`` (shaped like this rank's shard of parameter ``key``) as a piece of the whole tensor."""
        if self.experts is not None and self.experts.is_expert(key):
            return self.experts.describe(local, key)
        placement = self.plan.placements.get(key)
        if placement is None or self.context.tp_size == 1:
            return local
        if placement.is_fused:
            return self._gathered_whole(local, local, placement, None)
        return describe_shard(local, placement, self.groups.tp_mesh, self.names.full_shapes[key])

    def _gathered_whole(
        self, tensor_parallel_shard: Tensor, target: Tensor, placement: TensorParallelPlacement, spec: ShardSpec | None
    ) -> Tensor:
        """The whole tensor of a fused parameter's shard, remembered for ``restore_gathered``."""
        whole = full_from_shards(tensor_parallel_shard, placement, self.context.tp_group)
        self._gathered = [record for record in self._gathered if record[0]() is not None]
        self._gathered.append((weakref.ref(whole), target, placement, spec))
        return whole

    def restore_gathered(self) -> None:
        """After a checkpoint filled the whole tensors of fused parameters: cut them back into this rank's tensors."""
        with torch.no_grad():
            for reference, target, placement, spec in self._gathered:
                whole = reference()
                if whole is None:
                    continue
                piece = shard_of(whole, placement, self.context.tp_rank, self.context.tp_size)
                if spec is not None:
                    piece = sharded_state.owned_rows_of(piece, spec)
                target.copy_(piece)
        self._gathered = []

    def model_state(self) -> dict[str, Any]:
        """This rank's weights by the root's names, tensor-parallel shards as DTensors of the whole parameters."""
        state: dict[str, Any] = {}
        parameter_keys = {id(parameter) for parameter in self.root.parameters()}
        for name, value in self.root.state_dict().items():
            key = key_of(self.root, name)
            state[name] = self.whole_tensor_of(value, key) if key in parameter_keys else value
        return state

    def full_weights(self) -> dict[str, Tensor]:
        """The whole model's weights by the root's names, as plain CPU copies, on every rank.

        Tensor-parallel shards are gathered over the tp ranks and the stages' weights merged over the pipeline ranks
        (collectives over both: every rank must call it). A weight tied across stages appears under each of its
        names, as in the unsplit model's ``state_dict``.
        """
        whole_by_key: dict[int, Tensor] = {}
        held: dict[str, Tensor] = {}
        with torch.no_grad():
            # Every tensor-parallel peer holds the same names in the same order, so the gathers pair up.
            for name, value in self.root.state_dict().items():
                key = key_of(self.root, name)
                if key not in whole_by_key:
                    placement = self.plan.placements.get(key)
                    if isinstance(value, DTensor):
                        whole = value.full_tensor()
                    elif placement is not None:
                        whole = full_from_shards(value, placement, self.context.tp_group)
                    elif self.experts is not None and self.experts.is_expert(key):
                        whole = self.experts.gather(value, key)  # ep peers hold the same names in the same order
                    else:
                        whole = value
                    whole_by_key[key] = whole.detach().to("cpu", copy=True)
                # A tied weight pruned from this stage under one name is still held under the other.
                for alias in self.names.names_of.get(key, [name]):
                    held[alias] = whole_by_key[key]
        if self.groups.pp_group is not None and self.groups.pp_size > 1:
            for stage_weights in collectives.gather_objects(held, self.groups.pp_group):
                held.update(stage_weights)
        return {name: held[name] for name in self.names.whole_model_keys if name in held}

    def describe_master(self, entry: ShardedMaster, value: Tensor) -> Tensor:
        """A ZeRO shard (rows over dp x sp) of a tensor-parallel shard as one DTensor of the whole parameter."""
        parameter = self.root.get_parameter(entry.name)
        if self.experts is not None and self.experts.is_expert(id(parameter)):
            return self.experts.describe(value, id(parameter))  # ZeRO keeps expert slices whole (experts.py)
        placement = self.plan.placements.get(id(parameter))
        if placement is None or self.context.tp_size == 1:
            return sharded_state.as_global(value, entry.spec, self.groups.reduce_mesh)
        if entry.spec.replicated:
            return value
        if placement.is_fused:
            rows = sharded_state.as_global(value, entry.spec, self.groups.reduce_mesh)
            tensor_parallel_shard = rows.full_tensor() if isinstance(rows, DTensor) else rows
            return self._gathered_whole(tensor_parallel_shard, value, placement, entry.spec)
        # Mesh dims (tp, reduce): the tensor-parallel split is applied first, then the rows of that shard.
        return sharded_state.piece_of_whole(
            value, self.groups.describe_mesh, [Shard(placement.dim), Shard(0)], self.names.full_shapes[id(parameter)]
        )

    def load_full_weights(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        """Copy whole weights (a full checkpoint, or a Hugging Face file) into this rank's shards."""
        own = self.root.state_dict()
        missing = [name for name in own if name not in state_dict]
        if strict and missing:
            raise RuntimeError(
                f"Missing keys {missing[:10]} when loading full weights into the hybrid model; set"
                " `self.strict_loading = False` in your LightningModule to load the matching weights only."
            )
        with torch.no_grad():
            for name, target in own.items():
                if name not in state_dict:
                    continue
                source = state_dict[name]
                placement = self.plan.placements.get(key_of(self.root, name))
                if placement is not None:
                    source = shard_of(source, placement, self.context.tp_rank, self.context.tp_size)
                if self.experts is not None:
                    source = self.experts.local_piece(source, key_of(self.root, name))
                if isinstance(target, DTensor):
                    target.to_local().copy_(piece_like(source, target).to_local())
                else:
                    target.copy_(source)

    # ---------------------------------------------------------------------------------------------- optimizer state
    def describe_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The name-keyed state of a plain (not ZeRO) optimizer over the root, with whole-parameter descriptions."""
        state = get_optimizer_state_dict(self.root, optimizer)
        # The per-parameter dicts are the optimizer's own (``Optimizer.state_dict`` does not copy them), so the
        # descriptions go into new dicts: writing them back would leave DTensors in the live state, and the next
        # step (or a second description of a tied weight) would fail on them. The tensors inside still alias the
        # live state, which loading relies on.
        state["state"] = {
            name: {
                state_key: self.whole_tensor_of(value, id(self.root.get_parameter(name)))
                if isinstance(value, Tensor) and value.dim() > 0
                else value
                for state_key, value in entries.items()
            }
            for name, entries in state["state"].items()
        }
        return state

    def canonical_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` keyed by canonical names, its groups listing the whole model's parameters (a collective over the
        pipeline ranks)."""
        canonical = self.rename_optimizer_state(state, to_canonical=True)
        return {"state": canonical["state"], "param_groups": self.whole_model_param_groups(canonical["param_groups"])}

    def local_optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A saved state (canonical names, whole model's groups) as this rank loads it: its own names and parameters,
        whole tensors cut to this rank's tensor-parallel shards."""
        state = self.rename_optimizer_state(state, to_canonical=False)
        # Groups list the whole model (whole_model_param_groups); this rank loads the parameters it holds.
        own = dict(self.root.named_parameters())
        state = {
            "state": {name: entries for name, entries in state["state"].items() if name in own},
            "param_groups": [
                {**group, "params": [name for name in group["params"] if name in own]}
                for group in state["param_groups"]
            ],
        }
        return self.full_optimizer_state_to_local(state)

    def load_plain_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        """Load ``local_optimizer_state``'s result into a plain (not ZeRO) optimizer over the root."""
        own = dict(self.root.named_parameters())
        # Plain parameters take plain state; DTensor parameters (the user's own tensor parallelism) keep DTensor state.
        local = {
            name: {
                key: value.to_local()
                if isinstance(value, DTensor) and not isinstance(own.get(name), DTensor)
                else value
                for key, value in entries.items()
            }
            for name, entries in state["state"].items()
        }
        set_optimizer_state_dict(self.root, optimizer, {"state": local, "param_groups": state["param_groups"]})

    def full_optimizer_state_to_local(self, state: dict[str, Any]) -> dict[str, Any]:
        """Cut whole optimizer-state tensors (from a full checkpoint) down to this rank's tensor-parallel shard."""
        for name, entries in state["state"].items():
            try:
                parameter = self.root.get_parameter(name)
            except AttributeError:
                continue
            if isinstance(parameter, DTensor):
                for key, value in list(entries.items()):
                    if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == parameter.shape:
                        entries[key] = piece_like(value, parameter)
                continue
            if self.experts is not None and self.experts.is_expert(id(parameter)):
                for key, value in list(entries.items()):
                    if isinstance(value, Tensor) and not isinstance(value, DTensor):
                        entries[key] = self.experts.local_piece(value, id(parameter)).clone()
                continue
            placement = self.plan.placements.get(id(parameter))
            if placement is None:
                continue
            whole_shape = self.names.full_shapes[id(parameter)]
            for key, value in list(entries.items()):
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.shape == whole_shape:
                    entries[key] = shard_of(value, placement, self.context.tp_rank, self.context.tp_size).clone()
        return state

    def rename_optimizer_state(self, state: dict[str, Any], to_canonical: bool) -> dict[str, Any]:
        """Key optimizer state by canonical names (saving) or by this rank's names (loading); see [Note: tied
        weights across stages] in ``pipeline.py``."""
        local_to_canonical = {
            name: self.names.canonical_name(parameter, name) for name, parameter in self.root.named_parameters()
        }
        mapping = local_to_canonical if to_canonical else {value: key for key, value in local_to_canonical.items()}
        renamed = {mapping.get(name, name): entries for name, entries in state["state"].items()}
        groups = [
            {**group, "params": [mapping.get(name, name) for name in group["params"]]}
            for group in state["param_groups"]
        ]
        return {"state": renamed, "param_groups": groups}

    def whole_model_param_groups(self, param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Canonically named parameter groups of the whole model: every pipeline rank's names, merged in the whole
        model's order (a collective over the pipeline ranks). A checkpoint then lists every stage's parameters, so
        the consolidated file keeps every stage's optimizer state, and a full checkpoint maps onto any stage."""
        if self.groups.pp_group is None or self.groups.pp_size == 1:
            return param_groups
        gathered = collectives.gather_objects([group["params"] for group in param_groups], self.groups.pp_group)
        merged = []
        for index, group in enumerate(param_groups):
            names = {name for rank_groups in gathered for name in rank_groups[index]}
            merged.append({**group, "params": sorted(names, key=self.names.whole_parameter_order.__getitem__)})
        return merged
