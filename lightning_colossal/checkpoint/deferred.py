"""DCP's save and load planners for stand-ins (``engine_parts/stand_ins.py`` [Note: deferred tensors]): each
stand-in's value is read when DCP writes it, and written where it lives once a load has filled it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.planner import ReadItem, WriteItem

from lightning_colossal.engine_parts.stand_ins import deferred_of, has_stand_ins, pending_values

__all__ = ["DeferredLoadPlanner", "DeferredSavePlanner", "deferred_save_writer", "has_stand_ins"]


class DeferredSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, reading each stand-in's value when DCP writes it ([Note: deferred tensors]).

    DCP's file writer keeps a reference to every tensor of a file until the file is closed. With its serial loader
    (``deferred_save_writer``) it resolves an item only after writing the one before, so the memory of the previous
    stand-in's value is released (its storage resized to nothing) when the next is read: one value at a time.
    """

    def __init__(self) -> None:
        super().__init__()
        self._previous: Tensor | None = None

    def resolve_data(self, write_item: WriteItem) -> Any:
        data = super().resolve_data(write_item)
        deferred = deferred_of(data)
        if deferred is None:
            return data
        if self._previous is not None:
            self._previous.untyped_storage().resize_(0)  # written: the writer's reference may stay, the bytes go
        value = deferred.read()
        self._previous = value
        if value.shape != data.shape:
            raise RuntimeError(
                f"A checkpoint item {write_item.index.fqn!r} covers part of a tensor kept on disk; deferred tensors are"
                " saved whole by the rank that holds them."
            )
        return value


def deferred_save_writer(path: str) -> FileSystemWriter:
    """DCP's file writer for ``path`` that resolves items strictly one after another (no copy-ahead, which would
    read several stand-ins before writing them, and breaks ``DeferredSavePlanner``'s release of the previous one)."""
    return FileSystemWriter(path, per_thread_copy_ahead=0)


class DeferredLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, assembling each stand-in's value and writing it where it lives once complete."""

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        destination = self.lookup_tensor(read_item.dest_index)
        deferred = deferred_of(destination)
        if deferred is None:
            return super().resolve_tensor(read_item)
        if deferred.pending is None:
            # Start from the current value: a partial load (allow_partial) may leave some of it as it is.
            deferred.pending = deferred.read().clone()
            deferred.arrived = 0
        return self.transform_tensor(read_item, deferred.pending)

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        deferred = deferred_of(self.lookup_tensor(read_item.dest_index))
        if deferred is None:
            return super().commit_tensor(read_item, tensor)
        assert deferred.pending is not None
        deferred.arrived += int(torch.Size(read_item.lengths).numel())
        if deferred.arrived >= deferred.pending.numel():
            deferred.write(deferred.pending)
            deferred.pending = None
        return None

    def finish(self) -> None:
        """Write the values a load only partly filled (items missing under ``allow_partial``)."""
        for deferred in pending_values():
            if deferred.pending is not None:
                deferred.write(deferred.pending)
                deferred.pending = None
