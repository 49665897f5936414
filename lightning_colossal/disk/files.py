"""The disk tier's working files: one directory per run and rank, one file of fixed-size records in it.

[Note: the tier's directory is never a checkpoint]
The tier holds working copies that are only meaningful to the process that wrote them (optimizer state between
two steps). Its directory is therefore:

- per process: ``<offload_dir>/lightning_colossal-disk-tier-<host>-<pid>-rank<r>-<random>/``, so two runs (or two
  ranks) sharing a disk never share files;
- marked: it holds ``NOT_A_CHECKPOINT.txt`` saying what it is, and the checkpoint loaders refuse such a directory
  with that reason (``checkpoint/layout.py``);
- removed when the run ends normally (``TierDirectory.close``, and a ``weakref.finalize`` backstop at interpreter
  exit); and after a crash: every live owner holds an ``fcntl`` lock on ``owner.lock`` in its directory, which the
  kernel drops when the process dies however it dies (``SIGKILL`` included). The next tier opened under the same
  ``offload_dir`` removes every tier directory whose lock it can take. Nothing a killed rank left can confuse a
  resume: resuming reads checkpoints, never the tier.

[Note: direct I/O]
Records are read and written with ``O_DIRECT`` where the filesystem allows it (ext4, xfs; not tmpfs), in blocks of
``BLOCK_BYTES`` from buffers aligned to ``ALIGNMENT``: the page cache would otherwise keep a second copy of the
whole tier in host memory (the memory the tier exists to save), and would make reads look faster than the disk is.
Where ``O_DIRECT`` is refused, or a buffer is not aligned, the same calls go through the page cache and the written
range is dropped from it after each write (``posix_fadvise(DONTNEED)``). ``os.preadv``/``os.pwritev`` release the
GIL, so a small thread pool overlaps I/O with the optimizer's arithmetic; no native package is needed.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

from lightning_colossal.distributed import device as devices

_HOST = torch.device("cpu")
TIER_PREFIX = "lightning_colossal-disk-tier-"
MARKER_FILENAME = "NOT_A_CHECKPOINT.txt"
LOCK_FILENAME = "owner.lock"
OWNER_FILENAME = "owner.json"
_CREATING_SUFFIX = ".creating"
#: A hidden directory still being created after this long belongs to a process killed while creating it.
_CREATION_GRACE_SECONDS = 60.0
#: Offsets, lengths and buffer addresses of direct I/O are multiples of this (the largest logical block size in
#: common use).
ALIGNMENT = 4096
#: One read or write call moves at most this much; ``bandwidth.py`` measures with the same size.
BLOCK_BYTES = 8 * 2**20
#: I/O threads per tier file: with blocks submitted on their own, two blocks of a read and two of a write in flight.
IO_THREADS = 4
#: Whether ``TierFile.read``/``write`` submit each block on its own (``False``: a transfer is one task, its blocks in
#: turn on one thread; kept for the benchmarks' comparison).
SPLIT_TRANSFERS = True

_MARKER_TEXT = (
    "This directory holds the working files of a running lightning_colossal disk tier (optimizer state between two\n"
    "steps). It is not a checkpoint and cannot be resumed from. It is removed when the run ends; a directory left by\n"
    "a killed run is removed by the next run that uses the same offload_dir, or by hand once no run uses it.\n"
)


class DiskTierError(RuntimeError):
    """The disk tier cannot read or write its files."""


class DiskTierFull(DiskTierError):
    """The disk under ``offload_dir`` has no room for the tier."""


def align_up(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


def aligned_buffer(nbytes: int, beside: torch.device = _HOST) -> Tensor:
    """A ``uint8`` CPU tensor of ``align_up(nbytes)`` bytes whose address is a multiple of ``ALIGNMENT`` (pinned when
    ``beside`` is an accelerator, for copies to and from it)."""
    size = align_up(nbytes)
    backing = devices.host_buffer(size + ALIGNMENT, torch.uint8, beside=beside)
    skip = (-backing.data_ptr()) % ALIGNMENT
    return backing[skip : skip + size]


def _memoryview(buffer: Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, for ``os.preadv``/``os.pwritev`` (no copy, no numpy)."""
    if buffer.device.type != "cpu" or not buffer.is_contiguous():
        raise ValueError("disk tier I/O needs a contiguous CPU buffer")
    nbytes = buffer.numel() * buffer.element_size()
    return memoryview((ctypes.c_char * nbytes).from_address(buffer.data_ptr())).cast("B")


class TierDirectory:
    """This process's working directory under ``parent`` ([Note: the tier's directory is never a checkpoint]).

    Args:
        parent: the user's ``offload_dir``; created if missing.
        rank: this process's global rank (only part of the name, for people reading ``ls``).
    """

    def __init__(self, parent: str | os.PathLike[str], rank: int) -> None:
        self.parent = Path(parent).expanduser().resolve()
        try:
            self.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise DiskTierError(
                f"offload_dir={str(parent)!r}: cannot create it ({error.strerror}). Pass a writable directory on a"
                " local disk (an NVMe drive is best)."
            ) from error
        self.removed_stale = remove_stale_directories(self.parent)
        name = f"{TIER_PREFIX}{socket.gethostname()}-{os.getpid()}-rank{rank}-{uuid.uuid4().hex[:8]}"
        self.path = self.parent / name
        # Made under a hidden name and locked before it gets its real one: another run's stale scan never sees a
        # tier directory whose lock is not yet held.
        creating = self.parent / f".{name}{_CREATING_SUFFIX}"
        try:
            creating.mkdir()
            self._lock = os.open(creating / LOCK_FILENAME, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            (creating / MARKER_FILENAME).write_text(_MARKER_TEXT)
            owner = {"host": socket.gethostname(), "pid": os.getpid(), "rank": rank, "created": time.time()}
            (creating / OWNER_FILENAME).write_text(json.dumps(owner))
            creating.rename(self.path)
        except OSError as error:
            shutil.rmtree(creating, ignore_errors=True)
            raise _explained(error, self.path, "creating the disk tier's directory") from error
        self._finalizer = weakref.finalize(self, _remove, self.path, self._lock)

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.path).free

    def check_room(self, planned_bytes: int, what: str) -> None:
        """Refuse to start when the disk cannot hold ``planned_bytes`` more (before anything is written)."""
        free = self.free_bytes()
        if planned_bytes > free:
            raise DiskTierFull(
                f"The disk tier needs {planned_bytes / 2**30:.2f} GiB in {self.parent} for {what}, but only"
                f" {free / 2**30:.2f} GiB are free there. Free space, point offload_dir at a larger disk, or lower"
                " disk_fraction (more state in host memory). Nothing was written; training did not start."
            )

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def close(self) -> None:
        """Remove the directory and its files (idempotent)."""
        self._finalizer()


def _remove(path: Path, lock: int) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        os.close(lock)
    except OSError:
        pass


def is_tier_directory(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is (or lies inside) a disk tier's working directory."""
    candidate = Path(path)
    return any(
        part.name.startswith(TIER_PREFIX) and (part / MARKER_FILENAME).exists()
        for part in [candidate, *candidate.parents]
    )


def remove_stale_directories(parent: Path) -> list[Path]:
    """Remove the tier directories under ``parent`` whose owner is gone (its lock can be taken); returns them."""
    removed = []
    for candidate in parent.glob(f"{TIER_PREFIX}*"):
        if candidate.is_dir() and (candidate / MARKER_FILENAME).exists() and _owner_gone(candidate):
            shutil.rmtree(candidate, ignore_errors=True)
            removed.append(candidate)
    for creating in parent.glob(f".{TIER_PREFIX}*{_CREATING_SUFFIX}"):
        try:
            old = time.time() - creating.stat().st_mtime > _CREATION_GRACE_SECONDS
        except OSError:
            continue
        if old and _owner_gone(creating):
            shutil.rmtree(creating, ignore_errors=True)
            removed.append(creating)
    return removed


def _owner_gone(directory: Path) -> bool:
    """Whether no live process holds ``directory``'s lock (taking it proves it; the kernel drops a dead owner's)."""
    try:
        lock = os.open(directory / LOCK_FILENAME, os.O_RDWR)
    except FileNotFoundError:
        return True  # killed before it made its lock
    except OSError:
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # a live run holds it
    finally:
        os.close(lock)
    return True


def all_of(parts: Sequence[Future[None]]) -> Future[None]:
    """A future done when every one of ``parts`` is (at once for none), failing with the first failure among them
    (after all finished: no block is still being read into or written from the buffer once it reports)."""
    combined: Future[None] = Future()
    if not parts:
        combined.set_result(None)
        return combined
    remaining = [len(parts)]
    lock = threading.Lock()

    def finished(_: Future[None]) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        failure = next((part.exception() for part in parts if part.exception() is not None), None)
        if failure is None:
            combined.set_result(None)
        else:
            combined.set_exception(failure)

    for part in parts:
        part.add_done_callback(finished)
    return combined


class TierFile:
    """One file of records in a ``TierDirectory``: space is reserved record by record, then read and written
    asynchronously on a small thread pool ([Note: direct I/O]).

    Args:
        directory: the tier's directory.
        name: the file's name in it.
        threads: I/O threads (``IO_THREADS`` when ``None``). ``read`` and ``write`` submit each ``BLOCK_BYTES`` block of a transfer on its own, so
            a record's blocks, and the next record's read beside the previous one's write, are in flight together
            (the queue depth a disk needs to reach its bandwidth; one request at a time per direction does not).
    """

    def __init__(self, directory: TierDirectory, name: str, threads: int | None = None) -> None:
        self.directory = directory
        self.path = directory.path / name
        flags = os.O_RDWR | os.O_CREAT
        try:
            self._buffered = os.open(self.path, flags, 0o600)
        except OSError as error:
            raise _explained(error, self.path, "opening the disk tier's file") from error
        self._direct: int | None
        try:
            self._direct = os.open(self.path, flags | getattr(os, "O_DIRECT", 0), 0o600)
            self.direct_io = hasattr(os, "O_DIRECT")
        except OSError:
            self._direct = None  # tmpfs and some network filesystems: buffered I/O, dropped from the page cache
            self.direct_io = False
        self.reserved_bytes = 0
        self.closed = False
        self._pool = ThreadPoolExecutor(max_workers=threads or IO_THREADS, thread_name_prefix="disk-tier-io")

    def reserve(self, nbytes: int) -> int:
        """Room for a record of ``nbytes``; returns its offset (records start on ``ALIGNMENT`` boundaries)."""
        offset = self.reserved_bytes
        self.reserved_bytes += align_up(nbytes)
        return offset

    def allocate(self) -> None:
        """Claim every reserved byte on the disk now, so the disk filling up later cannot fail a write mid-run."""
        if self.reserved_bytes == 0:
            return
        try:
            os.posix_fallocate(self._buffered, 0, self.reserved_bytes)
        except OSError as error:
            if error.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                return  # the filesystem cannot preallocate: writes claim space as they go
            raise _explained(error, self.path, f"reserving {self.reserved_bytes / 2**30:.2f} GiB") from error

    def write(self, offset: int, buffer: Tensor) -> Future[None]:
        """Write ``buffer`` (a contiguous CPU tensor) at ``offset``, block by block on the I/O threads."""
        return self._submit(offset, buffer, True)

    def read(self, offset: int, buffer: Tensor) -> Future[None]:
        """Fill ``buffer`` (a contiguous CPU tensor) from ``offset``, block by block on the I/O threads."""
        return self._submit(offset, buffer, False)

    def read_after(self, gate: Future[None], offset: int, buffer: Tensor) -> Future[None]:
        """``read``, started once ``gate`` is done (the writes that still use ``buffer``, or that write the range
        being read); fails with ``gate``'s failure instead of reading."""
        outcome: Future[None] = Future()

        def finished(transfer: Future[None]) -> None:
            error = transfer.exception()
            if error is None:
                outcome.set_result(None)
            else:
                outcome.set_exception(error)

        def start(_: Future[None]) -> None:
            if gate.exception() is not None:
                finished(gate)
                return
            try:
                self.read(offset, buffer).add_done_callback(finished)
            except BaseException as error:  # noqa: BLE001 - whatever stops the read must reach whoever waits for it
                outcome.set_exception(error)

        gate.add_done_callback(start)
        return outcome

    def _submit(self, offset: int, buffer: Tensor, writing: bool) -> Future[None]:
        flat = buffer.reshape(-1).view(torch.uint8)
        if not SPLIT_TRANSFERS:
            return self._pool.submit(self._transfer, offset, flat, writing)
        parts = [
            self._pool.submit(self._transfer, offset + start, flat[start : start + BLOCK_BYTES], writing)
            for start in range(0, max(flat.numel(), 1), BLOCK_BYTES)
        ]
        return parts[0] if len(parts) == 1 else all_of(parts)

    def write_now(self, offset: int, buffer: Tensor) -> None:
        self._transfer(offset, buffer, True)

    def read_now(self, offset: int, buffer: Tensor) -> None:
        self._transfer(offset, buffer, False)

    def _transfer(self, offset: int, buffer: Tensor, writing: bool) -> None:
        view = _memoryview(buffer)
        total = len(view)
        direct = (
            self._direct is not None
            and buffer.data_ptr() % ALIGNMENT == 0
            and offset % ALIGNMENT == 0
            and total % ALIGNMENT == 0
        )
        descriptor = self._direct if direct else self._buffered
        assert descriptor is not None
        done = 0
        try:
            while done < total:
                piece = view[done : done + BLOCK_BYTES]
                if writing:
                    moved = os.pwritev(descriptor, [piece], offset + done)
                else:
                    moved = os.preadv(descriptor, [piece], offset + done)
                if moved <= 0:
                    raise OSError(errno.EIO, f"{'wrote' if writing else 'read'} nothing at offset {offset + done}")
                done += moved
            if writing and not direct:
                os.posix_fadvise(self._buffered, offset, total, os.POSIX_FADV_DONTNEED)
        except OSError as error:
            doing = f"{'writing' if writing else 'reading'} {total / 2**20:.1f} MiB at offset {offset}"
            raise _explained(error, self.path, doing) from error

    def close(self) -> None:
        """Wait for I/O in flight and close the file (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._pool.shutdown(wait=True)
        for descriptor in (self._direct, self._buffered):
            if descriptor is not None:
                os.close(descriptor)


def _explained(error: OSError, path: Path, doing: str) -> DiskTierError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskTierFull(
            f"The disk tier ran out of space {doing} in {path.parent}: the disk (or your quota) is full. Free space"
            " or point offload_dir at a larger disk, and resume from the last checkpoint (checkpoints are written"
            " atomically, so the last one is intact)."
        )
    return DiskTierError(f"The disk tier failed {doing} in {path} ({error.strerror or error}).")
