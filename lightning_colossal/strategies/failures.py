"""When a rank fails: the heartbeat watchdog, and the notes that say where a failed run stopped.

A part of ``ColossalStrategy`` (``strategies/base.py``), split out by what it owns; not used on its own. The
watchdog (``distributed/watchdog.py`` [Note: why a watchdog]) starts with the process group and stops at teardown.
After a failed run, teardown lets it name a lost peer and adds the rank, the global step and the collective this
rank was waiting in (``distributed/in_flight.py`` [Note: the collective in flight]) to the error, and it tells the
modes not to start a collective that the other ranks may never reach (``_failure_being_torn_down``).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_colossal.distributed import collectives, group_cache, in_flight
from lightning_colossal.distributed.watchdog import HeartbeatWatchdog, next_generation
from lightning_colossal.strategies._lightning_private import _ChildProcessObserver


class FailureReportingMixin(ParallelStrategy):
    """The watchdog and failure notes of ``ColossalStrategy`` (see the module docstring)."""

    # Set by ColossalStrategy.__init__.
    heartbeat_timeout: timedelta | None
    _watchdog: HeartbeatWatchdog | None

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_watchdog()
        announce_child_exits_before_the_launcher_stops_all(first_child_rank=self.global_rank + 1)

    def teardown(self) -> None:
        self._finish_watchdog()
        super().teardown()

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        # Lightning moves each batch before any on_train_batch_start hook runs: the earliest point of a batch where the
        # watchdog can publish the step, so a rank that dies in the batch is reported at it (distributed/watchdog.py
        # [Note: the step a stopped rank was at]).
        self._publish_step()
        return super().batch_to_device(batch, device, dataloader_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        # A training_step that takes the dataloader iterator gets no batch_to_device call: publish here instead.
        self._publish_step()
        super().on_train_batch_start(batch, batch_idx)

    def _publish_step(self) -> None:
        if self._watchdog is not None:
            self._watchdog.publish_step()

    def _start_watchdog(self) -> None:
        """Heartbeat to the other ranks through the process group's store (``distributed/watchdog.py``)."""
        self._stop_watchdog(clean=True)  # a watchdog left by an earlier Trainer call in this process
        # Counted on every rank, so all ranks use the same keys even when this one runs without a watchdog.
        generation = next_generation()
        if self.heartbeat_timeout is None or collectives.world_size() < 2:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        # Where every rank runs, so a peer that dies before its first heartbeat is read is still named by its pid.
        identities = collectives.gather_objects((socket.gethostname(), os.getpid()))
        peer_host, peer_pid = identities[(self.global_rank + 1) % len(identities)]

        self._watchdog = HeartbeatWatchdog(
            _get_default_store(),
            rank=self.global_rank,
            world_size=collectives.world_size(),
            timeout=self.heartbeat_timeout,
            current_step=self._current_global_step,
            prefix=f"lightning_colossal/watchdog/{generation}",
            peer_identity=(peer_host, peer_pid),
        ).start()

    def _stop_watchdog(self, clean: bool, wait_for_failure: float = 0.0) -> str | None:
        watchdog, self._watchdog = self._watchdog, None
        return None if watchdog is None else watchdog.stop(clean=clean, wait_for_failure=wait_for_failure)

    #: Optimizer steps taken, counted by an adapter without a Trainer (``fabric/``); the Trainer's ``global_step`` is
    #: read instead when there is one.
    steps_without_trainer: int | None = None

    def _current_global_step(self) -> int | None:
        module = self.lightning_module
        # A plain nn.Module under Fabric has no `_trainer` (and nn.Module's getattr raises for it).
        trainer = getattr(module, "_trainer", None) if module is not None else None
        return self.steps_without_trainer if trainer is None else trainer.global_step

    def _failure_being_torn_down(self) -> BaseException | None:
        """The error that ended this run, when teardown follows a failed run (else ``None``).

        Lightning tears down inside its ``except`` block after a failed run, so the error is at hand here even in
        modes whose ``on_exception`` does not call this class's (ddp, fsdp). After a failure other ranks may never
        reach a collective, so teardown must not start one.
        """
        failure = sys.exc_info()[1]
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if module is not None and trainer is None:
            # A module without a Trainer (Fabric): its teardown after a failure runs inside that failure's handler.
            return failure
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        # (an error the caller was handling around a successful run is not this run's failure)
        return failure if failure is not None and interrupted else None

    def _finish_watchdog(self) -> None:
        """Stop the watchdog; after a failed run, first let it name a lost peer in the error (teardown calls this)."""
        failure = self._failure_being_torn_down()
        group_cache.run_ended(cleanly=failure is None)
        if failure is None:
            self._stop_watchdog(clean=True)
        else:
            self._annotate_failure(failure)

    def _annotate_failure(self, exception: BaseException) -> None:
        """Say where an error left this rank's run, so a collective timeout or a peer's crash reads with its step and
        the collective this rank was waiting in.

        When the error looks like a lost peer, the watchdog gets a moment to name the rank that stopped (one heartbeat
        interval finds a dead process on this host) before the error propagates.
        """
        watchdog = self._watchdog
        lost_peer = _looks_like_lost_peer(exception)
        wait = 2 * watchdog.interval + 0.5 if watchdog is not None and lost_peer else 0.0
        report = self._stop_watchdog(clean=False, wait_for_failure=wait)
        exception.add_note(_where_it_failed(exception, self.global_rank, self._current_global_step(), lost_peer))
        if report is not None:
            exception.add_note(f"lightning_colossal watchdog: {report}.")
        elif lost_peer and watchdog is not None and (status := watchdog.peer_status()) is not None:
            # No peer stopped: the one this rank waited for may be alive but late; its heartbeat says where it is.
            exception.add_note(f"lightning_colossal watchdog: {status}.")


def explain_in_message(exception: BaseException, explanation: str) -> None:
    """Put ``explanation`` (what went wrong in the user's terms, and the fix) at the head of ``exception``'s own
    message, the torch message after it: a note prints under the traceback, where a reader who stops at the first line
    (or a tool that logs ``str(error)``) never sees it. Exceptions whose arguments are not one message get a note."""
    if len(exception.args) == 1 and isinstance(exception.args[0], str):
        exception.args = (f"{explanation}\n(torch said: {exception.args[0]})",)
    else:
        exception.add_note(explanation)


def announce_child_exits_before_the_launcher_stops_all(first_child_rank: int) -> None:
    """Make Lightning's popen launcher say which rank died before it kills every rank.

    In the process of each node's local rank 0, the popen launcher runs a thread that polls the other local ranks every
    5 s and, when one has exited with an error, SIGKILLs them all and this process, with one log line at info level
    that a run's output usually hides. Rank 0 is often killed before it reaches a collective with the dead rank, so
    neither its own error nor the watchdog's report is printed: the run would end with no word on which rank died or
    what to do. The thread's clean-up is wrapped (once) to print that first. No such thread (torchrun, SLURM, spawn,
    another local rank): nothing to do.
    """
    for thread in threading.enumerate():
        if not isinstance(thread, _ChildProcessObserver) or getattr(thread, "_colossal_announces", False):
            continue
        terminate_all = thread._terminate_all
        children = thread._child_processes

        def announce_then_terminate(terminate_all=terminate_all, children=children) -> None:
            for index, child in enumerate(children):
                if child.returncode:
                    sentence = _child_exit_sentence(first_child_rank + index, child.pid, child.returncode)
                    print(f"[rank{first_child_rank - 1}] {sentence}", file=sys.stderr, flush=True)
            terminate_all()

        thread._terminate_all = announce_then_terminate
        thread._colossal_announces = True


def _child_exit_sentence(rank: int, pid: int, returncode: int) -> str:
    how = f"was killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exited with code {returncode}"
    return (
        f"lightning_colossal: rank {rank} (pid {pid}) {how}; Lightning's launcher"
        " now stops every rank of this node. Relaunch and call `trainer.fit(..., ckpt_path='last')` to continue from the"
        " last checkpoint."
    )


def _where_it_failed(exception: BaseException, rank: int, step: int | None, lost_peer: bool) -> str:
    """The note naming the rank, the step and the collective the error came from (``in_flight.py``)."""
    record = in_flight.record_of(exception)
    if record is not None:
        return f"lightning_colossal: {in_flight.waiting_sentence(rank, record)}, at global step {step}."
    if lost_peer:
        # A timeout or a lost peer outside our collectives: say so, so nobody looks for the hang in our engines.
        return f"lightning_colossal: raised on rank {rank} at global step {step}, {in_flight.OUTSIDE}."
    return f"lightning_colossal: raised on rank {rank} at global step {step}."


def _looks_like_lost_peer(exception: BaseException) -> bool:
    # Gloo: "Connection reset by peer", "Connection closed by peer"; NCCL and c10d: DistError subclasses, timeouts.
    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("by peer", "Connection refused", "Broken pipe", "Timed out", "timed out")
    )
