"""Building a model larger than one process: from the meta device straight into chunk shards.

[Note: initialisation in windows]
A model built on the meta device has shapes but no values. Each rank must end up with *its rows* of the values the
model's own initialiser would have produced, without ever holding the whole model. The initialiser (the outermost
``reset_parameters`` or Hugging Face ``init_weights``) draws every parameter from the random stream in a fixed order,
so chunk ``k``'s values depend on everything drawn before it. We therefore run the whole initialiser once per
*window* of chunks, from the same random state each time: the window's parameters point into real chunk-sized
buffers, every other chunked parameter points into one shared scratch buffer that soaks up its writes. After each
pass the rank keeps its rows of the window's chunks. Peak memory is one window plus the largest parameter, the
result is bit-identical to building the model eagerly from the same seed, and it does not depend on the world size.
The cost is one initialiser run per window (``GeminiConfig.init_window_bytes`` trades memory for passes).

An initialiser must only *write* parameters (as ``nn.init`` does); one that reads another parameter's values would
read scratch.

A model carrying pretrained weights (``engine_parts/pretrained.py`` [Note: pretrained weights on the meta device])
takes its values from its safetensors files instead: each rank reads only its rows of each chunk member, and the
whole of the few tensors kept outside chunks (buffers, replicated parameters).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_colossal.engine_parts.meta_init import (
    InitialiserReplay,
    Scratch,
    materialise_in_place,
    placeholder_in_place,
    plan_windows,
)
from lightning_colossal.engine_parts.pretrained import (
    Piece,
    Sliceable,
    copy_into,
    fill_from_pretrained,
    has_pretrained_weights,
    row_range,
    storage_free_copy,
    whole,
)
from lightning_colossal.engine_parts.rows import ShardSpec
from lightning_colossal.gemini.chunk import Chunk
from lightning_colossal.gemini.layout import ChunkMember
from lightning_colossal.gemini.manager import ChunkManager


def materialise_chunks(module: nn.Module, manager: ChunkManager, device: torch.device, window_bytes: int) -> None:
    """Fill every chunk's shard from the model's own initialiser, one window of chunks at a time, or from its
    pretrained files when it carries them."""
    if has_pretrained_weights(module):
        _fill_from_pretrained(module, manager, device, window_bytes)
        return
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta:
            materialise_in_place(tensor, device)
    replay = InitialiserReplay(module, device)
    chunks = manager.chunks
    scratch = Scratch(max((member.numel for chunk in chunks for member in chunk.spec.members), default=0), device)
    sizes = [chunk.spec.numel * chunk.shard.element_size() for chunk in chunks]
    with torch.no_grad():
        for window in plan_windows(sizes, window_bytes):
            buffers = _point_at_window(chunks, set(window), scratch, device)
            replay.run()
            for index in window:
                _keep_own_rows(chunks[index], buffers[index])
    manager.shards_to_masters()
    for chunk in chunks:
        manager.detach_parameters(chunk)


def _point_at_window(
    chunks: list[Chunk], window: set[int], scratch: Scratch, device: torch.device
) -> dict[int, torch.Tensor]:
    """The window's chunks get whole (gathered-shaped) buffers their parameters point into; the parameters of every
    other chunk write into scratch. Returns the buffers by chunk index."""
    buffers = {}
    for chunk in chunks:
        if chunk.index in window:
            buffers[chunk.index] = torch.zeros(chunk.spec.numel, dtype=chunk.shard.dtype, device=device)
            for member, parameter in zip(chunk.spec.members, chunk.parameters, strict=True):
                parameter.data = chunk.member_full(buffers[chunk.index], member)
        else:
            for parameter in chunk.parameters:
                parameter.data = scratch.view(parameter.shape, chunk.shard.dtype)
    return buffers


def _keep_own_rows(chunk: Chunk, whole: torch.Tensor) -> None:
    for member in chunk.spec.members:
        rows = chunk.member_owned_in_full(whole, member)
        chunk.member_shard(chunk.shard, member).view(-1).copy_(rows.to(chunk.shard.device))


def _fill_from_pretrained(module: nn.Module, manager: ChunkManager, device: torch.device, window_bytes: int) -> None:
    """Each rank reads its rows of every chunk member straight into its shard; tensors outside chunks whole."""
    template = storage_free_copy(module)
    names: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    every = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    for name, tensor in every:
        names.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    pieces = []
    chunked = set()
    for chunk in manager.chunks:
        for member, parameter in zip(chunk.spec.members, chunk.parameters, strict=True):
            chunked.add(id(parameter))
            if parameter.is_meta:
                placeholder_in_place(parameter)  # real but storage-free, so it can point at the chunk later
            pieces.append(Piece(names[id(parameter)], _rows_of(member.spec), _into_shard(chunk, member)))
    # Buffers and replicated parameters stay whole on every rank; the chunk members point at shards after this.
    for key, tensor in tensors.items():
        if key not in chunked and tensor.is_meta:
            materialise_in_place(tensor, device)
            pieces.append(Piece(names[key], whole, copy_into(tensor)))
    fill_from_pretrained(module, template, pieces, device, window_bytes)
    manager.shards_to_masters()
    for chunk in manager.chunks:
        manager.detach_parameters(chunk)


def _rows_of(spec: ShardSpec) -> Callable[[Sliceable], torch.Tensor]:
    """This rank's rows of a member (all of them when the member is replicated)."""
    if spec.replicated:
        return whole
    return lambda source: row_range(source, spec.row_start, spec.row_end)


def _into_shard(chunk: Chunk, member: ChunkMember) -> Callable[[torch.Tensor], None]:
    def store(rows: torch.Tensor) -> None:
        chunk.member_shard(chunk.shard, member).view(-1).copy_(rows.reshape(-1))

    return store
