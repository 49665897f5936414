"""Initialising a model built on the meta device after ``fully_shard``, each rank materialising only its shards.

[Note: FSDP meta initialisation]
Running the model's initialiser on FSDP2's DTensor shards draws every rank's shard from the random stream as if it
were the whole tensor: on a CPU mesh every rank fills its rows from the same state (duplicated rows across ranks),
and on any mesh the values differ from an eager build of the same seed. Instead, a storage-free copy of the
unsharded model is taken *before* sharding, and the shared windowed initialisation (``engine_parts/meta_init.py``)
runs the model's own initialiser on it, window by window, handing each tensor's whole value to this rank, which
keeps its shard. Every rank starts from rank 0's random state, so the shards fit together into exactly the model
an eager build of the same seed gives (for models whose constructors draw nothing themselves, as there). Peak
memory is one window, not the model.

A model carrying pretrained weights (``engine_parts/pretrained.py`` [Note: pretrained weights on the meta device])
reads each rank's shard straight from its safetensors files instead: the local rows (or columns) of every ``Shard``
placement, computed the way DTensor splits (``torch.chunk``), so no rank reads another rank's rows.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from lightning_colossal.engine_parts.meta_init import initialise_in_windows, start_from_rank_zero_random_state
from lightning_colossal.engine_parts.pretrained import (
    Piece,
    Sliceable,
    copy_into,
    fill_from_pretrained,
    has_pretrained_weights,
)

DEFAULT_INIT_WINDOW_BYTES = 1 << 30


def storage_free_template(module: nn.Module) -> nn.Module:
    """A storage-free copy of ``module``'s parameter-holding children under their own names, taken before sharding.

    The LightningModule itself is not copied (it refers to the Trainer); its children are what FSDP shards and what
    carry the initialisers.
    """
    template = nn.Module()
    for name, child in module.named_children():
        template.add_module(name, copy.deepcopy(child))
    return template


@torch.no_grad()
def initialise_shards(
    module: nn.Module,
    template: nn.Module,
    device: torch.device,
    window_bytes: int,
    parameter_device: torch.device | None = None,
) -> None:
    """Give ``module``'s meta shards (after ``fully_shard``) the values of ``template``'s initialiser (see [Note: FSDP
    meta initialisation]). Every rank of the sharding mesh must call this: it broadcasts rank 0's random state.

    ``parameter_device`` is where the parameter shards live when it is not ``device``: the host under FSDP2's CPU
    offload, whose first forward refuses parameters materialised anywhere else. Buffers are read by the forward on
    the compute device, so they go to ``device`` either way.
    """
    # FSDP2's own way to give meta shards storage; buffers too.
    module.to_empty(device=parameter_device or device)
    if parameter_device is not None and parameter_device != device:
        for submodule in module.modules():
            for name, buffer in submodule.named_buffers(recurse=False):
                submodule._buffers[name] = buffer.to(device)
    live: dict[str, Tensor] = dict(
        [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    )

    def keep(names: list[str], whole: Tensor) -> None:
        targets = {id(live[name]): live[name] for name in names if name in live}
        for target in targets.values():
            _store_shard(target, whole)

    if has_pretrained_weights(template):
        fill_from_pretrained(template, template, _pretrained_pieces(live), device, window_bytes)
    else:
        start_from_rank_zero_random_state(device)
        initialise_in_windows(template, lambda names: any(name in live for name in names), keep, device, window_bytes)
    left = [
        name for name, tensor in live.items() if (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_meta
    ]
    if left:
        raise ValueError(f"{left[:5]} are still on the meta device after initialisation: build them on a real device.")


def _store_shard(target: Tensor, whole: Tensor) -> None:
    if isinstance(target, DTensor):
        # src_data_rank=None: every rank cuts its own shard from the same whole value, no communication.
        shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
        target.to_local().copy_(shard.to_local())
    else:
        target.copy_(whole)


def _pretrained_pieces(live: dict[str, Tensor]) -> list[Piece]:
    """Every live tensor once, with all its names, cut to this rank's shard where DTensor's split is plain slicing."""
    names: dict[int, list[str]] = {}
    for name, tensor in live.items():
        names.setdefault(id(tensor), []).append(name)
    pieces = []
    for tensor_names in names.values():
        target = live[tensor_names[0]]
        ranges = _local_ranges(target) if isinstance(target, DTensor) else None
        if ranges is None or not isinstance(target, DTensor):
            # Whole, then cut like the initialised path (a replicated tensor, or a placement slicing cannot express).
            pieces.append(Piece(tensor_names, lambda source: source[...], _whole_storer(target)))
        else:
            index = tuple(slice(start, stop) for start, stop in ranges)
            pieces.append(Piece(tensor_names, _slicer(index), copy_into(target.to_local())))
    return pieces


def _local_ranges(target: DTensor) -> list[tuple[int, int]] | None:
    """``[start, stop)`` per dimension of this rank's shard, or ``None`` when a placement is not a plain ``Shard``
    or ``Replicate``. DTensor splits like ``torch.chunk``: pieces of ``ceil(length / parts)``, the last ones shorter
    or empty."""
    ranges = [(0, size) for size in target.shape]
    coordinate = target.device_mesh.get_coordinate()
    if coordinate is None:
        return None
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Replicate):
            continue
        if type(placement) is not Shard:
            return None
        start, stop = ranges[placement.dim]
        step = -(-(stop - start) // target.device_mesh.size(mesh_dim))
        begin = min(start + coordinate[mesh_dim] * step, stop)
        ranges[placement.dim] = (begin, min(begin + step, stop))
    if tuple(stop - start for start, stop in ranges) != tuple(target.to_local().shape):
        return None  # a split other than torch.chunk's: read whole and let DTensor cut
    return ranges


def _slicer(index: tuple[slice, ...]) -> Callable[[Sliceable], Tensor]:
    return lambda source: source[index or ...]  # a zero-dimensional tensor has no dimension to slice


def _whole_storer(target: Tensor) -> Callable[[Tensor], None]:
    return lambda whole: _store_shard(target, whole)
