"""The checkpoint writer process: writes a background save's shard files from shared host memory.

``writer_process.py`` starts this file as a script (``python .../writer_child.py READ_FD WRITE_FD``), not as a module
of the package, so the process imports torch and DCP's file writer and nothing else: no Lightning, no model code,
and never the user's ``__main__`` (multiprocessing's spawn would run a training script again that lacks an
``if __name__ == "__main__"`` guard). It also owns the messages both sides exchange; the training process imports
it for them.

A job is one rank's share of one DCP save: the directory, DCP's file-name prefix for this rank, the write items and,
per item, its data as a ``SharedTensor`` (a tensor in shared host memory the training process staged) or the bytes
of a pickled object. The process runs DCP's own ``FileSystemWriter.write_data`` on them, so the files are exactly the
ones a write in the training process would make, and answers with DCP's write results or the failure. It ends when
the training process closes its end of the pipe, which a training process that dies does too.
"""

from __future__ import annotations

import io
import os
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

READY = "ready"
DONE = "done"
FAILED = "failed"
FORGET = "forget"  # a message instead of a job: unmap every storage (the training process has freed its pool)


class SharedTensor(NamedTuple):
    """A tensor in shared host memory, by the handle of its storage (torch's file-system sharing) and its view."""

    manager: bytes
    handle: bytes
    storage_bytes: int
    dtype: torch.dtype
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


class Job(NamedTuple):
    """One rank's share of one save: DCP's write items for ``directory`` and each item's data, in the same order."""

    directory: str
    storage_prefix: Any  # DCP's _StoragePrefix: the file names of this rank
    items: list[Any]  # DCP's WriteItem
    data: list[SharedTensor | bytes]


def to_message(job: Job) -> tuple[Any, ...]:
    """``job`` as plain tuples: pickled, the named tuples would name this module as part of the package, and
    unpickling them here would import the package (Lightning with it: seconds and hundreds of MB)."""
    data = [tuple(value) if isinstance(value, SharedTensor) else value for value in job.data]
    return (job.directory, job.storage_prefix, job.items, data)


def from_message(message: tuple[Any, ...]) -> Job:
    directory, storage_prefix, items, data = message
    shipped = [value if isinstance(value, bytes) else SharedTensor(*value) for value in data]
    return Job(directory, storage_prefix, items, shipped)


def tensor_of(shared: SharedTensor, storages: dict[bytes, torch.UntypedStorage]) -> torch.Tensor:
    """The tensor ``shared`` describes, its storage mapped unless ``storages`` holds it already (by handle)."""
    storage = storages.get(shared.handle)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_filename_cpu(shared.manager, shared.handle, shared.storage_bytes)
        storages[shared.handle] = storage
    return torch.empty(0, dtype=shared.dtype).set_(storage, shared.storage_offset, shared.shape, shared.stride)


# The storages mapped by the last job, by handle: the training process reuses its staging buffers from save to save
# (``writer_process.SharedBuffers``), and a mapping kept saves its page faults at the next save.
_mapped: dict[bytes, torch.UntypedStorage] = {}


class _ShippedData:
    """The save planner's ``resolve_data`` for DCP's file writer: the data the training process resolved."""

    def __init__(self, job: Job) -> None:
        self._data = {
            item.index: io.BytesIO(value) if isinstance(value, bytes) else tensor_of(value, _mapped)
            for item, value in zip(job.items, job.data, strict=True)
        }

    def resolve_data(self, write_item: Any) -> Any:
        return self._data[write_item.index]


def write(job: Job) -> list[Any]:
    """Write ``job``'s files with DCP's own writer; returns its write results."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan

    writer = FileSystemWriter(job.directory, per_thread_copy_ahead=0)
    plan = SavePlan(items=job.items, storage_data=job.storage_prefix)
    return writer.write_data(plan, _ShippedData(job)).wait()  # type: ignore[arg-type]


def serve(jobs: Connection, replies: Connection) -> None:
    """Answer jobs until the training process closes the pipe."""
    try:
        replies.send((READY, os.getpid()))
    except OSError:
        return  # the training process ended (a run that failed at its first step) while this one imported torch
    while True:
        try:
            message = jobs.recv()
        except EOFError:
            return  # the training process ended, normally or not
        if message == FORGET:
            _mapped.clear()
            answer: tuple[Any, ...] = (DONE, [])
        else:
            job = from_message(message)
            try:
                answer = (DONE, write(job))
            except BaseException as error:  # answered, not raised: the training process raises it, naming the save
                answer = (FAILED, type(error).__name__, str(error), traceback.format_exc())
            # Storages this job did not use were freed by the training process: unmapped, their memory goes.
            used = {value.handle for value in job.data if isinstance(value, SharedTensor)}
            for handle in [handle for handle in _mapped if handle not in used]:
                del _mapped[handle]
        try:
            replies.send(answer)
        except OSError:
            return  # the training process ended while this job was written (BrokenPipeError)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    read_fd, write_fd = int(argv[1]), int(argv[2])
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main(sys.argv)
