"""How every rank starts from the same weights before taking its pieces: rank 0's (an eagerly built model), or the
model's own initialiser (a model built on the meta device).

[Note: meta-device models]
A model built on the meta device (``Trainer.init_module(empty_init=True)``, or ``torch.device("meta")`` in
``configure_model``) is split and cut while it still has no storage, so each rank only ever materialises the
tensor-parallel pieces of the stages it runs. Their values come from the model's own initialiser, run over a
storage-free copy of the unsplit model in windows (``distributed/meta_init.py``): exactly the pieces of what that
initialiser gives the whole model from the same seed, whatever the layout.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.meta_init import (
    initialise_in_windows,
    materialise_in_place,
    start_from_rank_zero_random_state,
)
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext, shard_of


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

    # Every rank must draw the same whole values to cut consistent pieces (the eager path broadcasts instead).
    start_from_rank_zero_random_state(device)
    initialise_in_windows(template, lambda names: bool(held(names)), keep, device, window_bytes)
    left = [name for name, tensor in live.items() if tensor.is_meta]
    if left:
        raise ValueError(
            f"{left[:5]} are on the meta device but outside the model the policy splits: build every module of the"
            " LightningModule inside that model, or on a real device."
        )
