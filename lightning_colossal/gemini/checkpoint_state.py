"""Gemini's chunks as checkpoints see them: by parameter name, as row shards or whole tensors, and back.

Every chunked parameter is saved as its fp32 master rows (never the rounded working weights), under each of its
names (tied parameters have several), as a dim-0 ``DTensor`` ([Note: sharding along dim 0] in
``engine_parts/rows.py``), so the checkpoint is interchangeable with ZeRO's and DDP's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.gemini.manager import ChunkManager
from lightning_colossal.gemini.masters_on_disk import DiskMasters


def state_by_name(
    manager: ChunkManager,
    names_of: Mapping[int, list[str]],
    device_mesh: DeviceMesh,
    value_of: Callable[[Tensor], Tensor] = lambda view: view,
) -> dict[str, Tensor]:
    """Every chunked parameter (all its names) as its fp32 master rows, a dim-0 DTensor aliasing the master (or
    ``value_of`` it: a stand-in for a master on disk)."""
    state: dict[str, Tensor] = {}
    for chunk in manager.chunks:
        for member, parameter, view in zip(chunk.spec.members, chunk.parameters, chunk.master_views, strict=True):
            shard = sharded_state.as_global(value_of(view), member.spec, device_mesh)
            for name in names_of[id(parameter)]:
                state[name] = shard
    return state


def load_full_weights(
    manager: ChunkManager, names_of: Mapping[int, list[str]], weights: Mapping[str, Tensor], disk_masters: DiskMasters
) -> list[str]:
    """Take this rank's rows of every chunked parameter from whole tensors by name (any of its names) into the
    masters (those on disk through ``disk_masters``, a record at a time); returns the chunked names ``weights`` lacks.
    The working shards are the caller's to refresh (``GeminiEngine.masters_loaded``)."""
    manager.release_all()
    missing = []
    rows_on_disk: dict[str, Tensor] = {}  # views of ``weights``, by member name
    with torch.no_grad():
        for chunk in manager.chunks:
            for member, parameter, view in zip(chunk.spec.members, chunk.parameters, chunk.master_views, strict=True):
                source = next((weights[name] for name in names_of[id(parameter)] if name in weights), None)
                if source is None:
                    missing.append(member.name)
                elif disk_masters.holds(view):
                    rows_on_disk[member.name] = sharded_state.owned_rows_of(source, member.spec)
                else:
                    view.copy_(sharded_state.owned_rows_of(source, member.spec))
        if rows_on_disk:
            disk_masters.load_rows(lambda member: rows_on_disk.get(member.name))
    return missing


def full_state_dict(manager: ChunkManager, names_of: Mapping[int, list[str]], module: nn.Module) -> dict[str, Tensor]:
    """Whole weights on every rank (CPU), gathered one chunk at a time (a collective); buffers and parameters outside
    the chunks come from ``module`` as they are."""
    manager.release_all()
    state: dict[str, Tensor] = {}
    for chunk in manager.chunks:
        manager.gather(chunk)
        for parameter in chunk.parameters:
            for name in names_of[id(parameter)]:
                state[name] = parameter.detach().to("cpu", copy=True)
        manager.release(chunk)
    for name, tensor in module.state_dict().items():
        if name not in state:
            state[name] = tensor.detach().cpu()
    return state


def give_parameters_their_values(manager: ChunkManager) -> None:
    """End of a run: gather every chunk (a collective) and leave each parameter its whole value in its own storage.

    Every chunk ends SHARDED, through the chunk state machine; the shards and masters stay readable (a checkpoint
    saved after the run), but the chunks no longer drive the parameters.
    """
    manager.release_all()
    for chunk in manager.chunks:
        manager.gather(chunk)
        manager.release_keeping_values(chunk)
