"""The messages between a training process and its checkpoint writer process, and how they travel.

This module imports only the standard library and torch: the writer process (``writer_child.py``) loads it by its
file, without the package, and the training process imports it as part of the package. The training process sends
a ``Job`` (or ``Forget``); the writer process answers with a ``Reply``: ``READY`` once its imports are done, then
``DONE`` (with DCP's write results) or ``FAILED`` (with the error) for each message it received.

A message travels pickled, but the pickle names the message types by their names alone (``to_message``: pickle's
persistent ids), and each side resolves those names to its own copy of this module (``from_message``). Pickled
plainly, a type would be named by its module, ``lightning_colossal.checkpoint.writer_messages``, and unpickling it in
the writer process would import the package, and Lightning with it (seconds and hundreds of MB). Everything else in
a message (DCP's write items and results, torch's dtypes) is pickled as usual.
"""

from __future__ import annotations

import io
import pickle
from multiprocessing.connection import Connection
from typing import Any, NamedTuple

import torch

READY = "ready"
DONE = "done"
FAILED = "failed"


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
    data: list[SharedTensor | bytes]  # a tensor staged in shared memory, or the bytes of a pickled object


class Forget(NamedTuple):
    """Unmap every staging buffer kept mapped: the training process has freed its pool."""


class Reply(NamedTuple):
    """The writer process's answer: ``status`` is ``READY``, ``DONE`` or ``FAILED``."""

    status: str
    results: list[Any] | None = None  # DONE: DCP's write results
    error_type: str = ""  # FAILED: the error's type, message and traceback there
    error: str = ""
    trace: str = ""

    def failure(self) -> str:
        return f"{self.error_type}: {self.error} (in the checkpoint writer process)\n{self.trace}"


MESSAGE_TYPES: dict[str, type] = {kind.__name__: kind for kind in (SharedTensor, Job, Forget, Reply)}


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> str | None:
        return obj.__name__ if isinstance(obj, type) and obj in MESSAGE_TYPES.values() else None


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> type:
        return MESSAGE_TYPES[pid]


def to_message(message: Job | Forget | Reply) -> bytes:
    """``message`` pickled, its types named by their names alone (no module: see the module's docstring)."""
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def from_message(data: bytes) -> Any:
    """The message ``to_message`` made, its types this module's."""
    return _Unpickler(io.BytesIO(data)).load()


def send(connection: Connection, message: Job | Forget | Reply) -> None:
    connection.send(to_message(message))


def receive(connection: Connection) -> Any:
    """The next message on ``connection``; raises ``EOFError`` or ``OSError`` as ``Connection.recv`` does."""
    return from_message(connection.recv())
