"""Checkpoint saves that training does not wait for: staging copies now, the write on a background thread.

``save_in_background`` copies every tensor this rank saves to host memory (pinned when it comes from a compute
device), synchronously, so training may change the live tensors as soon as it returns; a thread then runs the
whole of ``sharded.save_sharded`` (shards, the checkpoint file read back from them, the atomic commit) from those
copies, over a process group of its own. One save is in flight per process at most: the next save, a load, the end
of a fit (the strategy's hooks) call ``wait_for_background_save`` first, which raises a failed save's error naming
its path. A checkpoint asked to be removed while a save is in flight is removed only once that save committed
(``remove_after_background_save``), so a crash never leaves fewer checkpoints than a synchronous save would.

Nothing half-written is ever taken for a checkpoint: the background write commits exactly as a synchronous one
does (``atomic.py`` [Note: atomic save]), so a process killed mid-write leaves the previous checkpoint in place.

[Note: a background save of our own rather than dcp.async_save]
torch's ``dcp.async_save`` (torch 2.13) stages the state dict and runs ``dcp.save`` on an executor thread, returning
a future; it takes a process group for the thread's collectives. It was weighed first and not used, because a save
here is more than ``dcp.save``: the shards' id is agreed, the
staging directory made, and after every rank has written, rank 0 renames the shards, writes the checkpoint file from
them and commits it, then all ranks meet in a barrier so that none goes on (to a load, say) before the commit. All of
that must leave the training thread too, in that order, so ``async_save``'s future would need a second thread (or a
callback on its executor) to run the rest anyway, and ``save_sharded`` would have to be split around its
``dcp.save`` call. Running ``save_sharded`` whole on one thread of our own keeps a single save path, synchronous or
not, with the same commit and clean-up. Staging is ours too ([Note: our staging rather than DCP's DefaultStager]).

Each save chooses its route once, before it stages (``choose_route``): a ``ProcessRoute`` (the writer process writes
the shard files from shared memory, [Note: a writer process for background saves]) or a ``ThreadRoute`` (the
thread writes everything). The route allocates the staged copies and makes the shards' DCP writer; the process route
also owns the save's shared buffers and its one retry. As DCP chooses its executor once, as a type, nothing later in
the save asks again which way it goes.

[Note: our staging rather than DCP's DefaultStager]
torch 2.13's ``DefaultStager`` (``torch/distributed/checkpoint/staging.py``; ``dcp.async_save``'s ``AsyncStager``)
deep-copies a state dict to host memory through its ``StateDictStager``, in shared memory with
``StagingOptions(use_shared_memory=True)``, pinned, and, with an accelerator, off the training thread on a stream of
its own. It covers much of ``stage`` + ``writer_process.SharedBuffers``, and was weighed and not used:
- It does not know the disk tier's stand-ins ([Note: deferred tensors]): it would copy a stand-in's one element of
  NaN, where ``stage`` copies the value it stands for (``stand_ins.resolve``).
- It reuses a staged storage only for the same source storage (a weak map keyed by it): a tensor made anew for each
  save, as the disk tier's values read back are, gets a fresh shared storage each time. ``SharedBuffers`` reuses
  buffers by size instead; fresh ones cost 0.4 s of a 27M-parameter GPT's 0.45 s of staging (that class says).
- Its shared storages follow torch's sharing strategy (file descriptors on Linux, handed over by multiprocessing's
  pickler). The writer process is a plain subprocess, so that it never imports the user's ``__main__``, and maps
  each buffer by the file-system handle ``SharedBuffers`` takes when it allocates it.
- Its pinned and asynchronous options call ``torch.cuda``'s pinning and ``torch.Stream`` directly (its defaults raise
  an ``AssertionError`` where no accelerator is available), past ``distributed/device.py``, the seam that the
  fake-GPU tests substitute.
In its favour: with an accelerator it pins the shared storage itself, so a device tensor is copied once, straight
into shared memory, and can be staged while training goes on. Here a device tensor is staged in pinned memory and
copied again into shared memory on the background thread (``SharedStaging.shipped``). Should that copy show in
measurements, pin the shared buffers through ``distributed/device.py``; the stager itself would still not fit.

[Note: the background save's process group]
The thread's collectives (the id broadcast, barriers, DCP's gathers and scatters) must not interleave with the
training thread's collectives on one group: ranks would pair a barrier with a gradient all-reduce. They run on a gloo
group of their own over every rank (the staged copies are host tensors; gloo takes them on a GPU machine too), made
once per process on the training thread, when a fit that saves in the background starts (or at its first background
save), and reused by later ones (``group_cache.py`` [Note: one set of process groups per process]), with the
strategy's collective timeout.
"""

from __future__ import annotations

import copy
import functools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import StorageWriter
from torch.distributed.tensor import DTensor

from lightning_colossal.checkpoint import sharded, writer_process
from lightning_colossal.checkpoint.format import CheckpointDescription
from lightning_colossal.checkpoint.writer_messages import Job
from lightning_colossal.distributed import collectives, device, group_cache
from lightning_colossal.distributed.in_flight import Collective
from lightning_colossal.engine_parts import stand_ins

THREAD_NAME = "lightning_colossal-checkpoint-save"


class BackgroundSaveError(RuntimeError):
    """A checkpoint save that ran in the background failed; raised at the next save, load or end of the fit."""

    def __init__(self, path: Path, cause: BaseException) -> None:
        super().__init__(
            f"Saving the checkpoint {path} in the background failed ({type(cause).__name__}: {cause}); training had"
            " gone on while it was written. A save that fails before its commit leaves whatever was at that path"
            " before intact. Fix the cause (disk space, permissions, the path) and save again, or resume from the"
            " last checkpoint that was saved."
        )
        self.path = path


# ------------------------------------------------------------------------------------------------------ staging
def stage(state: Any, host_buffer: Callable[[int, torch.dtype, torch.device], Tensor] = device.host_buffer) -> Any:
    """A copy of the nested ``state`` (dicts, lists, tuples) whose every tensor is a new host tensor with the same
    values, ready to be read on any thread; ``DTensor``s stay ``DTensor``s of the same sharding around a host copy of
    their local piece. Other values are deep-copied. Returns once every copy has landed.

    ``host_buffer(numel, dtype, beside)`` allocates each copy (a save's ``SaveRoute.host_buffer``: shared memory for
    the writer process)."""
    pairs: list[tuple[Tensor, Tensor]] = []
    copies: dict[int, Any] = {}  # by id of the source: a tensor saved under two names is copied once

    def host_copy(tensor: Tensor) -> Tensor:
        target = host_buffer(tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape)
        pairs.append((target, tensor))
        return target

    def walk(value: Any) -> Any:
        if isinstance(value, Tensor):
            if id(value) not in copies and stand_ins.deferred_of(value) is not None:
                # A stand-in for state kept elsewhere (the disk tier): its value now, read from there.
                value_now = stand_ins.resolve(value.to_local() if isinstance(value, DTensor) else value)
                copies[id(value)] = (
                    DTensor(value_now, value._spec, requires_grad=False) if isinstance(value, DTensor) else value_now
                )
            if id(value) not in copies:
                if isinstance(value, DTensor):
                    # The sharding (mesh, placements, whole shape and stride) is the original's, so DCP plans the
                    # same items; DTensor.from_local would move a host piece back to the mesh's device.
                    copies[id(value)] = DTensor(host_copy(value.to_local()), value._spec, requires_grad=False)
                else:
                    copies[id(value)] = host_copy(value)
            return copies[id(value)]
        if isinstance(value, Mapping):
            return {key: walk(item) for key, item in value.items()}
        if isinstance(value, list):
            return [walk(item) for item in value]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(walk(item) for item in value)
        return copy.deepcopy(value)

    with torch.no_grad():
        staged = walk(state)
        device.copy_all(pairs)  # one wait for every copy from a device
    # ``walk`` refers to itself through its closure cell, a cycle only the garbage collector frees, and with it
    # ``copies`` (every staged copy) and the allocator: cut, the copies go when the save lets go of them.
    walk = None  # type: ignore[assignment]  # noqa: F841
    return staged


def staged_bytes(state: Any) -> int:
    """Bytes ``stage`` copies of ``state``: every tensor once, stand-ins at their value's size."""
    sizes: dict[int, int] = {}

    def walk(value: Any) -> None:
        if isinstance(value, Tensor):
            piece = value.to_local() if isinstance(value, DTensor) else value
            sizes[id(value)] = piece.numel() * piece.element_size()
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    return sum(sizes.values())


# ------------------------------------------------------------------------------------------------------ the group
def background_group(timeout: timedelta) -> ProcessGroup | None:
    """The gloo group over every rank that background saves communicate on ([Note: the background save's process
    group]); a collective of the whole world the first time. ``None`` without a process group."""
    if not collectives.is_initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(dist.group.WORLD))
    with Collective("new_group"):  # every rank must reach it: a rank missing here hangs the others
        group = group_cache.reuse_or_create(
            ("background_checkpoint_save", ranks),
            lambda: dist.new_group(ranks=list(ranks), timeout=timeout, backend="gloo"),
        )
    group_cache.set_group_timeout(group, timeout)
    return group


def prepare_background_saves(timeout: timedelta) -> None:
    """Make what background saves use before the first one needs it: their process group (a collective of every
    rank) and the writer process, whose imports then overlap training ([Note: a writer process for background
    saves])."""
    background_group(timeout)
    writer_process.start()


# ------------------------------------------------------------------------------------------------------ the save
class BackgroundSave:
    """One checkpoint save running ``write`` on its own (non-daemon) thread, with the removals it holds back."""

    def __init__(self, path: Path, write: Callable[[], None]) -> None:
        self.path = path
        self.error: BaseException | None = None
        self._write: Callable[[], None] | None = write
        self._lock = threading.Lock()
        self._removals: list[Callable[[], None]] = []
        self._taking_removals = True
        # Not a daemon: a process that ends normally finishes the save first (a killed one keeps the previous
        # checkpoint, [Note: atomic save]).
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME)

    def start(self) -> BackgroundSave:
        self._thread.start()
        return self

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()

    def remove_after_commit(self, remove: Callable[[], None]) -> bool:
        """Hold ``remove`` back until this save committed; ``False`` when the save already committed (the caller
        removes now). After a failed save nothing is removed: the checkpoints it would have replaced stay."""
        with self._lock:
            if self._taking_removals:
                self._removals.append(remove)
                return True
            return self.error is not None

    def _run(self) -> None:
        try:
            assert self._write is not None, "a background save runs once"
            self._write()
        except BaseException as error:
            self.error = error
            with self._lock:
                self._taking_removals = False
                self._removals.clear()
            return
        finally:
            self._write = None  # the staged copies go now, not when the save is waited for
        while True:
            with self._lock:
                if not self._removals:
                    self._taking_removals = False
                    return
                remove = self._removals.pop(0)
            try:
                remove()
            except BaseException as error:
                self.error = self.error or error


# ------------------------------------------------------------------------------------------------------ the routes
class SaveRoute(ABC):
    """How one background save reaches the disk, chosen once for it (``choose_route``): where its tensors are staged
    (``host_buffer``, ``stage``'s allocator) and which DCP writer writes its shard files (``storage_writer``: DCP's
    file writer on the background thread when ``None``)."""

    @abstractmethod
    def host_buffer(self, numel: int, dtype: torch.dtype, beside: torch.device) -> Tensor: ...

    def storage_writer(self) -> Callable[[str], StorageWriter] | None:
        return None


class ThreadRoute(SaveRoute):
    """The background thread writes everything, from copies in host memory (pinned beside an accelerator)."""

    def host_buffer(self, numel: int, dtype: torch.dtype, beside: torch.device) -> Tensor:
        return device.host_buffer(numel, dtype, beside=beside)


class ProcessRoute(SaveRoute):
    """The writer process writes the shard files from copies staged in shared memory, the thread the rest ([Note: a
    writer process for background saves]). Owns the save's buffers (``writer_process.SharedStaging``) and its
    retry: a writer process found dead when the shards are handed over is replaced, once per save (the staged
    copies are intact, and files it may have begun are rewritten whole); a second death fails the save."""

    def __init__(self, process: writer_process.WriterProcess, staging: writer_process.SharedStaging) -> None:
        self._process = process
        self._staging = staging
        self._replaced = False

    def host_buffer(self, numel: int, dtype: torch.dtype, beside: torch.device) -> Tensor:
        return self._staging.host_buffer(numel, dtype, beside)

    def storage_writer(self) -> Callable[[str], StorageWriter]:
        return functools.partial(writer_process.ProcessShardWriter, process=self, staging=self._staging)

    def wait_until_ready(self) -> None:
        self._process.wait_until_ready()

    def write(self, job: Job) -> list[Any]:
        try:
            return self._process.write(job)
        except writer_process.WriterProcessEnded:
            if self._replaced:
                raise
            replacement = writer_process.start()  # the old one may have died between saves
            if replacement is None or replacement is self._process:
                raise
            self._process, self._replaced = replacement, True
            return replacement.write(job)


def choose_route(staged_bytes: int, ranks_per_node: int) -> SaveRoute:
    """The route of a save staging ``staged_bytes`` on each of the node's ``ranks_per_node`` ranks: the writer
    process where shared memory has room for them all and the process starts, else the thread (each warns once)."""
    if writer_process.room_for(staged_bytes, ranks_per_node):
        process = writer_process.start()
        if process is not None:
            return ProcessRoute(process, writer_process.staging())
    return ThreadRoute()


# ------------------------------------------------------------------------------------------------------ one at a time
_in_flight: BackgroundSave | None = None  # touched by the training thread only


def save_in_background(
    path: Path,
    tensor_state: dict[str, Any],
    metadata: dict[str, Any],
    description: CheckpointDescription | None,
    timeout: timedelta,
    ranks_per_node: int = 1,
) -> BackgroundSave:
    """Stage this rank's part of a checkpoint now and write it (``sharded.save_sharded``) on a background thread,
    its shard files by the writer process where shared memory has room for the staged copies of the node's
    ``ranks_per_node`` ranks (``choose_route``).

    Every rank calls this together, as for ``save_sharded``. A save still in flight is waited for first (its error
    is raised here). Returns the save; ``wait_for_background_save`` waits for it.
    """
    global _in_flight
    wait_for_background_save()
    group = background_group(timeout)
    route = choose_route(staged_bytes(tensor_state), ranks_per_node)
    staged_tensors = stage(tensor_state, route.host_buffer)
    # Lightning's entries hold references to live objects (a callback's dict of best checkpoints, schedulers' lists).
    staged_metadata = copy.deepcopy(metadata)
    shard_writer = route.storage_writer()

    def write() -> None:
        sharded.save_sharded(
            path, staged_tensors, staged_metadata, group=group, description=description, storage_writer=shard_writer
        )

    _in_flight = BackgroundSave(path, write).start()
    return _in_flight


def background_save_in_flight() -> BackgroundSave | None:
    """The background save started last and not yet waited for (it may have finished meanwhile)."""
    return _in_flight


def wait_for_background_save() -> None:
    """Wait until the background save in flight (if any) has finished.

    Raises:
        BackgroundSaveError: that save failed; names its path, with the failure as the cause.
    """
    global _in_flight
    pending = _in_flight
    if pending is None:
        return
    pending.join()
    _in_flight = None
    if pending.error is not None:
        raise BackgroundSaveError(pending.path, pending.error) from pending.error


def finish_background_saves() -> None:
    """Wait for the save in flight (raising its error, as ``wait_for_background_save``) and free the staging
    buffers kept for the next one: the end of a fit."""
    try:
        wait_for_background_save()
    finally:
        writer_process.release_staging()


def remove_after_background_save(remove: Callable[[], None]) -> None:
    """Run ``remove`` (deleting an older checkpoint) once the save in flight committed, or now when none is."""
    pending = _in_flight
    if pending is None or not pending.remove_after_commit(remove):
        remove()
