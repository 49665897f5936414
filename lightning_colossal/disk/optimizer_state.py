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

A master no gradient has reached yet (an unused layer) gets no state from the optimizer, in memory or here: its record
marks it ``stateless`` and ``optimizer.state`` holds nothing for it, so its first gradient starts its state fresh,
and checkpoints neither hold nor demand any for it.

Optimizers that couple parameters (LBFGS: a closure and one global line search) are refused: stepping a subset would
change what they compute.

[Note: the step's I/O runs on]
A step does not wait for its last writes: they finish during the forward and backward that follow, and once they
have, the next step's first records are read into the freed buffers (``_read_ahead``), so the next step starts
stepping at once instead of waiting for its first reads. Between steps nothing else changes the records, except
through this class: every read or change of the file outside a step (checkpoints' entry reads and writes,
``materialise``, ``store``, ``close``) first waits for that I/O and drops the reads ahead (``_settle``), so it sees
what the step wrote and the next step reads again what it changed. A failed trailing write surfaces in the next
step (its buffer's read ahead fails with it), where the ranks agree on it as on any disk failure in a step, or in
whatever settles first.

[Note: masters on disk]
With ``masters_on_disk`` a record also holds its masters' own values (fp32, ahead of their state), so the engine keeps
no host copy of them either. Each master tensor keeps its identity (the optimizer's ``param_groups`` and ``state`` are
keyed by it) but its storage changes: between steps it is a placeholder, and while its record steps its ``.data`` is
a view of the staging buffer, so the optimizer updates the record in place. Its gradient stays where the engine put
it. After the record steps, ``after_record`` (the engine's) receives the record's masters still bound to the buffer,
to copy them into its parameters, before the buffer is written back and may be reused for the next read. Outside a
step the engine reaches the values through ``read_masters`` / ``write_masters`` (one record in host memory at a time)
and, for checkpoints, through ``master_stand_in`` ([Note: deferred tensors] in ``engine_parts/stand_ins.py``).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_colossal.disk.files import (
    DiskTierError,
    DiskTierFull,
    TierDirectory,
    TierFile,
    align_up,
    aligned_buffer,
    all_of,
)
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
    """One state tensor of one master inside a record, or (``key`` None) the master's own values."""

    master: Tensor
    key: str | None
    dtype: torch.dtype
    offset: int  # bytes from the record's start

    @property
    def nbytes(self) -> int:
        return self.master.numel() * _element_size(self.dtype)


@dataclass
class _Record:
    masters: list[Tensor]
    entries: list[_Entry] = field(default_factory=list)  # optimizer state
    master_entries: list[_Entry] = field(default_factory=list)  # the masters' values ([Note: masters on disk])
    nbytes: int = 0
    file_offset: int = 0
    written: bool = False  # its state holds values on disk (after the first step, or a load)
    holds_masters: bool = False  # its masters' values are on disk (written at set-up)
    #: Masters (by id) the optimizer keeps no state for yet: no gradient reached them in any step so far (an unused
    #: parameter). Their slots in the record hold nothing; ``optimizer.state`` has no entry for them, as in memory.
    stateless: set[int] = field(default_factory=set)

    def entries_with_state(self) -> list[_Entry]:
        return [entry for entry in self.entries if id(entry.master) not in self.stateless]

    @property
    def holds_values(self) -> bool:
        """Whether anything on disk must be read before the record is stepped or changed."""
        return self.written or self.holds_masters


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


def record_bytes(
    optimizer: Optimizer, groups: Sequence[Sequence[Tensor]], masters_on_disk: bool | Sequence[bool] = False
) -> list[int]:
    """Per group of masters, the bytes of its record in the tier (its state tensors, and with ``masters_on_disk`` the
    masters, each aligned inside it), as ``DiskOptimizerState`` will lay it out: what a budget decides with before the
    tier exists. ``masters_on_disk`` is one flag for every group or one per group."""
    return [record.nbytes for record in _lay_out_records(optimizer, groups, masters_on_disk)]


def staging_bytes_for(record_sizes: Sequence[int]) -> int:
    """Host bytes of the staging buffers a tier of records of ``record_sizes`` bytes streams its step through."""
    sizes = [size for size in record_sizes if size]
    return min(STAGING_SLOTS, len(sizes)) * align_up(max(sizes)) if sizes else 0


def _lay_out_records(
    optimizer: Optimizer, groups: Sequence[Sequence[Tensor]], masters_on_disk: bool | Sequence[bool] = False
) -> list[_Record]:
    """One record per group: with ``masters_on_disk`` (for every group, or per group) the masters' values first, then
    each master's state tensors (the optimizer's layout), all at aligned offsets."""
    moments = _state_layout_by_group(optimizer)
    group_of = {id(master): index for index, group in enumerate(optimizer.param_groups) for master in group["params"]}
    with_masters = _per_group(masters_on_disk, len(groups))
    records = []
    for masters, masters_here in zip(groups, with_masters, strict=True):
        record = _Record(list(masters))
        offset = 0

        def place(master: Tensor, key: str | None, dtype: torch.dtype) -> _Entry:
            nonlocal offset
            offset = -(-offset // _TENSOR_ALIGNMENT) * _TENSOR_ALIGNMENT
            entry = _Entry(master, key, dtype, offset)
            offset += entry.nbytes
            return entry

        if masters_here:
            record.master_entries = [place(master, None, master.dtype) for master in masters]
        for master in masters:
            record.entries += [place(master, key, dtype) for key, dtype in moments[group_of[id(master)]]]
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
    initial_masters: Callable[[Tensor, Tensor], None] | None = None,
    after_record: Callable[[Sequence[Tensor]], None] | None = None,
    masters_of_groups: Sequence[bool] | None = None,
) -> DiskOptimizerState:
    """The disk tier for ``groups``' state under ``offload_dir``: its directory made, the room checked and claimed
    before training starts ([Note: the tier's directory is never a checkpoint] in ``files.py``).

    With ``initial_masters`` the masters' values live in the tier too ([Note: masters on disk]), those of every group
    or, with ``masters_of_groups``, of the groups flagged there: ``initial_masters(master, target)`` fills each
    master's first values, one record at a time; ``after_record`` is ``DiskOptimizerState``'s."""
    masters_on_disk: bool | Sequence[bool] = False
    if initial_masters is not None:
        masters_on_disk = masters_of_groups if masters_of_groups is not None else True
    directory = TierDirectory(offload_dir, rank)
    try:
        state = DiskOptimizerState(
            optimizer,
            groups,
            TierFile(directory, "optimizer_state.bin"),
            beside,
            masters_on_disk=masters_on_disk,
            after_record=after_record,
        )
        directory.check_room(state.planned_bytes, what)
        state.file.allocate()
        if initial_masters is not None:
            state.write_masters(initial_masters)
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
        masters_on_disk: the records hold the masters' values too ([Note: masters on disk]), every record's or (one
            flag per group) the flagged ones'; the caller makes each such master a ``placeholder`` and writes its first
            values with ``write_masters`` before the first step.
        after_record: called with a record's masters after they stepped, while they are still views of the staging
            buffer (and before it is written back).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        groups: Sequence[Sequence[Tensor]],
        tier_file: TierFile,
        beside: torch.device = _HOST,
        masters_on_disk: bool | Sequence[bool] = False,
        after_record: Callable[[Sequence[Tensor]], None] | None = None,
    ) -> None:
        if isinstance(optimizer, torch.optim.LBFGS):
            raise ValueError(
                "The disk tier cannot hold LBFGS's state: LBFGS steps all parameters together through a closure."
                " Use another optimizer or drop offload_dir / disk_fraction."
            )
        self.optimizer = optimizer
        self.file = tier_file
        self.beside = beside
        self.after_record = after_record
        self.records: list[_Record] = []
        for record in _lay_out_records(optimizer, groups, masters_on_disk):
            if record.nbytes:
                record.file_offset = tier_file.reserve(record.nbytes)
            self.records.append(record)
        self.records = [record for record in self.records if record.nbytes]
        # Masters whose optimizer keeps no state shaped like them (plain SGD) step with the resident ones, unless
        # their values are on disk.
        self.on_disk = {id(entry.master) for record in self.records for entry in record.entries + record.master_entries}
        #: Each master whose values this tier holds, by id: its record and entry ([Note: masters on disk]).
        self._master_entry_of = {
            id(entry.master): (record, entry) for record in self.records for entry in record.master_entries
        }
        self.slot_bytes = max((record.nbytes for record in self.records), default=0)
        self._streaming = False
        self._slots: list[Tensor] | None = None
        # I/O a step leaves running into the forward and backward that follow ([Note: the step's I/O runs on]): its
        # last writes (future, buffer), and the next step's first reads (record index: future, buffer).
        self._trailing_writes: list[tuple[Future[None], Tensor]] = []
        self._reads_ahead: dict[int, tuple[Future[None], Tensor]] = {}
        self._guard = optimizer.register_step_pre_hook(self._refuse_outside_streaming) if self.records else None
        self.bytes_read = 0
        self.bytes_written = 0
        # A checkpoint's entry reads and writes (``defer``): the one record open in host memory.
        self._open_record: _Record | None = None
        self._open_buffer: Tensor | None = None
        self._open_record_changed = False
        # Stand-ins for masters' values a checkpoint describes (``master_stand_in``), withdrawn after it.
        self._master_stand_ins: list[Tensor] = []

    @property
    def planned_bytes(self) -> int:
        """Bytes of this rank's state (and masters, with ``masters_on_disk``) on disk."""
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
        # A write that failed here is of state nobody will read: the tier goes, and anything that needed the state
        # (a checkpoint) settled it before and got the error.
        self._settle(raise_failure=False)
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
        self._agree(failure, group, "in this optimizer step")
        return output

    def settle(self, group: ProcessGroup | None = None) -> None:
        """Wait for the I/O the last step left running ([Note: the step's I/O runs on]); before a checkpoint reads or
        fills the state. With ``group``, the ranks agree whether any rank's last writes failed, as after a step."""
        failure: DiskTierError | None = None
        try:
            self._settle()
        except DiskTierError as error:
            failure = error
        self._agree(failure, group, "writing the last optimizer step's state")

    def _agree(self, failure: DiskTierError | None, group: ProcessGroup | None, when: str) -> None:
        """Raise ``failure``, or (with ``group``) another rank's: one small all-reduce of a flag."""
        if group is not None and collectives.world_size(group) > 1:
            flag = torch.tensor([0 if failure is None else 2 if isinstance(failure, DiskTierFull) else 1])
            with Activity("agreeing whether every rank's disk tier stepped"):
                collectives.all_reduce(flag, op="max", group=group)
            if failure is None and flag.item():
                kind = DiskTierFull if flag.item() == 2 else DiskTierError
                raise kind(
                    f"Another rank's disk tier failed{' (its disk is full)' if flag.item() == 2 else ''} {when}"
                    f" (this rank's tier is under {self.file.directory.parent}); that rank's error says why. Every"
                    " rank stopped; the last checkpoint is intact (checkpoints are written atomically)."
                )
        if failure is not None:
            raise failure

    def _step(self, **kwargs: Any) -> Any:
        if kwargs.get("closure") is not None:
            raise ValueError("The disk tier steps the optimizer record by record and cannot run a closure in step().")
        # A checkpoint described the state and nobody released it. Its stand-ins for masters stay: a load describes
        # the model before a first (zero-learning-rate) step creates the optimizer's state, and fills them after.
        self._finish_deferred(masters_too=False)
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
        # The last step's reads ahead own every buffer they took and start only after all its last writes (their
        # gate), so those writes need no wait of their own: a failed one comes back through the reads.
        reads: dict[int, tuple[Future[None] | None, Tensor]] = dict(self._reads_ahead)
        taken = {id(slot) for _, slot in reads.values()}
        slots: deque[Tensor] = deque(slot for slot in self._slots if id(slot) not in taken)
        writes: deque[tuple[Future[None], Tensor]] = deque()
        self._reads_ahead, self._trailing_writes = {}, []
        next_read = len(reads)

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
                future = self.file.read(record.file_offset, slot[: _io_bytes(record)]) if record.holds_values else None
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
                self._bind_masters(record, slot)
                if record.written:
                    self._bind(record, slot)
                output = self._step_only({id(master) for master in record.masters})
                self._copy_in(record, slot)
                if self.after_record is not None and record.master_entries:
                    self.after_record(record.masters)
                writes.append((self.file.write(record.file_offset, slot[: _io_bytes(record)]), slot))
                self.bytes_written += _io_bytes(record)
                record.written = True
                self._unbind(record)
                self._unbind_masters(record)
        except BaseException:
            # An I/O error leaves no thread writing into buffers that are about to be freed.
            for pending, _ in writes:
                pending.exception()
            for pending, _ in reads.values():
                if pending is not None:
                    pending.exception()
            raise
        self._trailing_writes = list(writes)
        self._read_ahead()
        return output

    def _read_ahead(self) -> None:
        """Start the next step's first reads, one per staging buffer, once this step's last writes are done
        ([Note: the step's I/O runs on])."""
        assert self._slots is not None
        gate = all_of([future for future, _ in self._trailing_writes])
        # Every record holds values now: the step wrote each one.
        for index, (record, slot) in enumerate(zip(self.records, self._slots, strict=False)):
            self._reads_ahead[index] = (self.file.read_after(gate, record.file_offset, slot[: _io_bytes(record)]), slot)

    def _settle(self, raise_failure: bool = True) -> None:
        """Wait for the I/O the last step left running and drop its reads ahead: whatever reads or changes the file
        outside a step must see what the step wrote, and a later step must not step values read before a change.
        A failed write (or read) raises its error, which names the directory."""
        pending = [future for future, _ in self._trailing_writes] + [future for future, _ in self._reads_ahead.values()]
        self._reads_ahead, self._trailing_writes = {}, []
        failures = [error for error in (future.exception() for future in pending) if error is not None]
        if failures and raise_failure:
            raise failures[0]

    def _step_only(self, keep: set[int]) -> Any:
        # The records' masters are in host memory now: the fused kernel, as masters kept in memory step
        # (engine_parts/optimizer_takeover.py [Note: the host step runs torch's fused kernel]).
        narrowed = optimizer_takeover.narrowed_to(self.optimizer, keep)
        with narrowed, optimizer_takeover.fused_host_step(self.optimizer, self.beside):
            self._streaming = True
            try:
                return self.optimizer.step()
            finally:
                self._streaming = False

    def _bind(self, record: _Record, slot: Tensor) -> None:
        for entry in record.entries_with_state():
            self.optimizer.state[entry.master][entry.key] = _view(slot, entry)

    def _copy_in(self, record: _Record, slot: Tensor) -> None:
        """After a record's step: make sure the slot holds its state (the first step creates fresh tensors). A master
        that had no gradient gets no state from the optimizer, in memory or here: it stays stateless until one does."""
        for entry in record.entries:
            value = self.optimizer.state.get(entry.master, {}).get(entry.key)
            if value is None and entry.master.grad is None:
                record.stateless.add(id(entry.master))
                continue
            if value is None:
                raise DiskTierError(
                    f"The optimizer ({type(self.optimizer).__name__}) did not create state {entry.key!r} for a"
                    " parameter in its first step, though a trial step on one element did: the disk tier cannot lay"
                    " out its state. Use a per-parameter optimizer (Adam, AdamW, SGD, ...) or drop offload_dir."
                )
            record.stateless.discard(id(entry.master))
            target = _view(slot, entry)
            if value.data_ptr() != target.data_ptr():
                target.copy_(value)

    def _unbind(self, record: _Record) -> None:
        for entry in record.entries:
            if id(entry.master) not in record.stateless:
                self.optimizer.state[entry.master][entry.key] = placeholder(entry.master, entry.dtype)
                continue
            # No state yet: nothing in ``optimizer.state``, so its first gradient starts it fresh, as in memory.
            held = self.optimizer.state.get(entry.master)
            if held is not None:
                held.pop(entry.key, None)
                if not held:
                    del self.optimizer.state[entry.master]

    def _bind_masters(self, record: _Record, slot: Tensor) -> None:
        """The record's masters as views of ``slot``, where their values were read ([Note: masters on disk])."""
        if record.master_entries and not record.holds_masters:
            raise DiskTierError(
                "A record of masters on disk was stepped before its values were written (write_masters): the engine"
                " that built this tier must write the masters' first values when it opens it."
            )
        for entry in record.master_entries:
            entry.master.data = _view(slot, entry)

    def _unbind_masters(self, record: _Record) -> None:
        for entry in record.master_entries:
            entry.master.data = placeholder(entry.master, entry.dtype)

    # ------------------------------------------------------------------------------------------------------ masters
    def holds_master(self, master: Tensor) -> bool:
        """Whether ``master``'s values live in this tier ([Note: masters on disk])."""
        return id(master) in self._master_entry_of

    def read_masters(self, visit: Callable[[Tensor, Tensor], None]) -> None:
        """``visit(master, value)`` for each master on disk, ``value`` a host view valid during the call; one record
        in host memory at a time."""
        self._each_master(visit, changes=False)

    def write_masters(self, fill: Callable[[Tensor, Tensor], None]) -> None:
        """``fill(master, target)`` for each master on disk, ``target`` the host view of its values to overwrite; each
        record is written back before the next is read."""
        self._each_master(fill, changes=True)

    def _each_master(self, visit: Callable[[Tensor, Tensor], None], changes: bool) -> None:
        for record in self.records:
            if not record.master_entries:
                continue
            buffer = self._open(record)
            for entry in record.master_entries:
                visit(entry.master, _view(buffer, entry))
            if changes:
                self._open_record_changed = True
                record.holds_masters = True
        # Written now, so the next step reads these values.
        self._close_open_record()
        self._open_buffer = None

    def master_stand_in(self, master: Tensor) -> Tensor:
        """A stand-in for ``master``'s values on disk, which a checkpoint reads or fills through this tier ([Note:
        deferred tensors] in ``engine_parts/stand_ins.py``); ``release`` (after a save) and ``store`` (after a load)
        withdraw it."""
        if id(master) not in self._master_entry_of:
            raise KeyError("this master's values are not in the disk tier (holds_master says which are)")
        record, entry = self._master_entry_of[id(master)]
        value = stand_ins.stand_in(
            master.shape,
            entry.dtype,
            read=functools.partial(self._read_entry, record, entry),
            write=functools.partial(self._write_entry, record, entry),
        )
        self._master_stand_ins.append(value)
        return value

    # ------------------------------------------------------------------------------------------------------ checkpoints
    def defer(self) -> None:
        """Put a stand-in for each state tensor on disk into ``optimizer.state``: a checkpoint save reads, and a load
        fills, them one at a time through this tier ([Note: deferred tensors] in ``engine_parts/stand_ins.py``), so
        neither holds this rank's state in host memory. ``release`` (after a save) and ``store`` (after a load)
        put the placeholders back."""
        # The masters' stand-ins stay: the model's description comes before the optimizer's.
        self._finish_deferred(masters_too=False)
        for record in self.records:
            if not record.written:
                continue
            for entry in record.entries_with_state():
                self.optimizer.state[entry.master][entry.key] = stand_ins.stand_in(
                    entry.master.shape,
                    entry.dtype,
                    read=functools.partial(self._read_entry, record, entry),
                    write=functools.partial(self._write_entry, record, entry),
                )

    def _open(self, record: _Record) -> Tensor:
        """The host buffer holding ``record`` for entry reads and writes (one record at a time)."""
        self._settle()
        if self._open_record is not record:
            self._close_open_record()
            if self._open_buffer is None:
                self._open_buffer = aligned_buffer(self.slot_bytes)
            if record.holds_values:
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

    def _finish_deferred(self, masters_too: bool = True) -> None:
        """Write the record a load was filling, withdraw the stand-ins (of masters too, unless told otherwise) and put
        placeholders back."""
        self._close_open_record()
        self._open_buffer = None
        if masters_too:
            self.withdraw_master_stand_ins()
        for record in self.records:
            for entry in record.entries:
                current = self.optimizer.state.get(entry.master, {}).get(entry.key)
                if current is not None and stand_ins.deferred_of(current) is not None:
                    stand_ins.withdraw(current)
                    self.optimizer.state[entry.master][entry.key] = placeholder(entry.master, entry.dtype)

    def withdraw_master_stand_ins(self) -> None:
        """Forget the stand-ins for masters (``master_stand_in``): a save read them, or a load filled them (the model's
        weights are loaded before the optimizer's state)."""
        for value in self._master_stand_ins:
            stand_ins.withdraw(value)
        self._master_stand_ins = []

    def materialise(self) -> None:
        """Read every record into fresh tensors in ``optimizer.state`` (a load of whole tensors copies into them;
        ``store`` undoes it)."""
        self._settle()
        self._finish_deferred()
        for record in self.records:
            if not record.written:
                continue
            buffer = aligned_buffer(record.nbytes)
            self.file.read_now(record.file_offset, buffer[: _io_bytes(record)])
            for entry in record.entries_with_state():
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
        self._settle()
        self._finish_deferred()
        for record in self.records:
            # A master the loaded state holds nothing for has no state now (sharded_state.py drops it), whatever the
            # record held: it stays stateless until a gradient reaches it.
            record.stateless |= {
                id(entry.master)
                for entry in record.entries
                if entry.key not in self.optimizer.state.get(entry.master, {})
            }
            present = {
                id(entry.master)
                for entry in record.entries
                if isinstance(self.optimizer.state.get(entry.master, {}).get(entry.key), Tensor)
                and not is_placeholder(self.optimizer.state[entry.master][entry.key])
            }
            if not present:
                continue
            buffer = aligned_buffer(record.nbytes)
            if record.holds_masters:  # the record's masters stay as they are
                self.file.read_now(record.file_offset, buffer[: _io_bytes(record)])
            # The loaded state decides which masters have state (a checkpoint of a run where some never had a
            # gradient has none for them).
            record.stateless = {id(entry.master) for entry in record.entries} - present
            for entry in record.entries_with_state():
                _view(buffer, entry).copy_(self.optimizer.state[entry.master][entry.key])
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


def _per_group(flags: bool | Sequence[bool], groups: int) -> list[bool]:
    """One flag per group, from one flag for all of them or a flag per group."""
    if isinstance(flags, bool):
        return [flags] * groups
    if len(flags) != groups:
        raise ValueError(f"{len(flags)} masters_on_disk flags for {groups} groups: pass one flag, or one per group.")
    return list(flags)


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
