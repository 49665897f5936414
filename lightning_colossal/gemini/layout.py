"""Which parameters go into which chunk, and how big a chunk is (pure logic, no process group).

[Note: chunks]
Gemini groups the parameters, in registration order, into *chunks* of a fixed capacity (in elements): the trainable
ones the optimizer holds first, then the frozen ones in chunks of their own ([Note: frozen chunks]).
A chunk is gathered and released as a whole: one collective moves many parameters. Each gather allocates a fresh
buffer holding exactly the chunk's members (``ChunkSpec.numel``, at most the capacity) and the release drops it;
there is no buffer pool (``manager.py``). Inside a chunk each parameter is sharded along dim 0 like ZeRO does
([Note: sharding along dim 0] in ``engine_parts/rows``): rank r keeps its rows of every member, back to back, as its
*shard* of the chunk. That is what makes Gemini's optimizer state and checkpoints rectangular per parameter and
interchangeable with ZeRO's and DDP's.

The gathered buffer is parameter-major (each member's full tensor is contiguous, so parameters are plain views of
it); rank-major "slot" buffers (every member's rows of rank 0, then rank 1, ...) are only used as staging for the
all-gather and reduce-scatter collectives.

A parameter larger than the capacity gets a chunk of its own, exactly its size. The capacity is searched to leave
the least unused space at the chunk ends (``wasted_numel``), so that chunks come out close to one size. Since a
gathered buffer holds only its chunk's members, that unused space is not allocated.

[Note: frozen chunks]
Parameters with ``requires_grad=False`` (a LoRA model's whole base model) are sharded like the trainable ones, or
every rank would hold them whole and ZeRO-3 would save nothing on the part of the model that is usually largest. A
chunk is either all trainable or all frozen: a frozen chunk is only a shard in the working dtype that is gathered for
the modules using it and released after. It has no fp32 master (its shard is its own master, never stepped), no
gradient buffer, no gradient hooks, never takes part in a reduction and holds no optimizer state, so none of the
gradient path has to ask which members of a chunk are frozen. Frozen chunks come after the trainable ones and are
packed with the same capacity; the capacity search sees both (``engine.py``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lightning_colossal.engine_parts.rows import ShardSpec, shard_spec


@dataclass(frozen=True)
class ChunkMember:
    """One parameter inside a chunk."""

    name: str
    spec: ShardSpec
    offset: int  # where the whole parameter starts in the gathered (parameter-major) buffer
    shard_offset: int  # where this rank's rows start in this rank's shard
    slot_offset: int  # where any rank's rows start inside that rank's slot of a rank-major buffer

    @property
    def numel(self) -> int:
        return math.prod(self.spec.shape)


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk: its members and sizes, as seen from one rank."""

    index: int
    capacity: int
    members: tuple[ChunkMember, ...]
    frozen: bool = False  # [Note: frozen chunks]

    @property
    def numel(self) -> int:
        """Elements the members occupy in the gathered buffer (at most ``capacity``)."""
        return sum(member.numel for member in self.members)

    @property
    def shard_numel(self) -> int:
        """Elements of this rank's shard."""
        return sum(member.spec.local_numel for member in self.members)

    @property
    def slot_numel(self) -> int:
        """Elements of one rank's slot in a rank-major staging buffer (the largest shard any rank has)."""
        return sum(member.spec.slot_numel for member in self.members)


class ChunkSizeChoice(NamedTuple):
    """The outcome of the chunk-size search."""

    chunk_numel: int
    wasted_numel: int
    num_chunks: int


def pack(numels: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy packing in order: indices of ``numels`` per chunk; a new chunk starts when an item does not fit.

    An item larger than ``capacity`` gets a chunk of its own.
    """
    if capacity < 1:
        raise ValueError(f"chunk capacity must be at least one element, got {capacity}.")
    chunks: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        if numel > capacity:
            if current:
                chunks.append(current)
                current, filled = [], 0
            chunks.append([index])
            continue
        if filled + numel > capacity:
            chunks.append(current)
            current, filled = [], 0
        current.append(index)
        filled += numel
    if current:
        chunks.append(current)
    return chunks


def wasted_numel(numels: Sequence[int], capacity: int) -> int:
    """Elements left unused at the chunk ends when ``numels`` are packed into chunks of ``capacity``."""
    waste = 0
    for chunk in pack(numels, capacity):
        filled = sum(numels[index] for index in chunk)
        waste += max(capacity - filled, 0)  # an oversized item's own chunk is exactly its size
    return waste


def search_chunk_numel(
    numels: Sequence[int], min_chunk_numel: int, search_range_numel: int, search_step_numel: int
) -> ChunkSizeChoice:
    """The capacity in ``[start, start + search_range_numel]`` (steps of ``search_step_numel``) wasting the least.

    ``start`` is the larger of ``min_chunk_numel`` and the largest parameter that is not an outlier (more than three
    standard deviations above the mean size; outliers get chunks of their own), rounded up to the step. A model
    smaller than ``start`` is one chunk of exactly its size. Ties go to the smaller capacity (smaller gathers).
    """
    if not numels:
        return ChunkSizeChoice(chunk_numel=max(min_chunk_numel, 1), wasted_numel=0, num_chunks=0)
    if search_step_numel < 1 or search_range_numel < 0 or min_chunk_numel < 1:
        raise ValueError(
            "the chunk search needs min_chunk_numel >= 1, search_step_numel >= 1, search_range_numel >= 0."
        )
    total = sum(numels)
    typical = list(numels)
    if len(numels) > 2:
        limit = statistics.fmean(numels) + 3 * statistics.pstdev(numels)
        typical = [numel for numel in numels if numel <= limit] or list(numels)
    start = max(min_chunk_numel, max(typical))
    start = math.ceil(start / search_step_numel) * search_step_numel
    if total <= start:
        return ChunkSizeChoice(chunk_numel=total, wasted_numel=0, num_chunks=1)
    best: ChunkSizeChoice | None = None
    for capacity in range(start, start + search_range_numel + 1, search_step_numel):
        waste = wasted_numel(numels, capacity)
        if best is None or waste < best.wasted_numel:
            best = ChunkSizeChoice(capacity, waste, len(pack(numels, capacity)))
    assert best is not None
    return best


def build_layout(
    named_shapes: Sequence[tuple[str, torch.Size]],
    capacity: int,
    world_size: int,
    rank: int,
    frozen: bool = False,
    first_index: int = 0,
) -> list[ChunkSpec]:
    """Chunks of ``capacity`` elements over the parameters (in the given order), as seen from ``rank``, numbered from
    ``first_index``; ``frozen`` marks them as chunks of frozen parameters ([Note: frozen chunks])."""
    numels = [math.prod(shape) for _, shape in named_shapes]
    chunks = []
    for chunk_index, indices in enumerate(pack(numels, capacity), start=first_index):
        members = []
        offset = shard_offset = slot_offset = 0
        for index in indices:
            name, shape = named_shapes[index]
            spec = shard_spec(shape, world_size, rank)
            members.append(ChunkMember(name, spec, offset, shard_offset, slot_offset))
            offset += numels[index]
            shard_offset += spec.local_numel
            slot_offset += spec.slot_numel
        chunks.append(ChunkSpec(chunk_index, max(capacity, offset), tuple(members), frozen))
    return chunks


def check_chunk_numel(chunk_numel: int, named_shapes: Sequence[tuple[str, torch.Size]]) -> None:
    """A chunk size chosen by the user must hold the largest parameter (a parameter is never split across chunks)."""
    if not named_shapes:
        return
    name, shape = max(named_shapes, key=lambda item: math.prod(item[1]))
    largest = math.prod(shape)
    if chunk_numel < largest:
        raise ValueError(
            f"chunk_numel={chunk_numel} is smaller than the parameter {name!r} ({largest} elements, shape"
            f" {tuple(shape)}), and a parameter is never split across chunks: pass chunk_numel >= {largest}, or"
            " chunk_numel=None to search a size."
        )
