"""The collective this rank is in right now, and what the engine was doing around it, for hang reports.

[Note: the collective in flight]
When a collective times out, torch's error names the operation ("Timed out waiting 3000ms for recv operation") but
not which of our collectives it was, over which ranks, on what tensor, nor what the engine was doing. Every
collective of ``collectives.py`` therefore runs inside ``Collective(...)``, which makes one tuple (name, group,
tensor, start time, labels, peer) the current record and puts the previous one back when the collective ends.
Engines wrap their work in ``Activity(...)`` labels ("gathering chunk 3", "reducing gradient bucket 2 of 7"): a
template or a function and its arguments, formatted only when a report is made. The hot path stores references
and reads the clock once; it formats nothing and computes no shapes (cost measured in ``docs/reliability.md``,
section 3).

When the collective raises, the record is frozen into a ``CollectiveRecord`` (ranks, shape, dtype, bytes, seconds
waited, labels as text) and attached to the exception, so the strategy's failure notes
(``strategies/failures.py``) say what this rank was waiting for even though the labels are popped on the way out.
The heartbeat watchdog reads the live record from its own thread (``current()``) and carries a compact form in its
heartbeat, so a peer's report says what a stopped rank was doing.

Asynchronous collectives return a ``RecordedWork``: the record is made while a caller waits on it, with the labels
of its launch (a gradient reduction launched while "reducing chunk 5" is waited for at the end of backward). A
handle launched and not waited for yet is not recorded: a rank blocks only inside ``wait``.

Reading from another thread: the record is one tuple replaced by a single assignment, and the labels are copied
with ``tuple(list)``; both are atomic under the GIL, so a reader sees a whole record, possibly an instant stale.
Formatting a label may race with the engine changing what it refers to; such a label reads "<unavailable: ...>".

Each thread keeps its own record and labels (``_Records``, a ``threading.local``): a background checkpoint save
runs collectives on its own thread (``checkpoint/async_save.py``), and with one record per process its collectives
replaced the training thread's record, and restored, on the way out, whatever the training thread's record had been
when they started, so a hang report could name a collective the training thread had long left. ``current()``
reports the main thread's, which is the one that trains.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

#: The exception attribute a failed collective's ``CollectiveRecord`` is stored under.
RECORD_ATTRIBUTE = "_lightning_colossal_collective"
NOT_IN_A_COLLECTIVE = "not inside a lightning_colossal collective"
#: What a failure note says when the error came from no collective of ours.
OUTSIDE = (
    f"{NOT_IN_A_COLLECTIVE}: torch DDP/FSDP2's own communication, distributed checkpointing, the data loader or the"
    " model's own code"
)
_COMPACT_LENGTH = 240  # a heartbeat stays a small store value

# (template or function, arguments) per label, outermost first.
Label = tuple[str | Callable[..., str], tuple[Any, ...]]
# (name, group, tensor, monotonic start, labels at launch or None for the live ones, peer within the group or None)
_Entry = tuple[str, Any, "torch.Tensor | None", float, "tuple[Label, ...] | None", "int | None"]


class _Records:
    """One thread's collective in flight and activity labels."""

    __slots__ = ("current", "labels")

    def __init__(self) -> None:
        self.current: _Entry | None = None
        self.labels: list[Label] = []


class _ThisThread(threading.local):
    """``records``: the calling thread's ``_Records``, made on its first use. (A ``threading.local`` attribute
    read from another thread reads that thread's own value, so the main thread's records are kept aside as an
    object for ``current()``.)"""

    def __init__(self) -> None:
        global _main_records
        self.records = _Records()
        if threading.current_thread() is threading.main_thread():
            _main_records = self.records


_main_records: _Records | None = None
_this_thread = _ThisThread()


class Collective:
    """Context manager: this rank is inside collective ``name`` over ``group`` (the world when ``None``).

    Args:
        name: the torch.distributed operation (``"all_reduce"``, ``"broadcast"``, ``"send"``, ...).
        group: the process group.
        tensor: the tensor sent or received (shape, dtype and bytes are read only when a report is made).
        labels: the activity labels to report; the live ones when ``None`` (``RecordedWork`` passes its launch's).
        peer: for point-to-point operations, the other rank within ``group``.
    """

    __slots__ = ("_entry", "_previous")

    def __init__(
        self,
        name: str,
        group: Any = None,
        tensor: torch.Tensor | None = None,
        labels: tuple[Label, ...] | None = None,
        peer: int | None = None,
    ) -> None:
        self._entry: _Entry = (name, group, tensor, time.monotonic(), labels, peer)
        self._previous: _Entry | None = None

    def __enter__(self) -> None:
        records = _this_thread.records
        self._previous = records.current
        records.current = self._entry

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> None:
        if error is not None:
            _attach(error, self._entry)
        _this_thread.records.current = self._previous


class Activity:
    """Context manager: a label for what the engine is doing, reported with any collective inside it.

    ``label`` is a ``str.format`` template or a function returning text; it is applied to ``arguments`` only when a
    report is made, so entering costs one list append.
    """

    __slots__ = ("_label",)

    def __init__(self, label: str | Callable[..., str], *arguments: Any) -> None:
        self._label: Label = (label, arguments)

    def __enter__(self) -> None:
        _this_thread.records.labels.append(self._label)

    def __exit__(self, *exception_info: Any) -> None:
        _this_thread.records.labels.pop()


class RecordedWork:
    """The handle of an asynchronous collective of ``collectives.py``; ``wait()`` records it as the collective in
    flight, with the activity labels of its launch, and then runs what the caller asked to follow it."""

    __slots__ = ("work", "_name", "_group", "_tensor", "_labels", "_then")

    def __init__(
        self,
        work: dist.Work,
        name: str,
        group: Any,
        tensor: torch.Tensor,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.work = work
        self._name = name
        self._group = group
        self._tensor = tensor
        self._labels = tuple(_this_thread.records.labels)
        self._then = then

    def wait(self) -> bool:
        """Wait for the collective, then run the ``then`` given at launch (once, on the first wait)."""
        with Collective(self._name, self._group, self._tensor, self._labels):
            result = self.work.wait()
        then, self._then = self._then, None
        if then is not None:
            then()
        return result

    def is_completed(self) -> bool:
        return self.work.is_completed()


@dataclass(frozen=True)
class CollectiveRecord:
    """A collective this rank was in, frozen as plain values (safe to keep, print or send)."""

    name: str
    ranks: tuple[int, ...] | None
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    seconds: float
    activities: tuple[str, ...]
    peer: int | None = None

    def describe(self) -> str:
        """``all_reduce over ranks [0, 1] ([1170] float32, 4.6 KiB) for 3.0 s, while gathering chunk 0 (...)``."""
        text = f"{self.name}{self._peer_text()} over ranks {self._ranks_text()}"
        if self.shape is not None:
            shape = list(self.shape) if self.shape else "scalar"
            text += f" ({shape} {self.dtype}, {_byte_text(self.nbytes)})"
        text += f" for {self.seconds:.1f} s"
        if self.activities:
            text += f", while {' > '.join(self.activities)}"
        return text

    def compact(self) -> str:
        """A short form for heartbeats: ``all_reduce over [0, 1] for 2.0 s while gathering chunk 3 (...)``."""
        text = f"{self.name}{self._peer_text()} over {self._ranks_text()} for {self.seconds:.1f} s"
        if self.activities:
            text += f" while {' > '.join(self.activities)}"
        return text if len(text) <= _COMPACT_LENGTH else text[: _COMPACT_LENGTH - 3] + "..."

    def _ranks_text(self) -> str:
        return "?" if self.ranks is None else f"[{', '.join(map(str, self.ranks))}]"

    def _peer_text(self) -> str:
        if self.peer is None:
            return ""
        # The peer is a rank within the group; name the global rank where the group's ranks are known.
        global_peer = self.ranks[self.peer] if self.ranks is not None and self.peer < len(self.ranks) else self.peer
        return f" {'to' if self.name == 'send' else 'from'} rank {global_peer}"


def current() -> CollectiveRecord | None:
    """The collective the training (main) thread is in right now, frozen (``None`` outside one); callable from any
    thread."""
    records = _main_records
    if records is None:
        return None
    entry = records.current  # one read: the main thread may replace it at any moment
    return None if entry is None else _freeze(entry, records.labels)


def record_of(error: BaseException) -> CollectiveRecord | None:
    """The collective ``error`` (or an error it was raised while handling) came from; the original one when
    several did, since a later failure during clean-up is a consequence of the first."""
    found = None
    seen: set[int] = set()
    pending: BaseException | None = error
    while pending is not None and id(pending) not in seen:
        seen.add(id(pending))
        found = getattr(pending, RECORD_ATTRIBUTE, None) or found
        pending = pending.__cause__ or pending.__context__
    return found


def waiting_sentence(rank: int, record: CollectiveRecord | None) -> str:
    """``rank R was waiting in <collective> ...`` or, outside our collectives, ``rank R was not inside ...``."""
    if record is None:
        return f"rank {rank} was {OUTSIDE}"
    return f"rank {rank} was waiting in {record.describe()}"


# ---------------------------------------------------------------------------------------------- reporting (cold path)
def _attach(error: BaseException, entry: _Entry) -> None:
    # The innermost collective that raised wins: an outer wrapper (e.g. one that waits on a handle) must not replace it.
    if getattr(error, RECORD_ATTRIBUTE, None) is not None:
        return
    try:
        setattr(error, RECORD_ATTRIBUTE, _freeze(entry, _this_thread.records.labels))
    except Exception:  # an exception type that refuses attributes keeps its own message only
        pass


def _freeze(entry: _Entry, live_labels: list[Label]) -> CollectiveRecord:
    """``entry`` as plain values; ``live_labels``: the labels of the thread it belongs to (for an entry that
    reports the live ones)."""
    name, group, tensor, started, labels, peer = entry
    seconds = time.monotonic() - started
    shape = dtype = None
    nbytes = 0
    if tensor is not None:
        shape = tuple(tensor.shape)
        dtype = str(tensor.dtype).removeprefix("torch.")
        nbytes = tensor.numel() * tensor.element_size()
    activities = tuple(_format(label) for label in (tuple(live_labels) if labels is None else labels))
    return CollectiveRecord(name, _group_ranks(group), shape, dtype, nbytes, seconds, activities, peer)


def _format(label: Label) -> str:
    template, arguments = label
    try:
        return template(*arguments) if callable(template) else template.format(*arguments)
    except Exception as error:  # the engine may be changing what the label refers to (another thread reads it)
        return f"<unavailable: {error!r}>"


def _group_ranks(group: Any) -> tuple[int, ...] | None:
    try:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        return tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    except Exception:  # a destroyed group, or the process group already torn down
        return None


def _byte_text(nbytes: int) -> str:
    if nbytes < 1024:
        return f"{nbytes} bytes"
    size = nbytes / 1024
    for unit in ("KiB", "MiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
