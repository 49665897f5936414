"""This disk's sequential bandwidth, measured the way the tier moves bytes (``files.py``: the same block size,
alignment and direct I/O), so ``bytes moved / bandwidth`` is a bound a streamed step can be held to."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from lightning_colossal.disk.files import TierDirectory, TierFile, aligned_buffer


@dataclass(frozen=True)
class DiskBandwidth:
    """Bytes per second of sequential reads and writes, and whether they bypassed the page cache."""

    read_bytes_per_second: float
    write_bytes_per_second: float
    direct_io: bool
    measured_bytes: int


def measure_bandwidth(
    offload_dir: str | os.PathLike[str], total_bytes: int = 512 * 2**20, rounds: int = 2
) -> DiskBandwidth:
    """Write then read ``total_bytes`` through a tier file under ``offload_dir`` ``rounds`` times; the best round of
    each direction counts (the disk's capability; a slower round measured interference, not the disk).

    The file is removed afterwards. With direct I/O unavailable (tmpfs) the figures include the page cache and say so.
    """
    directory = TierDirectory(offload_dir, rank=0)
    try:
        tier = TierFile(directory, "bandwidth.bin")
        buffer = aligned_buffer(total_bytes)
        buffer.random_(0, 255)
        offset = tier.reserve(total_bytes)
        tier.allocate()
        best_write = best_read = 0.0
        for _ in range(rounds):
            start = time.perf_counter()
            tier.write_now(offset, buffer)
            os.fsync(tier._buffered)
            best_write = max(best_write, total_bytes / (time.perf_counter() - start))
            start = time.perf_counter()
            tier.read_now(offset, buffer)
            best_read = max(best_read, total_bytes / (time.perf_counter() - start))
        direct = tier.direct_io
        tier.close()
    finally:
        directory.close()
    return DiskBandwidth(best_read, best_write, direct, total_bytes)
