"""What a model policy decides, and the pieces every policy shares.

A policy knows one model family. It splits the model's layers over the tensor-parallel ranks (returning, per
parameter, how it was split), installs sequence parallelism, and tells the pipeline where the model's embedding,
layer stack and head are. Policies replace submodules in place under their original attribute names, so every
parameter keeps the name it had in the user's model: checkpoints, optimizer state and the consolidate command
never see a policy's work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_colossal.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    TensorParallelPlacement,
    shard_of,
)


@dataclass
class ParallelPlan:
    """What a policy did to a model.

    Attributes:
        placements: how each split parameter is split, keyed by ``id(parameter)``.
        sequence_partial: parameters that run on sequence shards under split-gather sequence parallelism; each
            tensor-parallel rank gets only its shard's part of their gradient, so the ranks sum it.
    """

    placements: dict[int, TensorParallelPlacement] = field(default_factory=dict)
    sequence_partial: list[nn.Parameter] = field(default_factory=list)

    def record(self, parameter: nn.Parameter | None, placement: TensorParallelPlacement) -> None:
        if parameter is not None:
            self.placements[id(parameter)] = placement


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

    def wrap_layers_for_recomputation(self, model: nn.Module) -> None:
        """Recompute each layer's activations in backward instead of keeping them (activation checkpointing)."""
        for layer in self.layers(model):
            if isinstance(layer, nn.Identity):
                continue
            original = layer.forward
            # An instance attribute keeps the layer's class and parameter names intact (no wrapper module).
            layer.forward = functools.partial(_recomputed, original)  # type: ignore[method-assign]


def _recomputed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def column_parallel(
    linear: nn.Module, context: ParallelContext, plan: ParallelPlan, transposed: bool = False, fused_parts: int = 1
) -> nn.Module:
    """Replace a Linear (or ``[in, out]`` Conv1D when ``transposed``) by its column-parallel shard.

    ``fused_parts`` > 1: the output features are that many equal blocks (GPT-2's fused q, k, v), each split on its
    own, so every rank holds its share of each block (its heads' q, k and v), in block order.
    """
    dim = 1 if transposed else 0
    placement = TensorParallelPlacement(dim, fused_parts)
    bias_placement = TensorParallelPlacement(0, fused_parts)
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
        plan.sequence_partial.append(layer.bias)
    return layer


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
            " dimension flows through every layer; only the demo GPT's policy does): drop sequence_parallel/sp_size."
        )


def check_divisible(what: str, count: int, parts: int, fix: str) -> None:
    if count % parts != 0:
        raise ValueError(f"{what} = {count} is not divisible by {parts}: {fix}")


def positions_for(sequence_length: int, context: ParallelContext) -> range:
    """Absolute positions of this rank's tokens: an offset under sequence parallelism.

    Under Ulysses (``sp``) the batch arrives already split, rank r holding the r-th slice; under split-gather the
    batch is whole and the embedding output is split, so positions are sliced here. A ``range``, so callers can
    check bounds without reading a device tensor back.
    """
    if context.split_gather:
        length = sequence_length // context.tp_size
        return range(context.tp_rank * length, (context.tp_rank + 1) * length)
    start = context.sp_rank * sequence_length if context.sp_size > 1 else 0
    return range(start, start + sequence_length)
