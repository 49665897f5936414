"""What ``colossal_hybrid`` requires of and changes on the user's LightningModule: a ``pipeline_loss`` under
pipelines, a mark that its model was split (so that no later run splits the pieces again), and plain tensors in place
of DTensors in what it logs and its steps return."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.distributed.tensor import DTensor

# Set on a LightningModule whose model this strategy split into tensor-parallel pieces or pipeline stages.
_SPLIT_MARKER = "_lightning_colossal_split_by_hybrid"


def mark_split(module: pl.LightningModule) -> None:
    """Record that ``module`` now holds only this rank's pieces (see ``refuse_module_split_by_an_earlier_run``)."""
    module.__dict__[_SPLIT_MARKER] = True


def refuse_module_split_by_an_earlier_run(module: pl.LightningModule) -> None:
    """A module keeps its pieces after a run (see docs/hybrid.md); a new strategy would split the pieces again and
    train a different model, silently. The same Trainer may fit again: its strategy keeps its engine."""
    if module.__dict__.get(_SPLIT_MARKER):
        raise RuntimeError(
            f"This {type(module).__name__} was split into tensor-parallel pieces or pipeline stages by an earlier"
            " colossal_hybrid run and holds only this rank's pieces, so a new Trainer cannot split it again. Fit again"
            " with the same Trainer (e.g. a larger max_epochs), or start from a whole model:"
            " `Module.load_from_checkpoint(trainer.checkpoint_callback.last_model_path)`, or build the module anew"
            " and load `trainer.strategy.full_model_state_dict()` (gathered before the first Trainer is dropped)."
        )


def require_pipeline_loss(module: pl.LightningModule, pp_size: int) -> None:
    """Under a pipeline the loss is computed on the last stage from each micro-batch, by the module's own hook."""
    if not callable(getattr(module, "pipeline_loss", None)):
        raise TypeError(
            f"pp_size={pp_size}: the strategy runs the pipeline schedule in place of `training_step`, so the"
            " LightningModule must define `pipeline_loss(self, outputs, targets)` returning the mean loss of one"
            " micro-batch (see docs/hybrid.md)."
        )


def plain(output: Any) -> Any:
    """Step outputs with every ``DTensor`` as the plain tensor of its whole value.

    A loss computed under ``loss_parallel`` is a replicated DTensor (its own value, differentiably), and the
    vocabulary-sharded logits a ``predict_step`` returns are gathered here: Lightning, callbacks and the predictions
    ``trainer.predict`` returns get what the same module gives without tensor parallelism.
    """
    return apply_to_collection(output, DTensor, lambda tensor: tensor.full_tensor())


def log_plain_values(module: pl.LightningModule) -> None:
    """Make ``module.log`` (and ``log_dict``, which calls it) store plain tensors rather than DTensors.

    A loss the user logs inside a step under tensor parallelism is a DTensor (``loss_parallel``); Lightning would
    keep it as such in ``callback_metrics``, ``logged_metrics`` and the progress bar, where a DTensor is of no use
    outside the ranks' process group (loggers, a notebook's parent process). Lightning has no hook between
    ``self.log`` and its metric store, so the bound method is shadowed on this instance for the strategy's lifetime
    (undone by ``stop_logging_plain_values`` in ``teardown``).
    """
    if getattr(module.__dict__.get("log"), "logs_plain_values", False):
        return
    log = module.log

    def log_plain(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        log(name, plain(value), *args, **kwargs)

    log_plain.logs_plain_values = True  # type: ignore[attr-defined]
    module.log = log_plain  # type: ignore[method-assign]


def stop_logging_plain_values(module: pl.LightningModule) -> None:
    if getattr(module.__dict__.get("log"), "logs_plain_values", False):
        del module.__dict__["log"]
