"""Fabric's launchers with what a failed or finished Fabric run needs from this package.

[Note: failures in a Fabric loop]
The Trainer tears its strategy down inside the handler of a failed run, where the error gets its notes: the rank,
the step, the collective this rank waited in, and the watchdog's word on a peer that stopped
(``strategies/failures.py``). Fabric has no such handler and never calls ``teardown()``. So the function given to
``fabric.launch(function)`` runs inside one (both launchers below), and a script that calls ``fabric.launch()`` and
trains after it gets the same notes from an exception hook installed at ``setup_environment``, which runs when an
error ends the script uncaught. The step in the notes counts the optimizer steps taken.

A notebook launch (fork, or spawn) hands rank 0's return value back to the parent through a queue. Tensors cross it
as shared memory whose file descriptors the child must still serve when the parent reads them, and a rank exits as
soon as it returned, so rank 0's result is serialised to bytes in the child and read back in the parent. The
OpenMP rule of the Trainer's launcher ([Note: OpenMP threads and fork] in ``strategies/launcher.py``) applies too.
"""

from __future__ import annotations

import atexit
import io
import sys
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch

from lightning_colossal.strategies._lightning_private import (
    _FabricMultiProcessingLauncher,
    _FabricSubprocessScriptLauncher,
)
from lightning_colossal.strategies.launcher import single_threaded_after_fork

if TYPE_CHECKING:
    from lightning_colossal.fabric.strategy import ColossalFabricStrategy


def reporting_failures(function: Callable[..., Any], strategy: ColossalFabricStrategy) -> Callable[..., Any]:
    """``function``, whose error gets the notes of [Note: failures in a Fabric loop] before it propagates."""

    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as error:
            strategy.report_failure(error)
            raise

    return run


#: The Fabric strategy of this process's current run: the one the exception hook and the exit handler speak for.
_current: list[ColossalFabricStrategy] = []


def watch_this_process(strategy: ColossalFabricStrategy) -> None:
    """Make ``strategy`` the one an error ending the script uncaught is reported through ([Note: failures in a Fabric
    loop]), and whose watchdog stops cleanly at exit (Fabric never calls ``teardown()``). The hook and the exit
    handler are installed once per process, however many loops it runs, and speak for the latest."""
    if not _current:
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
            if isinstance(error, Exception) and _current:
                _current[0].report_failure(error)
            previous(kind, error, traceback)

        sys.excepthook = hook
        atexit.register(_stop_at_exit)
    _current[:] = [strategy]


def _stop_at_exit() -> None:
    # A clean stop of the heartbeat, so peers still finishing read it as an exit (an earlier run's watchdog was ended
    # when the later one started: distributed/watchdog.py).
    if _current:
        _current[0].mode._stop_watchdog(clean=True)


class FabricScriptLauncher(_FabricSubprocessScriptLauncher):
    """Fabric's popen launcher (scripts, torchrun, SLURM), with the launched function's failures reported."""

    def __init__(self, strategy: ColossalFabricStrategy) -> None:
        super().__init__(strategy.cluster_environment, strategy.num_processes, strategy.num_nodes)
        self._colossal_strategy = strategy

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return super().launch(reporting_failures(function, self._colossal_strategy), *args, **kwargs)


class FabricNotebookLauncher(_FabricMultiProcessingLauncher):
    """Fabric's multiprocessing launcher (fork for notebooks, spawn): failures reported, rank 0's result returned
    as bytes and read back here."""

    def __init__(self, strategy: ColossalFabricStrategy, start_method: str) -> None:
        super().__init__(strategy, start_method=start_method)  # type: ignore[arg-type]
        self._colossal_strategy = strategy

    def launch(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._start_method == "fork":
            function = single_threaded_after_fork(function)
        reported = reporting_failures(function, self._colossal_strategy)
        returned = super().launch(_serialised(reported), *args, **kwargs)
        return None if returned is None else torch.load(io.BytesIO(returned), weights_only=False)


def _serialised(function: Callable[..., Any]) -> Callable[..., bytes]:
    def run(*args: Any, **kwargs: Any) -> bytes:
        buffer = io.BytesIO()
        torch.save(function(*args, **kwargs), buffer)
        return buffer.getvalue()

    return run


__all__ = ["FabricNotebookLauncher", "FabricScriptLauncher", "reporting_failures", "watch_this_process"]
