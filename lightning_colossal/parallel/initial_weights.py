"""How every rank starts from the same weights before taking its pieces: rank 0's (an eagerly built model), or the
model's own initialiser (a model built on the meta device).

[Note: meta-device models]
A model built on the meta device (``Trainer.init_module(empty_init=True)``, or ``torch.device("meta")`` in
``configure_model``) is split and cut while it still has no storage, so each rank only ever materialises the
tensor-parallel pieces of the stages it runs. Their values come from the model's own initialiser, run over a
storage-free copy of the unsplit model in windows (``engine_parts/meta_init.py``): exactly the pieces of what that
initialiser gives the whole model from the same seed, whatever the layout. A model carrying pretrained weights
(``engine_parts/pretrained.py`` [Note: pretrained weights on the meta device]) reads each piece straight from its
safetensors files instead: the blocks of the split dimension this tensor-parallel rank holds, nothing else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts.meta_init import (
    initialise_in_windows,
    materialise_in_place,
    start_from_rank_zero_random_state,
)
from lightning_colossal.engine_parts.pretrained import (
    Piece,
    Sliceable,
    copy_into,
    fill_from_pretrained,
    has_pretrained_weights,
    ranges_along,
    whole,
)
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext, TensorParallelPlacement, shard_of


def replicate_from_rank_zero(root: nn.Module, reduce_group: ProcessGroup | None) -> None:
    """Every rank must start from the same whole weights before taking its shard (as DDP broadcasts at wrap)."""
    with torch.no_grad():
        for tensor in [*root.parameters(), *root.buffers()]:
            if tensor.is_meta:
                continue
            if isinstance(tensor, DTensor):
                # Already split by the user's own tensor parallelism: the pieces differ over tp, so only the
                # data-parallel copies of each piece are made equal.
                if reduce_group is not None:  # None: no data-parallel copies
                    collectives.broadcast_tensor(tensor.to_local(), source_rank=0, group=reduce_group)
            else:
                collectives.broadcast_tensor(tensor.data, source_rank=0)


def initialise_from_template(
    root: nn.Module,
    model: nn.Module,
    template: nn.Module,
    plan: ParallelPlan,
    context: ParallelContext,
    device: torch.device,
    window_bytes: int,
) -> None:
    """Fill this rank's pieces of a meta-device model from the model's own initialiser, run over ``template`` (the
    unsplit, storage-free copy of ``model``); only the pieces this rank holds after splitting and pipeline cutting
    are ever materialised (see [Note: meta-device models])."""
    prefix = next(name for name, module in root.named_modules() if module is model)
    prefix = f"{prefix}." if prefix else ""
    live = dict([*root.named_parameters(remove_duplicate=False), *root.named_buffers(remove_duplicate=False)])
    # Give the live tensors real (uninitialised) storage; tied names share one tensor, materialised once.
    materialised: dict[int, Tensor] = {}
    for tensor in live.values():
        if tensor.is_meta and id(tensor) not in materialised:
            materialise_in_place(tensor, device)
            materialised[id(tensor)] = tensor

    def held(names: list[str]) -> list[Tensor]:
        # A tied weight may survive pipeline pruning under any one of its names (the head on the last stage).
        found = {id(live[prefix + name]): live[prefix + name] for name in names if prefix + name in live}
        return [tensor for key, tensor in found.items() if key in materialised]

    def keep(names: list[str], whole: Tensor) -> None:
        for target in held(names):
            placement = plan.placements.get(id(target))
            piece = whole if placement is None else shard_of(whole, placement, context.tp_rank, context.tp_size)
            target.data.copy_(piece)

    if has_pretrained_weights(template):
        pieces = _pretrained_pieces(template, held, plan, context)
        fill_from_pretrained(template, template, pieces, device, window_bytes)
    else:
        # Every rank must draw the same whole values to cut consistent pieces (the eager path broadcasts instead).
        start_from_rank_zero_random_state(device)
        initialise_in_windows(template, lambda names: bool(held(names)), keep, device, window_bytes)
    left = [name for name, tensor in live.items() if tensor.is_meta]
    if left:
        raise ValueError(
            f"{left[:5]} are on the meta device but outside the model the policy splits: build every module of the"
            " LightningModule inside that model, or on a real device."
        )


def _pretrained_pieces(
    template: nn.Module,
    held: Callable[[list[str]], list[Tensor]],
    plan: ParallelPlan,
    context: ParallelContext,
) -> list[Piece]:
    """One piece per tensor this rank holds, named as in ``template`` (the unsplit model), cut to its
    tensor-parallel piece."""
    named: dict[int, tuple[list[str], Tensor]] = {}
    for name, tensor in [
        *template.named_parameters(remove_duplicate=False),
        *template.named_buffers(remove_duplicate=False),
    ]:
        named.setdefault(id(tensor), ([], tensor))[0].append(name)
    pieces = []
    for names, whole_tensor in named.values():
        for target in held(names):
            placement = plan.placements.get(id(target))
            cut = whole if placement is None else _tensor_parallel_cut(placement, whole_tensor.shape, context)
            pieces.append(Piece(names, cut, copy_into(target)))
    return pieces


def _tensor_parallel_cut(
    placement: TensorParallelPlacement, shape: torch.Size, context: ParallelContext
) -> Callable[[Sliceable], Tensor]:
    """This rank's blocks of the split dimension, as ``shard_of`` cuts them from the whole tensor."""
    lengths = placement.block_lengths(shape[placement.dim])
    if context.tp_size == 1 or any(length % context.tp_size for length in lengths):
        # Whole, and shard_of splits it (or says why it cannot).
        return lambda source: shard_of(whole(source), placement, context.tp_rank, context.tp_size)
    ranges, offset = [], 0
    for length in lengths:
        step = length // context.tp_size
        ranges.append((offset + context.tp_rank * step, offset + (context.tp_rank + 1) * step))
        offset += length
    return lambda source: ranges_along(source, placement.dim, ranges)
