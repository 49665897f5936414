"""A heartbeat watchdog that stops a rank whose peer died, instead of letting it wait for the collective timeout.

[Note: why a watchdog]
A rank that dies (SIGKILL, out-of-memory killer, a lost node) does not always make its peers fail fast. Gloo on one
host usually raises "Connection reset by peer" within milliseconds, but that message names an address, not a rank; a
peer that is frozen (SIGSTOP, a stuck driver) or behind a lost network link leaves the others blocked in a collective
until the collective timeout (30 minutes by default), and NCCL does not notice a dead peer by itself. Lightning's popen
launcher kills every rank when a child exits, but not when rank 0 dies, and torchrun/SLURM do their own thing.

So every rank runs one daemon thread that, every ``interval`` seconds:

1. writes its heartbeat ``"<counter> <step> <host> <pid> <collective>"`` under ``<prefix>/rank<r>`` in the rendezvous
   store, the last field a compact form of the collective this rank is in (empty outside one; ``in_flight.py``
   [Note: the collective in flight]), so a report names what a stopped peer was doing;
2. reads the heartbeat of *one* peer, the next rank in a ring (``(r + 1) % world``), so the store sees O(world)
   requests per interval, not O(world^2). A peer has stopped when its counter has not changed for ``timeout``
   seconds (measured on this host's monotonic clock, so clocks of different hosts never need to agree), or at once
   when it runs on this host and its process is gone or a zombie;
3. reads the shared failure report ``<prefix>/failure``; the first rank that detects a failure writes it, so every
   rank prints the name of the rank that actually stopped, not of the neighbour that noticed.

[Note: the step a stopped rank was at]
A report says "it was at step N": the peer's ``trainer.global_step`` when it stopped. A heartbeat carries the step of
its own moment, and one interval (up to a second) is tens of steps of a small model: a rank killed at step 10 of a fast
run was reported "at step 0", its only heartbeat the one from start-up. So the main thread also writes its step under
``<prefix>/rank<r>/step`` whenever it changed, as each batch starts (``publish_step``, from the strategy's
``batch_to_device``, which Lightning calls before any ``on_train_batch_start`` hook, and from its own
``on_train_batch_start`` for a ``training_step`` that takes the dataloader iterator), and a report takes the later of
that and the heartbeat's step. A rank that dies inside a training batch (its hooks, forward, backward, optimizer step)
is so reported at exactly the step it had there; one that dies after the step count went up and before the next batch
starts (end-of-batch hooks, checkpointing, validation) at the step before, unless a heartbeat came in between. The write
is one store ``set``, which a TCPStore sends without waiting for an answer (about 3 us), made only when the step
changed; it is read only to write a report, so the rounds stay at two requests per interval.

On a failure it prints one line to stderr, with the collective this rank itself is waiting in, and ends this process
with ``EXIT_CODE`` (``os._exit``: the main thread may be blocked inside a collective that will never return, so
nothing softer works). The last atomic checkpoint is untouched; ``fit(ckpt_path="last")`` resumes.

Store requests run on a helper thread and are waited for with a deadline: when the store's host (rank 0) is gone,
a TCPStore request can block far longer than the store's own timeout, and the watchdog must not block with it.

The watchdog only sees processes that stop: a peer that is alive but stuck in Python (a deadlock, an endless loop)
keeps its heartbeat thread going, and its peers fail at the collective timeout instead.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from lightning_colossal.distributed import in_flight

#: Exit code of a process the watchdog stopped: EX_TEMPFAIL ("temporary failure, try again"), because the fix is to
#: relaunch and resume from the last checkpoint.
EXIT_CODE = 75
STOPPED = "stopped"

_generation_lock = threading.Lock()
_generation = 0
# Watchdogs not stopped yet; the ones still here when the interpreter exits belong to a run that failed.
_running: set[HeartbeatWatchdog] = set()


def next_generation() -> int:
    """A number that is the same on every rank for the n-th watchdog started in this process group's lifetime.

    Every rank starts one watchdog per ``Trainer`` call, in the same order, so counting them gives every run in a
    long-lived process (a notebook, the test rank pool) its own keys without a collective.
    """
    global _generation
    with _generation_lock:
        _generation += 1
        return _generation


@dataclass
class _PeerView:
    """What this rank last saw of the peer it watches, timed on this host's clock."""

    counter: str | None = None
    step: str = "?"
    host: str = ""
    pid: int = 0
    changed_at: float = 0.0
    collective: str = ""  # the compact form of the collective it was in at its last heartbeat
    finished: bool = False  # it ended its run normally


class HeartbeatWatchdog:
    """Heartbeats through a ``torch.distributed`` store and stops this process when a watched peer stops.

    Args:
        store: a store every rank can reach (the default process group's store; it is cloned so this thread has
            its own connection).
        rank: this process's global rank.
        world_size: the number of ranks.
        timeout: how long a peer's heartbeat may stay unchanged before the peer counts as stopped.
        current_step: returns the training step this rank is at (for the messages); may return None. The main
            thread also publishes it when it changes (``publish_step``; [Note: the step a stopped rank was at]).
        prefix: key prefix, unique per run in the store's lifetime (see ``next_generation``).
        interval: seconds between heartbeats; by default a tenth of ``timeout``, at most 1 s.
        on_failure: called with the message instead of printing it and ending the process (tests).
        peer_identity: the watched peer's ``(host, pid)``, when known before its first heartbeat arrives (the
            strategy exchanges them at start-up): a peer on this host that dies before this rank has read any
            heartbeat of it, rank 0 killed in the first steps taking the store with it, is still named at once.
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: timedelta,
        current_step: Callable[[], int | None] = lambda: None,
        prefix: str = "lightning_colossal/watchdog",
        interval: float | None = None,
        on_failure: Callable[[str], None] | None = None,
        peer_identity: tuple[str, int] | None = None,
    ) -> None:
        if timeout.total_seconds() <= 0:
            raise ValueError(f"heartbeat_timeout={timeout} must be positive, or None to turn the watchdog off.")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout.total_seconds()
        self.interval = interval if interval is not None else min(1.0, self.timeout / 10)
        self.current_step = current_step
        self.prefix = prefix
        self.peer = (rank + 1) % world_size
        self.failure: str | None = None
        self._store = _own_connection(store)
        # The main thread's own writes (``publish_step``) go through the store it was given, not this thread's clone:
        # neither waits on the other's requests.
        self._main_thread_store = store
        self._published_step: str | None = None
        self._publishing_failed = False
        self._on_failure = on_failure
        self._host = socket.gethostname()
        self._counter = 0
        self._peer_view = _PeerView(changed_at=time.monotonic())
        if peer_identity is not None:
            self._peer_view.host, self._peer_view.pid = peer_identity
        self._last_store_contact = time.monotonic()
        self._stop = threading.Event()
        self._stopped = False
        # Set while the main thread handles an error: a failure found then is reported, not turned into an exit.
        self._main_thread_handles_error = False
        self._thread = threading.Thread(target=self._run, name=f"lightning-colossal-watchdog-rank{rank}", daemon=True)

    # ------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> HeartbeatWatchdog:
        # One run per process at a time: a watchdog an earlier run (another prefix) left running ends cleanly here (a
        # Fabric loop is never torn down, and a notebook or a test worker lives on), or heartbeats would pile up, a
        # thread and a store round each per interval.
        for earlier in list(_running):
            if earlier.prefix != self.prefix:
                earlier.stop(clean=True)
        self._beat()
        self._thread.start()
        _running.add(self)
        return self

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, clean: bool = True, wait_for_failure: float = 0.0) -> str | None:
        """Stop heartbeating; return the failure report if one was seen.

        Args:
            clean: this rank finished normally: tell the watching peer not to report it.
            wait_for_failure: after an error, keep watching this many seconds so a peer that died is named before
                the error propagates (a peer on this host is found within one interval).
        """
        if self._stopped:
            return self.failure
        self._stopped = True
        _running.discard(self)
        self._main_thread_handles_error = not clean
        deadline = time.monotonic() + wait_for_failure
        while self.failure is None and self.running and time.monotonic() < deadline:
            time.sleep(min(self.interval, 0.05))
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.interval + 1.0)
        if wait_for_failure > 0 and self.failure is None and not self._peer_view.finished:
            # The thread's round may have spent the wait on store requests to a dead rank 0 (up to a second each on a
            # loaded machine), and may be inside one still, before looking at the peer's pid: look here, without the
            # store. (The thread no longer reports once `_stop` is set; at worst both read the peer's last heartbeat.)
            lost = self._judge_peer("", time.monotonic(), store_answers=False)
            if lost is not None:
                self._fail(lost)
        if clean and self.failure is None:
            self._request(lambda store: store.set(self._key(self.rank), STOPPED))
        return self.failure

    def publish_step(self) -> None:
        """Write this rank's step to the store now if it changed since the last write (the main thread, at the start
        of every training batch: [Note: the step a stopped rank was at])."""
        step = self._step()
        if step == self._published_step or self._publishing_failed or self._stopped:
            return
        try:
            self._main_thread_store.set(self._step_key(self.rank), step)
        except (RuntimeError, OSError):
            # The store is gone (rank 0 died); the watchdog's rounds report that. No further tries: each would fail
            # the same way, and a failing TCPStore prints a warning every time.
            self._publishing_failed = True
            return
        self._published_step = step

    # ------------------------------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                message = self._check()
            except Exception as error:  # a watchdog that crashes must not take the training with it
                print(f"[rank{self.rank}] lightning_colossal watchdog stopped itself: {error!r}", file=sys.stderr)
                return
            if message is not None and not self._stop.is_set():
                self._fail(message)
                return

    def _check(self) -> str | None:
        """One round: heartbeat, read the shared report and the watched peer. Returns a failure message or None."""
        now = time.monotonic()
        if not self._beat():
            # The store lives in rank 0's process. When it stops answering, the last heartbeat seen still says where
            # the watched peer runs: a dead process on this host (rank 0 itself, often) is named now, not after the
            # timeout, and without writing a report to a store that cannot take it.
            lost = self._judge_peer("", now, store_answers=False)
            if lost is not None:
                return lost
            silent = now - self._last_store_contact
            if silent > self.timeout:
                return (
                    f"the rendezvous store (hosted by rank 0's process) has not answered for {silent:.1f} s, so rank 0"
                    f" stopped responding"
                )
            return None
        report = self._request(
            lambda store: store.get(self._failure_key()) if store.check([self._failure_key()]) else b""
        )
        if report:
            return _decode(report)
        if self.world_size < 2:
            return None
        peer_key = self._key(self.peer)
        raw = self._request(lambda store: store.get(peer_key) if store.check([peer_key]) else b"")
        # Without an answer the last heartbeat seen still tells where the peer runs, so its pid can be checked.
        return self._judge_peer(_decode(raw) if raw is not None else "", now)

    def _judge_peer(self, heartbeat: str, now: float, store_answers: bool = True) -> str | None:
        view = self._peer_view
        if heartbeat == STOPPED:
            view.finished = True
            self._stop.set()  # the peer finished normally; nothing left to watch
            return None
        if heartbeat:
            counter, step, host, pid, *collective = heartbeat.split(" ", 4)
            if counter != view.counter:
                view.counter, view.step, view.host, view.pid, view.changed_at = counter, step, host, int(pid), now
                view.collective = collective[0] if collective else ""
        silent = now - view.changed_at
        if view.pid and view.host == self._host and not _process_alive(view.pid):
            reason = f"its process (pid {view.pid} on {view.host}) is gone"
        elif silent > self.timeout:
            reason = "no heartbeat yet" if view.counter is None else f"last heartbeat {silent:.1f} s ago"
        else:
            return None
        doing = f", in {view.collective}" if view.collective else ""
        step = view.step
        if store_answers:
            # Its heartbeat's step can be an interval old; the step it published at its last batch start is not.
            published = self._request(
                lambda store: store.get(self._step_key(self.peer)) if store.check([self._step_key(self.peer)]) else b""
            )
            step = _later_step(step, _decode(published) if published else "")
        report = (
            f"rank {self.peer} stopped responding ({reason}; it was at step {step}{doing}), seen by rank"
            f" {self.rank} at step {self._step()}"
        )
        if not store_answers:
            return report
        # The first rank to notice writes the report; the others print the same one.
        written = self._request(lambda store: store.compare_set(self._failure_key(), "", report))
        return _decode(written) if written else report

    def peer_status(self) -> str | None:
        """What the watched peer's last heartbeat said: its step and the collective it was in (``None`` before one).

        For the notes of a collective timeout when no peer stopped: a rank that is alive but late (stuck in Python,
        skipping a collective) keeps heartbeating, and what it is doing is then the answer. Read from the main thread
        while the watchdog thread may update the fields: at worst a mix of two consecutive heartbeats.
        """
        view = self._peer_view
        if view.finished:
            return f"rank {self.peer} (watched by rank {self.rank}) had finished its run"
        if view.counter is None:
            return None
        doing = f"in {view.collective}" if view.collective else in_flight.NOT_IN_A_COLLECTIVE
        seen = time.monotonic() - view.changed_at
        return (
            f"rank {self.peer} (watched by rank {self.rank}) was at step {view.step}, {doing} (heartbeat {seen:.1f} s"
            " ago)"
        )

    def _fail(self, report: str) -> None:
        self.failure = report
        resume = "Relaunch and call `trainer.fit(..., ckpt_path='last')` to continue from the last checkpoint."
        if self._main_thread_handles_error:
            # The main thread is already raising an error; ending the process here would hide it.
            message = f"[rank{self.rank}] lightning_colossal watchdog: {report}. {resume}"
        else:
            # The main thread is blocked (or busy) where it is now: say where, since no exception will.
            waiting = in_flight.waiting_sentence(self.rank, in_flight.current())
            message = (
                f"[rank{self.rank}] lightning_colossal watchdog: {report}; {waiting}; stopping this process (exit"
                f" code {EXIT_CODE}) instead of waiting for the collective timeout. {resume}"
            )
        if self._on_failure is not None:
            self._on_failure(message)
            return
        print(message, file=sys.stderr, flush=True)
        if self._main_thread_handles_error:
            return
        sys.stdout.flush()
        os._exit(EXIT_CODE)

    # ------------------------------------------------------------------------------------------ store access
    def _beat(self) -> bool:
        self._counter += 1
        record = in_flight.current()
        collective = "" if record is None else record.compact()
        heartbeat = f"{self._counter} {self._step()} {self._host} {os.getpid()} {collective}"
        return self._request(lambda store: store.set(self._key(self.rank), heartbeat) or True) is not None

    def _request(self, operation: Callable[[Any], Any]) -> Any:
        """Run one store operation with a deadline; None when the store did not answer in time or failed.

        Each request gets its own daemon thread (a few per interval): one stuck on a dead store is abandoned rather
        than blocking the watchdog, and unlike an executor this still works in ``atexit`` handlers.
        """
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(operation(self._store))
            except (RuntimeError, OSError, ValueError):
                pass  # the store is gone or timed out: reported as no answer

        helper = threading.Thread(target=run, name=f"lightning-colossal-watchdog-store-rank{self.rank}", daemon=True)
        helper.start()
        helper.join(timeout=max(self.interval, 1.0))
        if not outcome:
            return None
        self._last_store_contact = time.monotonic()
        return outcome[0]

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/rank{rank}"

    def _step_key(self, rank: int) -> str:
        return f"{self.prefix}/rank{rank}/step"

    def _failure_key(self) -> str:
        return f"{self.prefix}/failure"

    def _step(self) -> str:
        try:
            step = self.current_step()
        except Exception:
            return "?"
        return "?" if step is None else str(step)


@atexit.register
def _name_the_failed_peer_at_exit() -> None:
    # A watchdog still running at exit belongs to a run that raised past its strategy's teardown (a mode whose
    # teardown communicated and failed again): give it the same moment to name a dead peer as a normal teardown.
    for watchdog in list(_running):
        watchdog.stop(clean=False, wait_for_failure=2 * watchdog.interval + 0.5)


def _own_connection(store: Any) -> Any:
    # The main thread uses the process group's store for new groups; a clone is this watchdog's own connection, so
    # neither waits on the other's requests.
    clone = getattr(store, "clone", None)
    return clone() if clone is not None else store


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _later_step(first: str, second: str) -> str:
    """The later of two steps one rank reported (``"?"`` or empty when unknown): a run's step only goes up."""
    known = [step for step in (first, second) if step.isdigit()]
    return max(known, key=int) if known else first


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` on this host is a live process (a zombie counts as dead: it is waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            state = handle.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)  # no /proc (macOS): existence only
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
