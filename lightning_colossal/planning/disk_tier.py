"""The disk a node offers the disk tier (``lightning_colossal/disk``), and what a step's disk I/O costs at least.

The disk tier keeps the optimizer state shaped like the parameters (Adam's two moments), and with ``masters_on_disk``
the fp32 masters of the same shards, in files under ``offload_dir`` between steps, and each optimizer step reads every
byte of it once and writes it back once (``model_state.py`` says which bytes; ``disk_records`` lays them out as the
tier does, in records with aligned tensors). The ranks of a node share its disk, as they share its host memory, so a
step moves every local rank's disk bytes through the one disk: (node's disk bytes / read bandwidth) + (node's disk
bytes / write bandwidth) is the least time the step's I/O can take, taking a disk to share its bandwidth between the
two directions (one that reads and writes at full speed at once could take as little as the larger of the two terms).
The tier streams records while it steps others, so the step is not slower by the whole sum; but its I/O cannot finish
sooner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DISK_FRACTIONS", "PLACEHOLDER_OFFLOAD_DIR", "Disk", "DiskRecords", "disk_records", "io_seconds"]

# The disk shares the planner weighs per disk setting: the smallest one that fits the host wins (less I/O per step).
DISK_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
# What ``how`` names when the disk was described by its bandwidths only (a machine not at hand).
PLACEHOLDER_OFFLOAD_DIR = "/path/to/local/nvme"

# The disk tier's file layout (``lightning_colossal/disk/optimizer_state.py`` and ``files.py``; tests/unit/
# test_plan_disk.py checks that these mirror it): each state tensor starts at a multiple of TENSOR_ALIGNMENT inside
# its record, each record takes (and each read or write moves) a multiple of RECORD_ALIGNMENT, and a step streams the
# records through STAGING_SLOTS host buffers of the largest record.
TENSOR_ALIGNMENT = 64
RECORD_ALIGNMENT = 4096
STAGING_SLOTS = 3
# Bytes per element of a master in a record: the engines' masters are fp32.
MASTER_BYTES = 4


@dataclass(frozen=True)
class Disk:
    """The local disk of each node, under the directory the disk tier would use.

    Args:
        read_bytes_per_second, write_bytes_per_second: sequential bandwidths of one node's disk (shared by its ranks).
        offload_dir: the directory (``None``: described by bandwidths only).
        space: free bytes per node under ``offload_dir`` (``None``: not checked).
        measured: whether the bandwidths were measured here (``lightning_colossal.disk.bandwidth``) or given.
        direct_io: for a measurement, whether it bypassed the page cache (``False``: the figures include the cache
            and are optimistic).
    """

    read_bytes_per_second: float
    write_bytes_per_second: float
    offload_dir: str | None = None
    space: int | None = None
    measured: bool = False
    direct_io: bool | None = None

    def __post_init__(self) -> None:
        for name in ("read_bytes_per_second", "write_bytes_per_second"):
            value = getattr(self, name)
            if not math.isfinite(value) or value <= 0:
                raise ValueError(
                    f"disk {name.split('_')[0]} bandwidth {value}: pass a positive number of GB/s, e.g. 3."
                )
        if self.space is not None and self.space < 0:
            raise ValueError(f"disk space {self.space}: pass a size of at least 0 bytes.")

    @property
    def path(self) -> str:
        """The directory to name in a strategy's ``offload_dir``."""
        return self.offload_dir if self.offload_dir is not None else PLACEHOLDER_OFFLOAD_DIR


def _align(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


@dataclass(frozen=True)
class DiskRecords:
    """One rank's records in the disk tier's file: the bytes of each (its state tensors, and with ``masters_on_disk``
    its masters, aligned inside it)."""

    record_bytes: tuple[int, ...] = ()

    @property
    def file_bytes(self) -> int:
        """Bytes the records take on disk (``DiskOptimizerState.planned_bytes``), and a step reads and writes."""
        return sum(_align(size, RECORD_ALIGNMENT) for size in self.record_bytes)

    @property
    def checkpoint_bytes(self) -> int:
        """Host bytes a checkpoint save or load of these records adds: the one record open for entry reads or writes
        and one entry's value (``engine_parts/stand_ins.py`` [Note: deferred tensors]); at most two records."""
        if not self.record_bytes:
            return 0
        return 2 * _align(max(self.record_bytes), RECORD_ALIGNMENT)

    @property
    def staging_bytes(self) -> int:
        """Host bytes a step streams the records through (``DiskOptimizerState.staging_bytes``)."""
        if not self.record_bytes:
            return 0
        return min(STAGING_SLOTS, len(self.record_bytes)) * _align(max(self.record_bytes), RECORD_ALIGNMENT)


def disk_records(
    groups: Sequence[Sequence[int]],
    state_tensors: int,
    element_bytes: int = 4,
    masters: bool | Sequence[bool] = False,
) -> DiskRecords:
    """The records of ``groups`` (per record, the elements of each master in it), with ``state_tensors`` state
    tensors of ``element_bytes`` per element each (AdamW on fp32 masters: 2 of 4 bytes); empty records are dropped,
    as the tier drops them.

    ``masters`` (one flag for every record, or one per record): the record holds its masters' fp32 values too, all of
    them ahead of the state tensors, each aligned like a state tensor (``masters_on_disk``; ``disk/optimizer_state.py``
    [Note: masters on disk]).

    Raises:
        ValueError: a flag per record for a different number of records.
    """
    with_masters = [masters] * len(groups) if isinstance(masters, bool) else list(masters)
    if len(with_masters) != len(groups):
        raise ValueError(
            f"{len(with_masters)} master flags for {len(groups)} records: pass one flag, or one per record."
        )
    records = []
    for group, masters_here in zip(groups, with_masters, strict=True):
        offset = 0
        if masters_here:
            for numel in group:
                offset = _align(offset, TENSOR_ALIGNMENT) + numel * MASTER_BYTES
        for numel in group:
            for _ in range(state_tensors):
                offset = _align(offset, TENSOR_ALIGNMENT) + numel * element_bytes
        if offset:
            records.append(offset)
    return DiskRecords(tuple(records))


def io_seconds(disk: Disk, read_bytes: int, written_bytes: int) -> float:
    """The least time ``disk`` needs to read ``read_bytes`` and write ``written_bytes``: a lower bound of a step's
    disk I/O (the two directions taken to share the disk, so their times add up)."""
    return read_bytes / disk.read_bytes_per_second + written_bytes / disk.write_bytes_per_second
