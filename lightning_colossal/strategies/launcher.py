"""Lightning's multiprocessing launcher (spawn, and fork for notebooks), returning *full* weights to the parent.

Lightning's launcher sends rank 0's ``lightning_module.state_dict()`` back to the notebook process. For sharded
strategies that dict holds DTensor shards, which the parent (no process group) can neither unpickle nor load.
Here every rank first joins in gathering the full tensors (a collective), then rank 0 sends plain CPU tensors, with
the paths of the best and the last checkpoint and each logger's version, so that the notebook's Trainer names what
the ranks wrote. Lightning's private launcher pieces come from ``_lightning_private.py``, like every private
Lightning name the package uses.

[Note: OpenMP threads and fork]
PyTorch's CPU build uses GNU OpenMP, whose thread pool does not survive ``fork``: once the parent process has run a
multi-threaded operation, a forked child that runs one with more than one thread waits forever. Lightning gives
each forked rank ``cores // devices`` threads, so on a machine with 4 or more cores a notebook that did any real
PyTorch work before ``fit`` would hang at the first step. When the parent runs more than one thread, forked ranks
are therefore kept to one thread, and the user is told how to get more (one thread in the notebook process from
its start, which leaves the ranks free to use more).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_colossal.strategies._lightning_private import _MultiProcessingLauncher, _WorkerOutput


class FullWeightsMultiProcessingLauncher(_MultiProcessingLauncher):
    """``_MultiProcessingLauncher`` whose rank 0 returns the full, unsharded weights (see the module docstring)."""

    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        if self._start_method == "fork":
            function = single_threaded_after_fork(function)
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        checkpoint_callback = trainer.checkpoint_callback
        best_model_path = getattr(checkpoint_callback, "best_model_path", None) if checkpoint_callback else None
        # Every rank takes part: gathering sharded weights is a collective.
        state_dict = self._strategy.full_model_state_dict()  # type: ignore[attr-defined]
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            # A fresh temporary directory: the file system may be shared between nodes.
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)

    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        extra = super().get_extra_results(trainer)
        checkpoint_callback = trainer.checkpoint_callback
        extra["last_model_path"] = (
            getattr(checkpoint_callback, "last_model_path", None) if checkpoint_callback else None
        )
        # The parent's loggers never logged, so they would name the next free version, not the one the ranks wrote.
        extra["logger_versions"] = [logger.version for logger in trainer.loggers]
        return extra

    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        checkpoint_callback = trainer.checkpoint_callback
        if extra.get("last_model_path") and hasattr(checkpoint_callback, "last_model_path"):
            checkpoint_callback.last_model_path = extra["last_model_path"]  # type: ignore[union-attr]
        for logger, version in zip(trainer.loggers, extra.get("logger_versions", []), strict=False):
            if hasattr(logger, "_version"):
                logger._version = version


def single_threaded_after_fork(function: Callable) -> Callable:
    """``function`` as forked ranks must run it: with one PyTorch thread when this process runs several
    ([Note: OpenMP threads and fork]); the user is told how to get more."""
    if torch.get_num_threads() <= 1:
        return function
    rank_zero_warn(
        f"This process runs {torch.get_num_threads()} PyTorch threads, and OpenMP threads do not survive"
        " fork: the forked ranks run one thread each (more would hang). For faster ranks, call"
        " `torch.set_num_threads(1)` at the top of the notebook, before any PyTorch work, and restart the"
        " kernel if it already ran some. See [Note: OpenMP threads and fork] in"
        " lightning_colossal.strategies.launcher."
    )
    return _single_threaded(function)


def _single_threaded(function: Callable) -> Callable:
    """``function`` run with one PyTorch thread (after Lightning set the ranks' thread count)."""

    def run_single_threaded(*args: Any, **kwargs: Any) -> Any:
        torch.set_num_threads(1)
        return function(*args, **kwargs)

    return run_single_threaded
