"""Optimizer state on disk between steps, stepped record by record (the engines' disk tier; no Lightning here).

[Note: streaming the optimizer step]
The user's optimizer (torch's Adam, AdamW, SGD, ...) updates every parameter on its own: its state is per parameter
and its arithmetic elementwise. So stepping the parameters a few at a time, with each ``param_groups[i]["params"]``
narrowed to those few for one ``optimizer.step()``, computes exactly what one step over all of them computes, bit for
bit, with the same hyperparameters (the group dicts themselves are kept, so LR schedulers keep working). That is what
lets the state live on disk: a *record* (one Gemini chunk's members, or a run of ZeRO's parameter shards) is read into
a staging buffer, its state tensors are bound into ``optimizer.state`` as views of that buffer, the record is stepped,
and the buffer is written back, while the next record is read and the previous one written on I/O threads. Host
memory holds ``STAGING_SLOTS`` records of state, however large the model.

Between steps ``optimizer.state[master][key]`` holds a *placeholder*: a zero-stride view of one zero, shaped like the
state, so code that only looks at shapes keeps working; nothing may read values from it. Everything that needs the
values goes through this class (``materialise`` / ``store``: checkpoints). A step of the raw optimizer outside
``step`` would update placeholders, so it is refused with an error naming the fix.

Optimizers that couple parameters (LBFGS: a closure and one global line search) are refused: stepping a subset would
change what they compute.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_colossal.disk.files import DiskTierError, DiskTierFull, TierDirectory, TierFile, align_up, aligned_buffer
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import optimizer_takeover, stand_ins

_HOST = torch.device("cpu")
#: The one zero per dtype every placeholder views (what makes a placeholder recognisable at any size).
_PLACEHOLDER_ZEROS: dict[torch.dtype, Tensor] = {}
#: Staging buffers: one being read, one being stepped, one being written.
STAGING_SLOTS = 3
#: Each state tensor starts at a multiple of this inside its record (any dtype's alignment).
_TENSOR_ALIGNMENT = 64


@dataclass
class _Entry:
    """One state tensor of one master inside a record."""

    master: Tensor
    key: str
    dtype: torch.dtype
    offset: int  # bytes from the record's start

    @property
    def nbytes(self) -> int:
        return self.master.numel() * _element_size(self.dtype)


@dataclass
class _Record:
    masters: list[Tensor]
    entries: list[_Entry] = field(default_factory=list)
    nbytes: int = 0
    file_offset: int = 0
    written: bool = False  # holds values on disk (after the first step, or a load)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def placeholder(like: Tensor, dtype: torch.dtype) -> Tensor:
    """A tensor shaped like ``like`` backed by one shared zero: stands in for state that lives on disk."""
    zero = _PLACEHOLDER_ZEROS.setdefault(dtype, torch.zeros((), dtype=dtype))
    return zero.expand(like.shape)


def is_placeholder(tensor: Tensor) -> bool:
    """Whether ``tensor`` stands in for state on disk (``placeholder``)."""
    zero = _PLACEHOLDER_ZEROS.get(tensor.dtype)
    return (
        zero is not None
        and tensor.device.type == "cpu"
        and tensor.untyped_storage().data_ptr() == zero.untyped_storage().data_ptr()
    )


def state_bytes_per_element(optimizer: Optimizer) -> list[int]:
    """Per param group, the bytes of optimizer state per parameter element that the disk tier would hold (Adam: 8)."""
    return [sum(_element_size(dtype) for _, dtype in layout) for layout in _state_layout_by_group(optimizer)]


def record_bytes(optimizer: Optimizer, groups: Sequence[Sequence[Tensor]]) -> list[int]:
    """Per group of masters, the bytes of its record in the tier (its state tensors, each aligned inside it), as
    ``DiskOptimizerState`` will lay it out: what a budget decides with before the tier exists."""
    return [record.nbytes for record in _lay_out_records(optimizer, groups)]


def staging_bytes_for(record_sizes: Sequence[int]) -> int:
    """Host bytes of the staging buffers a tier of records of ``record_sizes`` bytes streams its step through."""
    sizes = [size for size in record_sizes if size]
    return min(STAGING_SLOTS, len(sizes)) * align_up(max(sizes)) if sizes else 0


def _lay_out_records(optimizer: Optimizer, groups: Sequence[Sequence[Tensor]]) -> list[_Record]:
    """One record per group: each master's state tensors (the optimizer's layout) at aligned offsets."""
    moments = _state_layout_by_group(optimizer)
    group_of = {id(master): index for index, group in enumerate(optimizer.param_groups) for master in group["params"]}
    records = []
    for masters in groups:
        record = _Record(list(masters))
        offset = 0
        for master in masters:
            for key, dtype in moments[group_of[id(master)]]:
                offset = -(-offset // _TENSOR_ALIGNMENT) * _TENSOR_ALIGNMENT
                entry = _Entry(master, key, dtype, offset)
                record.entries.append(entry)
                offset += entry.nbytes
        record.nbytes = offset
        records.append(record)
    return records


def open_disk_state(
    optimizer: Optimizer,
    groups: Sequence[Sequence[Tensor]],
    offload_dir: str,
    rank: int,
    beside: torch.device,
    what: str,
) -> DiskOptimizerState:
    """The disk tier for ``groups``' state under ``offload_dir``: its directory made, the room checked and claimed
    before training starts ([Note: the tier's directory is never a checkpoint] in ``files.py``)."""
    directory = TierDirectory(offload_dir, rank)
    try:
        state = DiskOptimizerState(optimizer, groups, TierFile(directory, "optimizer_state.bin"), beside)
        directory.check_room(state.planned_bytes, what)
        state.file.allocate()
    except BaseException:
        directory.close()
        raise
    return state


class DiskOptimizerState:
    """The state of ``groups``' masters in ``tier_file`` between steps ([Note: streaming the optimizer step]).

    Args:
        optimizer: the engine's optimizer (its parameters are the engine's masters).
        groups: the masters whose state goes to disk, one record per group (each a list of master tensors).
        tier_file: where the records live.
        beside: the compute device (staging buffers are pinned beside an accelerator).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        groups: Sequence[Sequence[Tensor]],
        tier_file: TierFile,
        beside: torch.device = _HOST,
    ) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "The disk tier cannot hold LBFGS's state: LBFGS steps all parameters together through a closure."
                " Use another optimizer or drop offload_dir / disk_fraction."
            )
        self.optimizer = optimizer
        self.file = tier_file
        self.beside = beside
        self.records: list[_Record] = []
        for record in _lay_out_records(optimizer, groups):
            if record.nbytes:
                record.file_offset = tier_file.reserve(record.nbytes)
            self.records.append(record)
        self.records = [record for record in self.records if record.nbytes]
        # Masters whose optimizer keeps no state shaped like them (plain SGD) step with the resident ones.
        self.on_disk = {id(entry.master) for record in self.records for entry in record.entries}
        self.slot_bytes = max((record.nbytes for record in self.records), default=0)
        self._streaming = False
        self._slots: list[Tensor] | None = None
        self._guard = optimizer.register_step_pre_hook(self._refuse_outside_streaming) if self.records else None
        self.bytes_read = 0
        self.bytes_written = 0
        # A checkpoint's entry reads and writes (``defer``): the one record open in host memory.
        self._open_record: _Record | None = None
        self._open_buffer: Tensor | None = None
        self._open_record_changed = False

    @property
    def planned_bytes(self) -> int:
        """Bytes of this rank's state on disk."""
        return self.file.reserved_bytes

    @property
    def staging_bytes(self) -> int:
        """Host bytes a step streams the state through."""
        return staging_bytes_for([record.nbytes for record in self.records])

    def _refuse_outside_streaming(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self._streaming:
            raise RuntimeError(
                "This optimizer's state lives on disk between steps (offload_dir / disk_fraction), so it cannot be"
                " stepped directly: step it through the strategy (automatic optimization, or `self.optimizers().step()`"
                " in manual optimization), which streams the state in and out."
            )

    def close(self) -> None:
        """Stop guarding the optimizer, close the file and remove the tier's directory (its state is gone)."""
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
        self._finish_deferred()
        # The placeholders go too: nothing may later read zeros as this state.
        for record in self.records:
            for entry in record.entries:
                self.optimizer.state.get(entry.master, {}).pop(entry.key, None)
        self.records = []
        self._slots = None
        self.file.close()
        self.file.directory.close()

    # ------------------------------------------------------------------------------------------------------ stepping
    def step(self, group: ProcessGroup | None = None, **kwargs: Any) -> Any:
        """One optimizer step of every master: the resident ones at once, then the records streamed through
        ``STAGING_SLOTS`` buffers ([Note: streaming the optimizer step]).

        With ``group``, the ranks agree afterwards whether any rank's disk failed (one small all-reduce), so a full
        disk on one rank stops every rank at once with an error, instead of leaving the others waiting in the next
        collective.
        """
        failure: DiskTierError | None = None
        output = None
        try:
            output = self._step(**kwargs)
        except DiskTierError as error:
            failure = error
        if group is not None and collectives.world_size(group) > 1:
            flag = torch.tensor([0 if failure is None else 2 if isinstance(failure, DiskTierFull) else 1])
            with Activity("agreeing whether every rank's disk tier stepped"):
                collectives.all_reduce(flag, op="max", group=group)
            if failure is None and flag.item():
                kind = DiskTierFull if flag.item() == 2 else DiskTierError
                raise kind(
                    f"Another rank's disk tier failed{' (its disk is full)' if flag.item() == 2 else ''} in this"
                    f" optimizer step (this rank's tier is under {self.file.directory.parent}); that rank's error says"
                    " why. Every rank stopped; the last checkpoint is intact (checkpoints are written atomically)."
                )
        if failure is not None:
            raise failure
        return output

    def _step(self, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise ValueError("The disk tier steps the optimizer record by record and cannot run a closure in step().")
        self._finish_deferred()  # a checkpoint described the state and nobody released it
        resident = {
            id(master)
            for group in self.optimizer.param_groups
            for master in group["params"]
            if id(master) not in self.on_disk
        }
        if not self.records:
            return self._step_only(resident) if resident else None
        if self._slots is None:
            # Kept from step to step: pinned host memory is slow to allocate, and the three buffers are the tier's
            # whole host footprint (``staging_bytes``).
            self._slots = [
                aligned_buffer(self.slot_bytes, self.beside) for _ in range(min(STAGING_SLOTS, len(self.records)))
            ]
        slots: deque[Tensor] = deque(self._slots)
        writes: deque[tuple[Future[None], Tensor]] = deque()
        reads: dict[int, tuple[Future[None] | None, Tensor]] = {}
        next_read = 0

        def reclaim_written(wait_for_one: bool = False) -> None:
            """Buffers whose writes finished back into ``slots``; with ``wait_for_one``, at least the oldest."""
            while writes and (writes[0][0].done() or (wait_for_one and not slots)):
                finished, slot = writes.popleft()
                finished.result()
                slots.append(slot)

        def start_reads(needed: int) -> None:
            """Reads started up to record ``needed`` (waiting for a write to free a buffer if it must), then further
            ahead into whatever buffers are free already: with more than three buffers, reads queue deeper."""
            nonlocal next_read
            while next_read < len(self.records):
                reclaim_written(wait_for_one=next_read <= needed)
                if not slots:
                    return
                record = self.records[next_read]
                slot = slots.popleft()
                future = self.file.read(record.file_offset, slot[: _io_bytes(record)]) if record.written else None
                reads[next_read] = (future, slot)
                next_read += 1

        output = None
        try:
            start_reads(0)  # the first records are read while the parameters kept in memory step
            if resident:
                output = self._step_only(resident)
            for index, record in enumerate(self.records):
                start_reads(index + 1)
                future, slot = reads.pop(index)
                if future is not None:
                    future.result()
                    self.bytes_read += _io_bytes(record)
                if record.written:
                    self._bind(record, slot)
                output = self._step_only({id(master) for master in record.masters})
                self._copy_in(record, slot)
                writes.append((self.file.write(record.file_offset, slot[: _io_bytes(record)]), slot))
                self.bytes_written += _io_bytes(record)
                record.written = True
                self._unbind(record)
            while writes:
                writes.popleft()[0].result()
        finally:
            # An I/O error leaves no thread writing into buffers that are about to be freed.
            for pending, _ in writes:
                pending.exception()
            for pending, _ in reads.values():
                if pending is not None:
                    pending.exception()
        return output

    def _step_only(self, keep: set[int]) -> Any:
        with optimizer_takeover.narrowed_to(self.optimizer, keep):
            self._streaming = True
            try:
                return self.optimizer.step()
            finally:
                self._streaming = False

    def _bind(self, record: _Record, slot: Tensor) -> None:
        for entry in record.entries:
            self.optimizer.state[entry.master][entry.key] = _view(slot, entry)

    def _copy_in(self, record: _Record, slot: Tensor) -> None:
        """After a record's step: make sure the slot holds its state (the first step creates fresh tensors)."""
        for entry in record.entries:
            value = self.optimizer.state[entry.master].get(entry.key)
            if value is None:
                raise DiskTierError(
                    f"The optimizer ({type(self.optimizer).__name__}) did not create state {entry.key!r} for a"
                    " parameter in its first step, though a trial step on one element did: the disk tier cannot lay"
                    " out its state. Use a per-parameter optimizer (Adam, AdamW, SGD, ...) or drop offload_dir."
                )
            target = _view(slot, entry)
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)

    def _unbind(self, record: _Record) -> None:
        for entry in record.entries:
            self.optimizer.state[entry.master][entry.key] = placeholder(entry.master, entry.dtype)

    # ------------------------------------------------------------------------------------------------------ checkpoints
    def defer(self) -> None:
        """Put a stand-in for each state tensor on disk into ``optimizer.state``: a checkpoint save reads, and a load
        fills, them one at a time through this tier ([Note: deferred tensors] in ``engine_parts/stand_ins.py``), so
        neither holds this rank's state in host memory. ``release`` (after a save) and ``store`` (after a load)
        put the placeholders back."""
        self._finish_deferred()
        for record in self.records:
            if not record.written:
                continue
            for entry in record.entries:
                self.optimizer.state[entry.master][entry.key] = stand_ins.stand_in(
                    entry.master.shape,
                    entry.dtype,
                    read=functools.partial(self._read_entry, record, entry),
                    write=functools.partial(self._write_entry, record, entry),
                )

    def _open(self, record: _Record) -> Tensor:
        """The host buffer holding ``record`` for entry reads and writes (one record at a time)."""
        if self._open_record is not record:
            self._close_open_record()
            if self._open_buffer is None:
                self._open_buffer = aligned_buffer(self.slot_bytes)
            self.file.read_now(record.file_offset, self._open_buffer[: _io_bytes(record)])
            self.bytes_read += _io_bytes(record)
            self._open_record = record
        assert self._open_buffer is not None
        return self._open_buffer

    def _read_entry(self, record: _Record, entry: _Entry) -> Tensor:
        return _view(self._open(record), entry).clone()

    def _write_entry(self, record: _Record, entry: _Entry, value: Tensor) -> None:
        _view(self._open(record), entry).copy_(value)
        self._open_record_changed = True

    def _close_open_record(self) -> None:
        record = self._open_record
        if record is not None and self._open_record_changed:
            assert self._open_buffer is not None
            self.file.write_now(record.file_offset, self._open_buffer[: _io_bytes(record)])
            self.bytes_written += _io_bytes(record)
        self._open_record = None
        self._open_record_changed = False

    def _finish_deferred(self) -> None:
        """Write the record a load was filling, withdraw the stand-ins and put placeholders back."""
        self._close_open_record()
        self._open_buffer = None
        for record in self.records:
            for entry in record.entries:
                current = self.optimizer.state.get(entry.master, {}).get(entry.key)
                if current is not None and stand_ins.deferred_of(current) is not None:
                    stand_ins.withdraw(current)
                    self.optimizer.state[entry.master][entry.key] = placeholder(entry.master, entry.dtype)

    def materialise(self) -> None:
        """Read every record into fresh tensors in ``optimizer.state`` (a load of whole tensors copies into them;
        ``store`` undoes it)."""
        self._finish_deferred()
        for record in self.records:
            if not record.written:
                continue
            buffer = aligned_buffer(record.nbytes)
            self.file.read_now(record.file_offset, buffer[: _io_bytes(record)])
            for entry in record.entries:
                self.optimizer.state[entry.master][entry.key] = _view(buffer, entry).clone()

    def release(self) -> None:
        """Put placeholders back after a checkpoint save (the values on disk did not change)."""
        self._finish_deferred()
        for record in self.records:
            if record.written:
                self._unbind(record)

    def store(self) -> None:
        """After a load: finish what it wrote through stand-ins, write whole state tensors now in
        ``optimizer.state`` to their records, and put placeholders back."""
        self._finish_deferred()
        for record in self.records:
            state_present = all(
                isinstance(self.optimizer.state.get(entry.master, {}).get(entry.key), Tensor)
                and not is_placeholder(self.optimizer.state[entry.master][entry.key])
                for entry in record.entries
            )
            if not state_present:
                continue
            buffer = aligned_buffer(record.nbytes)
            self._copy_in(record, buffer)
            self.file.write_now(record.file_offset, buffer[: _io_bytes(record)])
            record.written = True
            self._unbind(record)

    @contextmanager
    def materialised(self) -> Iterator[None]:
        self.materialise()
        try:
            yield
        finally:
            self.store()


def _io_bytes(record: _Record) -> int:
    return align_up(record.nbytes)


def _view(buffer: Tensor, entry: _Entry) -> Tensor:
    return buffer[entry.offset : entry.offset + entry.nbytes].view(entry.dtype).view(entry.master.shape)


def _state_layout_by_group(optimizer: Optimizer) -> list[list[tuple[str, torch.dtype]]]:
    """Per param group, the state tensors the optimizer keeps shaped like a parameter (key and dtype), found by one
    trial step of a fresh optimizer of the same class and settings on a two-element parameter."""
    layouts = []
    for group in optimizer.param_groups:
        settings = {key: value for key, value in group.items() if key != "params"}
        probe = torch.zeros(2, dtype=torch.float32, requires_grad=True)
        probe.grad = torch.zeros_like(probe)
        try:
            trial = type(optimizer)([{"params": [probe], **settings}], **_constructor_defaults(optimizer))
            trial.step()
        except Exception as error:  # noqa: BLE001 - any failure means the layout cannot be known up front
            raise ValueError(
                f"The disk tier could not lay out the state of {type(optimizer).__name__}: a trial step on one"
                f" parameter failed ({error}). Use a per-parameter optimizer (Adam, AdamW, SGD, ...) or drop"
                " offload_dir."
            ) from error
        layouts.append(
            [
                (key, value.dtype)
                for key, value in trial.state[probe].items()
                if isinstance(value, Tensor) and value.shape == probe.shape
            ]
        )
    return layouts


def _constructor_defaults(optimizer: Optimizer) -> dict[str, Any]:
    """Constructor arguments for a trial copy: torch optimizers need ``lr`` positionally in some versions."""
    return {"lr": optimizer.defaults["lr"]} if "lr" in optimizer.defaults else {}
