"""Lightning's multiprocessing launcher (spawn, and fork for notebooks), returning *full* weights to the parent.

Lightning's launcher sends rank 0's ``lightning_module.state_dict()`` back to the notebook process. For sharded
strategies that dict holds DTensor shards, which the parent (no process group) can neither unpickle nor load.
Here every rank first joins in gathering the full tensors (a collective), then rank 0 sends plain CPU tensors.
Lightning's private launcher pieces are imported only in this module, so an upstream move breaks one file.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn


class FullWeightsMultiProcessingLauncher(_MultiProcessingLauncher):
    """``_MultiProcessingLauncher`` whose rank 0 returns the full, unsharded weights (see the module docstring)."""

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
