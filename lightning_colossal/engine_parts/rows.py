"""Which rows of each parameter a data-parallel rank owns (pure logic, no process group).

Shared by the ZeRO and Gemini engines: both shard every parameter along dim 0, so their checkpoints agree.

[Note: sharding along dim 0]
ZeRO (and Gemini, inside its chunks) shards every parameter along its first dimension with ``torch.chunk``
semantics: with ``N`` ranks and ``R`` rows, each rank owns ``k = ceil(R / N)`` consecutive rows (the last ranks fewer, possibly none). Three things
follow. The owned rows are contiguous in memory, so the fp32 master of an fp32 parameter can simply *be* a view of
the parameter (no second copy). The owned block is rectangular, so optimizer state is a ``DTensor`` with
``Shard(0)`` placement, which ``torch.distributed.checkpoint`` saves and reshards to any world size or strategy.
And every rank's piece fits a fixed-size slot of ``k`` rows, so "rank-major" buffers (slot of rank 0 for every
parameter, then rank 1, ...) make one reduce-scatter or all-gather move a whole bucket. Zero-dimensional
parameters cannot be split and are replicated: every rank owns all of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardSpec:
    """The part of one parameter that one rank owns."""

    shape: torch.Size
    world_size: int
    rank: int
    rows_per_rank: int
    row_start: int
    row_end: int

    @property
    def replicated(self) -> bool:
        """Zero-dimensional parameters are owned whole by every rank."""
        return len(self.shape) == 0

    @property
    def num_rows(self) -> int:
        return self.shape[0] if len(self.shape) > 0 else 1

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 0 else 1

    @property
    def local_rows(self) -> int:
        return self.row_end - self.row_start

    @property
    def local_numel(self) -> int:
        return self.local_rows * self.row_numel

    @property
    def local_shape(self) -> torch.Size:
        if self.replicated:
            return self.shape
        return torch.Size((self.local_rows, *self.shape[1:]))

    @property
    def slot_numel(self) -> int:
        """Elements of the fixed per-rank slot in a rank-major buffer (``rows_per_rank`` rows)."""
        return self.rows_per_rank * self.row_numel

    def rows_of(self, rank: int) -> tuple[int, int]:
        """``[start, end)`` rows owned by ``rank``."""
        return owned_rows(self.num_rows, self.world_size, rank)


def owned_rows(num_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` rows of ``num_rows`` owned by ``rank`` (``torch.chunk`` semantics: ceil-sized, last short)."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks.")
    rows_per_rank = math.ceil(num_rows / world_size) if num_rows > 0 else 0
    start = min(rank * rows_per_rank, num_rows)
    return start, min(start + rows_per_rank, num_rows)


def shard_spec(shape: torch.Size | tuple[int, ...], world_size: int, rank: int) -> ShardSpec:
    """The rows of a parameter of ``shape`` that ``rank`` owns among ``world_size`` data-parallel ranks."""
    shape = torch.Size(shape)
    if len(shape) == 0:
        return ShardSpec(shape, world_size, rank, rows_per_rank=1, row_start=0, row_end=1)
    rows_per_rank = math.ceil(shape[0] / world_size) if shape[0] > 0 else 0
    start, end = owned_rows(shape[0], world_size, rank)
    return ShardSpec(shape, world_size, rank, rows_per_rank, start, end)
