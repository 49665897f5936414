"""What a model policy decides, and the pieces every policy shares.

A policy knows one model family. It splits the model's layers over the tensor-parallel ranks (returning, per
parameter, how it was split), installs sequence parallelism, and tells the pipeline where the model's embedding,
layer stack and head are. Policies replace submodules in place under their original attribute names, so every
parameter keeps the name it had in the user's model: checkpoints, optimizer state and the consolidate command
never see a policy's work. Sequence parallelism and activation checkpointing are attached as hooks, never by
replacing a forward (``attached.py`` [Note: techniques attach as hooks]).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from lightning_colossal.parallel.attached import AttachedTechniques
from lightning_colossal.parallel.regions import RegionTrace, nested_candidates
from lightning_colossal.parallel.sequence_layout import sequence_positions
from lightning_colossal.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    TensorParallelPlacement,
    shard_of,
)

# [Note: replicated parameters in tensor-parallel regions]
# Between a column-parallel layer and the row-parallel layer it feeds, activations are split over the tensor-parallel
# ranks (each holds its heads or its features). A parameter left whole in there (Qwen3/Gemma3's per-head q/k norms,
# a per-head scale, a router fed split features) gets on each rank only the gradient of the slice that rank applied it
# to: the ranks must sum their gradients, or every rank steps with a part of the gradient (and their copies drift
# apart). Outside such regions activations are replicated (or sequence shards under split-gather, which puts norms
# in ``partial_gradients`` for the same sum) and whole parameters get the whole gradient on every rank. The rule:
# every whole parameter inside a region is either declared partial (summed by the engine's gradient hook, the one
# split-gather's norm-gradient sum uses) or declared replicated; anything else is refused before training by
# ``check_tensor_parallel_regions``. Nesting names the candidates (a module that holds a row-parallel layer as a
# child and a column-parallel layer anywhere below it), and the order the modules run in the first forward decides
# which of them are inside (``regions.py`` [Note: regions by the order modules run]): a LayerNorm before the split
# in the same ``nn.Sequential`` is outside and trains. Policies declare what they know, and the check only catches
# what they did not. Plans name the declaration with Hugging Face's styles: ``"replicated_with_grad_allreduce"``
# (partial) and ``"replicate"``.


@dataclass
class ParallelPlan:
    """What a policy did to a model.

    Attributes:
        placements: how each split parameter is split, keyed by ``id(parameter)``.
        partial_gradients: whole (unsplit) parameters of which each tensor-parallel rank computes only a part of
            the gradient, so the engine sums their gradients over the tensor-parallel ranks in backward (see [Note:
            replicated parameters in tensor-parallel regions]): those that run on sequence shards under split-gather
            sequence parallelism (norms, a row-parallel bias), and those applied to this rank's slice of the split
            features (Qwen3's per-head ``q_norm``/``k_norm``). Add them with ``add_partial_gradients`` (each once).
        replicated: whole parameters inside a tensor-parallel region (see ``check_tensor_parallel_regions``) that
            the policy knows see the region's whole, replicated input: their gradients are complete on every rank.
        attached: the hooks the policy attached to the model's modules (sequence parallelism); ``attached.remove()``
            takes them off ([Note: techniques attach as hooks]).
        region_trace: whole parameters nesting puts in a tensor-parallel region, waiting for the first forward to
            show whether they run inside it (``check_tensor_parallel_regions``; the engine settles it).
    """

    placements: dict[int, TensorParallelPlacement] = field(default_factory=dict)
    partial_gradients: list[nn.Parameter] = field(default_factory=list)
    replicated: list[nn.Parameter] = field(default_factory=list)
    attached: AttachedTechniques = field(default_factory=AttachedTechniques)
    region_trace: RegionTrace | None = None

    def record(self, parameter: nn.Parameter | None, placement: TensorParallelPlacement) -> None:
        if parameter is not None:
            self.placements[id(parameter)] = placement

    def add_partial_gradients(self, parameters: Iterable[nn.Parameter]) -> None:
        """Sum these parameters' gradients over the tensor-parallel ranks. A parameter partial for two reasons
        (a per-head norm under split-gather) is still summed once: each rank's part is disjoint from the others'."""
        known = {id(parameter) for parameter in self.partial_gradients}
        for parameter in parameters:
            if id(parameter) not in known:
                known.add(id(parameter))
                self.partial_gradients.append(parameter)


class ModelPolicy:
    """Base of the per-family policies (see the module docstring)."""

    #: Short name used in error messages and the ``policy=`` argument.
    name = ""

    def accepts(self, module: nn.Module) -> bool:
        """Whether ``module`` is a model of this policy's family."""
        raise NotImplementedError

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        """Split ``model`` over ``context``'s tensor-parallel ranks in place; install sequence parallelism."""
        raise NotImplementedError

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The stack of repeated layers that pipeline stages divide."""
        raise self._no_pipeline()

    def stage_module(
        self, model: nn.Module, layer_indices: list[int], first: bool, last: bool, context: ParallelContext
    ) -> nn.Module:
        """A module running one pipeline stage: embedding if ``first``, the given layers, head if ``last``."""
        raise self._no_pipeline()

    def prune(self, model: nn.Module, keep_layers: set[int], first: bool, last: bool) -> None:
        """Drop what this pipeline rank does not run (layers not in ``keep_layers``; embedding or head)."""
        raise self._no_pipeline()

    def _no_pipeline(self) -> ValueError:
        return ValueError(
            f"The {self.name} policy does not know the model's layer stack, which pipeline stages (pp_size > 1) and"
            " activation_checkpointing need: use pp_size=1 and activation_checkpointing=False with this model (tensor"
            " and data parallelism still apply), or pass a ModelPolicy subclass that implements"
            " layers/stage_module/prune."
        )

    def wrap_layers_for_recomputation(self, model: nn.Module) -> AttachedTechniques:
        """Recompute each layer's activations in backward instead of keeping them (activation checkpointing), with
        torch's composable ``checkpoint`` hooks on each layer: classes and parameter names stay as they are. Returns
        the hooks, which ``remove()`` takes off."""
        attached = AttachedTechniques()
        for layer in self.layers(model):
            if not isinstance(layer, nn.Identity):  # a layer another pipeline rank runs
                attached.recompute_in_backward(layer)
        return attached


def column_parallel(
    linear: nn.Module,
    context: ParallelContext,
    plan: ParallelPlan,
    transposed: bool = False,
    fused_parts: int = 1,
    fused_blocks: tuple[int, ...] = (),
) -> nn.Module:
    """Replace a Linear (or ``[in, out]`` Conv1D when ``transposed``) by its column-parallel shard.

    ``fused_parts`` > 1: the output features are that many equal blocks (GPT-2's fused q, k, v), each split on its
    own, so every rank holds its share of each block (its heads' q, k and v), in block order. ``fused_blocks``: the
    same for blocks of these relative sizes (Phi-3's ``[q][k][v]`` with fewer key/value heads).
    """
    dim = 1 if transposed else 0
    placement = TensorParallelPlacement(dim, fused_parts, fused_blocks)
    bias_placement = TensorParallelPlacement(0, fused_parts, fused_blocks)
    weight = _shard_clone(linear.weight, placement, context)
    bias = None if getattr(linear, "bias", None) is None else _shard_clone(linear.bias, bias_placement, context)
    layer = ColumnParallelLinear(weight, bias, context, transposed=transposed)
    _keep_frozen(layer, linear)
    plan.record(layer.weight, placement)
    plan.record(layer.bias, bias_placement)
    return layer


def row_parallel(
    linear: nn.Module, context: ParallelContext, plan: ParallelPlan, transposed: bool = False
) -> nn.Module:
    """Replace a Linear (or ``[in, out]`` Conv1D) by its row-parallel shard; the bias stays whole."""
    dim = 0 if transposed else 1
    placement = TensorParallelPlacement(dim)
    weight = _shard_clone(linear.weight, placement, context)
    bias = getattr(linear, "bias", None)
    layer = RowParallelLinear(weight, None if bias is None else bias.detach().clone(), context, transposed=transposed)
    _keep_frozen(layer, linear)
    plan.record(layer.weight, placement)
    if layer.bias is not None and context.split_gather:
        plan.add_partial_gradients([layer.bias])
    return layer


def check_tensor_parallel_regions(
    model: nn.Module, plan: ParallelPlan, how_to_declare: Callable[[list[str]], str] | None = None
) -> None:
    """Find whole parameters nested in a tensor-parallel region without a word on their gradient, and leave
    ``plan.region_trace`` to watch whether the first forward runs them inside it (see [Note: replicated parameters in
    tensor-parallel regions]); ``how_to_declare(names)`` says how this policy's user declares them. A plan whose
    trace is set already (a policy checked its own plan) is left as it is."""
    if plan.region_trace is not None:
        return
    candidates = nested_candidates(model, plan)
    if not candidates:
        return

    def refusal(names: list[str], why: str) -> ValueError:
        fix = (
            how_to_declare(names)
            if how_to_declare is not None
            else "Record each in the ParallelPlan your policy's parallelize returns: `plan.add_partial_gradients([...])`"
            " if it is applied to this rank's slice of the split features, `plan.replicated.append(...)` if it sees"
            " the whole input."
        )
        return ValueError(
            f"Tensor parallelism leaves {names} whole inside a tensor-parallel region (between a column-parallel layer"
            f" and the row-parallel layer it feeds). {why} Nothing says whether each rank applies them to the whole"
            " input (the gradient is then complete on every rank) or to its own slice of the split heads/features (a"
            " per-head norm: each rank's gradient is then a part the ranks must sum). Either guess can train silently"
            f" wrong, so the model is refused before its first optimizer step. {fix}"
        )

    plan.region_trace = RegionTrace(model, candidates, refusal)


def _keep_frozen(layer: nn.Module, original: nn.Module) -> None:
    for name, parameter in layer.named_parameters(recurse=False):
        parameter.requires_grad_(getattr(original, name).requires_grad)


def _shard_clone(parameter: Tensor, placement: TensorParallelPlacement, context: ParallelContext) -> Tensor:
    piece = shard_of(parameter.detach(), placement, context.tp_rank, context.tp_size)
    return piece.clone()


def norm_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of every LayerNorm/RMSNorm-like module (names ending in ``norm``/``ln``) of ``model``."""
    found = []
    for module in model.modules():
        if isinstance(module, nn.LayerNorm) or type(module).__name__.endswith(("RMSNorm", "LayerNorm")):
            found.extend(parameter for parameter in module.parameters(recurse=False))
    return found


def refuse_sequence_parallel(context: ParallelContext, what: str) -> None:
    """Raise when sequence parallelism is on for a model whose policy does not install it."""
    if context.split_gather or context.sp_size > 1:
        raise ValueError(
            f"{what} does not install sequence parallelism (it would need to know where the model's sequence"
            " dimension flows through every layer; the demo GPT's policy does, and the built-in Hugging Face decoder"
            " policies through transformers' attention interface, parallel/huggingface/sequence.py): drop"
            " sequence_parallel/sp_size."
        )


def check_divisible(what: str, count: int, parts: int, fix: str) -> None:
    if count % parts != 0:
        raise ValueError(f"{what} = {count} is not divisible by {parts}: {fix}")


def positions_for(sequence_length: int, context: ParallelContext) -> Tensor:
    """Absolute positions (int64, in the order this rank holds its tokens) of this rank's ``sequence_length`` tokens.

    Under split-gather the batch is whole (``sequence_length`` is the whole length) and the embedding output is split
    into contiguous tensor-parallel slices. Under Ulysses and ring attention the batch arrives split
    (``sequence_length`` is this rank's share): a contiguous slice, or the two zigzag chunks under ring
    ([Note: sequence layouts] in ``sequence_layout.py``).
    """
    if context.split_gather:
        return sequence_positions(sequence_length, context.tp_size, context.tp_rank, "contiguous")
    if context.sp_size == 1:
        return torch.arange(sequence_length)
    whole = sequence_length * context.sp_size
    return sequence_positions(whole, context.sp_size, context.sp_rank, context.sequence_layout)
