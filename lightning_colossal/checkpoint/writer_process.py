"""A process of its own that writes background saves' shard files, from copies staged in shared host memory.

[Note: a writer process for background saves]
A background save written on a thread shares the training process's GIL. DCP serialises every item with
``torch.save`` (pickling, a checksum over every byte), which holds the GIL in long stretches, and the training
thread, Python between its kernels, waits meanwhile even where a core is idle. Measured on a 2-core machine
(benchmarks/RESULTS.md, "Checkpoint stall with a writer process"): a 418 MiB save cost a Python-bound loop beside it
0.57 s written from a thread, 0.08 s from a process; in a real 1-rank CPU fit with a core free, 0.64-0.84 s against
0.37-0.67 s (what stays on the thread, below, is the rest). So each training process keeps one writer process
(``writer_child.py``), and a background save hands it the bulk of the work, this rank's shard files (DCP's
``write_data``). The rest stays on the background thread: planning and the exchange of write results are
collectives on the background save's group, and rank 0's checkpoint file holds Lightning's entries, which may hold
objects only the training process can unpickle (classes defined in a notebook).

The staged copies live in shared memory (torch's file-system sharing: files under ``/dev/shm``, removed when both
processes have let go of them, and by torch's shared-memory manager when the training process ends, killed or not).
Copies from an accelerator are staged in pinned memory as before (fast device-to-host copies) and copied into shared
memory on the background thread. A save whose staged bytes, times the ranks of the node, exceed ``/dev/shm``'s free
space is written on the thread as before, with a warning once that names the fix: a tmpfs filled while it is written
would kill the process (``SIGBUS``) rather than fail the save.

The writer process starts when a fit that saves in the background starts (its imports take seconds; they overlap
training) and serves every later save of the process. It ends when the training process closes its pipe or dies. A
writer process found dead when a save hands it the shards is replaced and the shards handed to the new one, once per
save; a second death fails that save like any failed write (the previous checkpoint stays, ``atomic.py`` [Note:
atomic save]).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future

from lightning_colossal.checkpoint import writer_child
from lightning_colossal.checkpoint.writer_messages import DONE, Forget, Job, Reply, SharedTensor, receive, send
from lightning_colossal.distributed import device

SHARED_MEMORY = Path("/dev/shm")


class WriterProcessFailed(RuntimeError):
    """The writer process failed to write a save's shards, or ended while writing them."""


class WriterProcessEnded(WriterProcessFailed):
    """The writer process ended (killed, out of memory) before it answered."""


# ------------------------------------------------------------------------------------------------------ memory
def shared_memory_free_bytes() -> int | None:
    """Free bytes of the tmpfs that shared host memory comes from; ``None`` where there is none (not Linux)."""
    statvfs = getattr(os, "statvfs", None)  # not on Windows
    try:
        stats = statvfs(SHARED_MEMORY) if statvfs is not None else None
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize if stats is not None else None


class SharedBuffers:
    """Shared-memory storages reused from one background save to the next.

    A fresh storage costs a page fault per page in this process when staged into and in the writer process when
    read (0.4 s of a 27M-parameter GPT's 0.45 s of staging here), where reused ones cost only the copy. Each save
    takes the storages of the sizes it needs from those the previous save used (``take``) and, once written, keeps
    exactly its own (``keep_only``): the pool holds one save's staged bytes between saves, as the thread route's
    allocator kept its freed heap, until ``clear`` at the end of the fit."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}
        self._handles: dict[int, tuple[bytes, bytes, int]] = {}  # by storage address

    def take(self, size: int) -> torch.UntypedStorage:
        free = self._free.get(size)
        if free:
            return free.pop()
        storage = torch.UntypedStorage._new_using_filename_cpu(size)
        self._handles[storage.data_ptr()] = storage._share_filename_cpu_()
        return storage

    def handle(self, storage: torch.UntypedStorage) -> tuple[bytes, bytes, int] | None:
        return self._handles.get(storage.data_ptr())

    def keep_only(self, storages: list[torch.UntypedStorage]) -> None:
        """Keep ``storages`` for the next save and free every other one."""
        self._free = {}
        for storage in storages:
            self._free.setdefault(storage.nbytes(), []).append(storage)
        kept = {storage.data_ptr() for storage in storages}
        self._handles = {address: handle for address, handle in self._handles.items() if address in kept}

    def clear(self) -> None:
        self.keep_only([])

    def kept_bytes(self) -> int:
        """Bytes held for the next save (already in shared memory, so not needed anew)."""
        return sum(storage.nbytes() for storages in self._free.values() for storage in storages)


class SharedStaging:
    """The host buffers of one background save: shared memory the writer process maps (from ``SharedBuffers``), or
    pinned memory beside an accelerator (copied into shared memory when the save is written)."""

    def __init__(self, buffers: SharedBuffers) -> None:
        self._buffers = buffers
        self._used: list[torch.UntypedStorage] = []

    def host_buffer(self, numel: int, dtype: torch.dtype, beside: torch.device) -> Tensor:
        """A flat host tensor to stage a tensor of ``beside`` into (``async_save.stage``'s allocator)."""
        if device.is_accelerator(beside):
            return device.host_buffer(numel, dtype, beside=beside)
        return self._shared(numel, dtype)

    def _shared(self, numel: int, dtype: torch.dtype) -> Tensor:
        # At least one byte: an empty storage has no file to share.
        storage = self._buffers.take(max(1, numel * dtype.itemsize))
        self._used.append(storage)
        return torch.empty(0, dtype=dtype).set_(storage, 0, (numel,), (1,))

    def shipped(self, data: Any) -> SharedTensor | bytes:
        """What the writer process needs of one resolved write item: the bytes of a pickled object, or a tensor in
        shared memory (copied there now when it was staged elsewhere)."""
        if not isinstance(data, Tensor):
            return bytes(data.getbuffer())  # DCP's BytesIO of a pickled object
        handle = self._buffers.handle(data.untyped_storage())
        if handle is None:
            copy = self._shared(data.numel(), data.dtype).view(data.shape)
            copy.copy_(data)
            data = copy
            handle = self._buffers.handle(data.untyped_storage())
            assert handle is not None
        manager, name, size = handle
        return SharedTensor(manager, name, size, data.dtype, data.storage_offset(), tuple(data.shape), data.stride())

    def written(self) -> None:
        """The writer process is done with this save's buffers: they wait for the next save."""
        self._buffers.keep_only(self._used)
        self._used = []


# ------------------------------------------------------------------------------------------------------ the process
class WriterProcess:
    """One writer process (``writer_child.py``) and the two pipes to it."""

    def __init__(self) -> None:
        child_reads, parent_writes = os.pipe()
        parent_reads, child_writes = os.pipe()
        environment = dict(os.environ)
        # It only reads host memory (DCP's writer would otherwise look for a GPU), and it imports nothing of the
        # package (``writer_messages.py``), so it needs no path to it.
        environment.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        try:
            self._process = subprocess.Popen(
                [sys.executable, str(Path(writer_child.__file__)), str(child_reads), str(child_writes)],
                pass_fds=(child_reads, child_writes),
                stdin=subprocess.DEVNULL,
                env=environment,
            )
        finally:
            os.close(child_reads)
            os.close(child_writes)
        self._jobs = Connection(parent_writes, readable=False)
        self._replies = Connection(parent_reads, writable=False)
        self._ready = False

    @property
    def ready(self) -> bool:
        """Whether the process finished its imports and said so."""
        return self._ready

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def _receive(self) -> Reply:
        try:
            return receive(self._replies)
        except (EOFError, OSError) as error:
            code = self._process.wait()
            raise WriterProcessEnded(
                f"the checkpoint writer process (pid {self._process.pid}) ended with exit code {code} before it"
                " had written this rank's shards"
            ) from error

    def wait_until_ready(self) -> None:
        """Wait for the process's imports to finish (its first message).

        Raises:
            WriterProcessFailed: it ended before.
        """
        if not self._ready:
            self._receive()
            self._ready = True

    def write(self, job: Job) -> list[Any]:
        """Have the process write ``job``; returns DCP's write results.

        Raises:
            WriterProcessFailed: the write failed there (its error and traceback in the message), or the process
                ended.
        """
        self.wait_until_ready()
        try:
            send(self._jobs, job)
        except OSError as error:
            self._receive()  # names the exit code when the process is gone
            raise WriterProcessFailed(f"cannot hand the save to the checkpoint writer process: {error}") from error
        reply = self._receive()
        if reply.status == DONE:
            return reply.results or []
        raise WriterProcessFailed(reply.failure())

    def forget(self) -> None:
        """Have the process unmap every staging buffer it keeps mapped (``SharedBuffers.clear`` freed them here)."""
        if self._ready and self.alive():
            send(self._jobs, Forget())
            self._receive()

    def close(self, timeout: float = 30.0) -> None:
        """End the process: it leaves once its pipe closes (after the job it may be writing)."""
        self._jobs.close()
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._replies.close()


# ------------------------------------------------------------------------------------------------------ one per process
class WriterService:
    """What this training process keeps for its background saves from one to the next: its writer process, the
    staging buffers of the last save (``SharedBuffers``) and the warnings already given. One per process
    (``_service``, reached through the functions below): a process has one writer process, whichever strategy saves.
    Each save takes what it needs as a route (``async_save.choose_route``)."""

    def __init__(self) -> None:
        self.buffers = SharedBuffers()
        self.warned: set[str] = set()
        self._process: WriterProcess | None = None
        self._lock = threading.Lock()  # started on the training thread, replaced on a background thread

    def start(self) -> WriterProcess | None:
        with self._lock:
            if self._process is not None and self._process.alive():
                return self._process
            if self._process is not None and not self._process.ready:
                return None  # it ended before it could work once (warned then): saves stay on their thread
            try:
                self._process = WriterProcess()
            except (OSError, ValueError) as error:  # ValueError: pass_fds where the platform has none (Windows)
                self._process = None
                self.warn_once(
                    "start",
                    f"lightning_colossal could not start its checkpoint writer process ({error}); background saves"
                    " are written on a thread of the training process instead, which slows training more while they"
                    " are written.",
                )
            return self._process

    def release_staging(self) -> None:
        self.buffers.clear()
        with self._lock:
            process = self._process
        if process is not None:
            try:
                process.forget()
            except (WriterProcessFailed, OSError):
                pass  # it ended: its mappings went with it

    def stop(self) -> None:
        self.buffers.clear()
        with self._lock:
            process, self._process = self._process, None
        if process is not None:
            process.close()

    def room_for(self, staged_bytes: int, ranks_per_node: int) -> bool:
        free = shared_memory_free_bytes()
        if free is None:
            return False  # no /dev/shm (macOS, Windows): the thread writes, as it always did there
        needed = max(0, staged_bytes - self.buffers.kept_bytes()) * max(1, ranks_per_node)
        if free >= needed:
            return True
        self.warn_once(
            "room",
            f"Background checkpoint saves need {needed:,} more bytes of shared memory to be written by a process of"
            f" their own ({staged_bytes:,} per rank x {ranks_per_node} ranks on this node), and {SHARED_MEMORY} has"
            f" {free:,} bytes free: they are written on a thread of the training process instead, which slows"
            " training more while they are written. In a container, raise its shared memory (docker run"
            " --shm-size=..., a Kubernetes emptyDir with medium Memory).",
        )
        return False

    def warn_once(self, key: str, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(message, stacklevel=4)


_service = WriterService()


def start() -> WriterProcess | None:
    """The process's writer process, started now if there is none or it ended; ``None`` (with a warning once) where
    none can start: background saves are then written on their thread."""
    return _service.start()


def staging() -> SharedStaging:
    """The buffers of a new background save, from those the previous one used."""
    return SharedStaging(_service.buffers)


def release_staging() -> None:
    """Free the staging buffers kept for the next save, here and in the writer process (the end of a fit; no save
    may be in flight)."""
    _service.release_staging()


def stop() -> None:
    """End the writer process, if any, and free the staging buffers (tests; a process that exits ends it anyway)."""
    _service.stop()


def room_for(staged_bytes: int, ranks_per_node: int) -> bool:
    """Whether shared memory has room for ``staged_bytes`` from each of ``ranks_per_node`` ranks saving at once, less
    what the previous save's buffers, already there, provide; warns once where it has not."""
    return _service.room_for(staged_bytes, ranks_per_node)


# ------------------------------------------------------------------------------------------------------ DCP's writer
class HandsOver(Protocol):
    """What ``ProcessShardWriter`` hands a job to: a ``WriterProcess``, or a save's route to one
    (``async_save.ProcessRoute``, which replaces a process that died)."""

    def wait_until_ready(self) -> None: ...

    def write(self, job: Job) -> list[Any]: ...


class ProcessShardWriter(FileSystemWriter):
    """DCP's file writer whose ``write_data`` has the writer process write this rank's files: the same files, the
    same write results, from the background thread that runs the save."""

    def __init__(self, path: str | os.PathLike[str], process: HandsOver, staging: SharedStaging) -> None:
        super().__init__(path, per_thread_copy_ahead=0)
        self._writer_process = process
        self._staging = staging

    def write_data(self, plan: Any, planner: Any) -> Future[list[Any]]:
        try:
            self._writer_process.wait_until_ready()
        except WriterProcessFailed as error:
            # It never started working (a broken interpreter, say): write here rather than fail every save.
            _service.warn_once(
                "ready", f"{error}; background saves are written on a thread of the training process instead."
            )
            self._staging.written()
            return super().write_data(plan, planner)
        try:
            data = [self._staging.shipped(planner.resolve_data(item)) for item in plan.items]
            results = self._writer_process.write(Job(str(self.path), plan.storage_data, list(plan.items), data))
        finally:
            self._staging.written()
        future: Future[list[Any]] = Future()
        future.set_result(results)
        return future
