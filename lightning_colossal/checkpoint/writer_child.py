"""The checkpoint writer process: writes a background save's shard files from shared host memory.

``writer_process.py`` starts this file as a script (``python .../writer_child.py READ_FD WRITE_FD``), not as a module
of the package, so the process imports torch, DCP's file writer and ``writer_messages.py`` (loaded by its file) and
nothing else: no Lightning, no model code, and never the user's ``__main__`` (multiprocessing's spawn would run a
training script again that lacks an ``if __name__ == "__main__"`` guard).

A job (``writer_messages.Job``) is one rank's share of one DCP save. The process runs DCP's own
``FileSystemWriter.write_data`` on it, so the files are exactly the ones a write in the training process would make,
and answers with DCP's write results or the failure. It ends when the training process closes its end of the pipe,
which a training process that dies does too.
"""

from __future__ import annotations

import importlib.util
import io
import sys
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING or __package__:  # imported by the training process, for this file's path
    from lightning_colossal.checkpoint import writer_messages as messages
else:  # the writer process: the messages by their file, so that nothing of the package is imported
    _spec = importlib.util.spec_from_file_location("writer_messages", Path(__file__).with_name("writer_messages.py"))
    assert _spec is not None and _spec.loader is not None
    messages = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = messages  # before it runs, as importing it would
    _spec.loader.exec_module(messages)

# The messages under the names the training process's tests and tools use.
Job = messages.Job
SharedTensor = messages.SharedTensor
to_message = messages.to_message
from_message = messages.from_message

Mapped = dict[bytes, torch.UntypedStorage]  # storages mapped, by handle


def tensor_of(shared: messages.SharedTensor, storages: Mapped) -> torch.Tensor:
    """The tensor ``shared`` describes, its storage mapped unless ``storages`` holds it already (by handle)."""
    storage = storages.get(shared.handle)
    if storage is None:
        storage = torch.UntypedStorage._new_shared_filename_cpu(shared.manager, shared.handle, shared.storage_bytes)
        storages[shared.handle] = storage
    return torch.empty(0, dtype=shared.dtype).set_(storage, shared.storage_offset, shared.shape, shared.stride)


class _ShippedData:
    """The save planner's ``resolve_data`` for DCP's file writer: the data the training process resolved."""

    def __init__(self, job: messages.Job, mapped: Mapped) -> None:
        self._data = {
            item.index: io.BytesIO(value) if isinstance(value, bytes) else tensor_of(value, mapped)
            for item, value in zip(job.items, job.data, strict=True)
        }

    def resolve_data(self, write_item: Any) -> Any:
        return self._data[write_item.index]


def write(job: messages.Job, mapped: Mapped) -> list[Any]:
    """Write ``job``'s files with DCP's own writer; returns its write results. ``mapped``: the storages mapped so far
    (by handle), added to."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.planner import SavePlan

    writer = FileSystemWriter(job.directory, per_thread_copy_ahead=0)
    plan = SavePlan(items=job.items, storage_data=job.storage_prefix)
    return writer.write_data(plan, _ShippedData(job, mapped)).wait()  # type: ignore[arg-type]


def answer(message: messages.Job | messages.Forget, mapped: Mapped) -> messages.Reply:
    """The reply to one message. ``mapped`` keeps the storages of the last job mapped: the training process reuses
    its staging buffers from save to save (``writer_process.SharedBuffers``), and a mapping kept saves its page
    faults at the next save."""
    if isinstance(message, messages.Forget):
        mapped.clear()
        return messages.Reply(messages.DONE, [])
    try:
        reply = messages.Reply(messages.DONE, write(message, mapped))
    except BaseException as error:  # answered, not raised: the training process raises it, naming the save
        reply = messages.Reply(messages.FAILED, None, type(error).__name__, str(error), traceback.format_exc())
    # Storages this job did not use were freed by the training process: unmapped, their memory goes.
    used = {value.handle for value in message.data if isinstance(value, messages.SharedTensor)}
    for handle in [handle for handle in mapped if handle not in used]:
        del mapped[handle]
    return reply


def serve(jobs: Connection, replies: Connection) -> None:
    """Answer messages until the training process closes the pipe."""
    try:
        messages.send(replies, messages.Reply(messages.READY))
    except OSError:
        return  # the training process ended (a run that failed at its first step) while this one imported torch
    mapped: Mapped = {}
    while True:
        try:
            message = messages.receive(jobs)
        except EOFError:
            return  # the training process ended, normally or not
        reply = answer(message, mapped)
        try:
            messages.send(replies, reply)
        except OSError:
            return  # the training process ended while this job was written (BrokenPipeError)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    read_fd, write_fd = int(argv[1]), int(argv[2])
    serve(Connection(read_fd, writable=False), Connection(write_fd, readable=False))


if __name__ == "__main__":
    main(sys.argv)
