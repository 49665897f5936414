"""When a rank fails: the heartbeat watchdog, and the notes that say where a failed run stopped.

A part of ``ColossalStrategy`` (``strategies/base.py``), split out by what it owns; not used on its own. The
watchdog (``distributed/watchdog.py`` [Note: why a watchdog]) starts with the process group and stops at teardown.
After a failed run, teardown lets it name a lost peer and adds the rank and global step to the error, and it tells
the modes not to start a collective that the other ranks may never reach (``_failure_being_torn_down``).
"""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerStatus

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.watchdog import HeartbeatWatchdog, next_generation


class FailureReportingMixin(ParallelStrategy):
    """The watchdog and failure notes of ``ColossalStrategy`` (see the module docstring)."""

    # Set by ColossalStrategy.__init__.
    heartbeat_timeout: timedelta | None
    _watchdog: HeartbeatWatchdog | None

    def setup_environment(self) -> None:
        super().setup_environment()
        self._start_watchdog()

    def teardown(self) -> None:
        self._finish_watchdog()
        super().teardown()

    def _start_watchdog(self) -> None:
        """Heartbeat to the other ranks through the process group's store (``distributed/watchdog.py``)."""
        self._stop_watchdog(clean=True)  # a watchdog left by an earlier Trainer call in this process
        # Counted on every rank, so all ranks use the same keys even when this one runs without a watchdog.
        generation = next_generation()
        if self.heartbeat_timeout is None or collectives.world_size() < 2:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self._watchdog = HeartbeatWatchdog(
            _get_default_store(),
            rank=self.global_rank,
            world_size=collectives.world_size(),
            timeout=self.heartbeat_timeout,
            current_step=self._current_global_step,
            prefix=f"lightning_colossal/watchdog/{generation}",
        ).start()

    def _stop_watchdog(self, clean: bool, wait_for_failure: float = 0.0) -> str | None:
        watchdog, self._watchdog = self._watchdog, None
        return None if watchdog is None else watchdog.stop(clean=clean, wait_for_failure=wait_for_failure)

    def _current_global_step(self) -> int | None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return None if trainer is None else trainer.global_step

    def _failure_being_torn_down(self) -> BaseException | None:
        """The error that ended this run, when teardown follows a failed run (else ``None``).

        Lightning tears down inside its ``except`` block after a failed run, so the error is at hand here even in
        modes whose ``on_exception`` does not call this class's (ddp, fsdp). After a failure other ranks may never
        reach a collective, so teardown must not start one.
        """
        failure = sys.exc_info()[1]
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        # (an error the caller was handling around a successful run is not this run's failure)
        return failure if failure is not None and interrupted else None

    def _finish_watchdog(self) -> None:
        """Stop the watchdog; after a failed run, first let it name a lost peer in the error (teardown calls this)."""
        failure = self._failure_being_torn_down()
        if failure is None:
            self._stop_watchdog(clean=True)
        else:
            self._annotate_failure(failure)

    def _annotate_failure(self, exception: BaseException) -> None:
        """Say where an error left this rank's run, so a collective timeout or a peer's crash reads with its step.

        When the error looks like a lost peer, the watchdog gets a moment to name the rank that stopped (one heartbeat
        interval finds a dead process on this host) before the error propagates.
        """
        watchdog = self._watchdog
        wait = 2 * watchdog.interval + 0.5 if watchdog is not None and _looks_like_lost_peer(exception) else 0.0
        report = self._stop_watchdog(clean=False, wait_for_failure=wait)
        exception.add_note(
            f"lightning_colossal: raised on rank {self.global_rank} at global step {self._current_global_step()}."
        )
        if report is not None:
            exception.add_note(f"lightning_colossal watchdog: {report}.")


def _looks_like_lost_peer(exception: BaseException) -> bool:
    # Gloo: "Connection reset by peer", "Connection closed by peer"; NCCL and c10d: DistError subclasses, timeouts.
    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("by peer", "Connection refused", "Broken pipe", "Timed out", "timed out")
    )
