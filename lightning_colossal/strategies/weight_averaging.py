"""Lightning's ``WeightAveraging`` / ``EMAWeightAveraging`` callbacks under the sharding strategies.

[Note: averaging callbacks adopted by the strategy]
The callback keeps its own decisions (``should_update``, the steps and epochs it counts, its ``state_dict``); what it
does to weights is done through the strategy instead, on an average kept in the weights' own pieces
(``engine_parts/weight_average.py`` [Note: the average lives where the weights live]). At ``setup_environment`` (before
Lightning calls the callbacks' ``setup``, which would deep-copy the whole model) the strategy moves each such callback
into a same-named subclass of its own class that overrides the five places touching weights: ``setup`` copies
nothing, ``on_fit_start`` (after the strategy has sharded the model, before a checkpoint is restored) makes the
average from the weights, the swap around validation and the copy at the end of training write through the strategy,
and a checkpoint saves the average and the weights being trained under Lightning's keys (``state_dict`` is the
average, ``current_model_state`` the weights being trained, ``averaging_state`` holds ``n_averaged``), so a checkpoint
moves between these strategies and Lightning's own in both directions. A user's subclass (its ``should_update``) keeps
working, since the new class derives from it. ``StochasticWeightAveraging`` (which also swaps the LR scheduler and
runs an extra epoch for BatchNorm) is left as Lightning wrote it: it runs where ranks hold whole parameters and is
refused elsewhere (``callback_refusals.py``); ``WeightAveraging`` with its default average is the same SWA average.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import lightning.pytorch.callbacks as lightning_callbacks
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_colossal.checkpoint.format import CURRENT_MODEL_STATE
from lightning_colossal.engine_parts.weight_average import ShardedWeightAverage

if TYPE_CHECKING:
    from lightning_colossal.strategies.base import ColossalStrategy

#: The checkpoint entry (Lightning's) holding ``AveragedModel``'s state other than the weights.
AVERAGING_STATE = "averaging_state"


def weight_averaging_type() -> type | None:
    """Lightning's ``WeightAveraging`` (Lightning 2.6 and later; the project supports 2.5 too)."""
    return getattr(lightning_callbacks, "WeightAveraging", None)


class _AveragedThroughStrategy:
    """The overrides a ``WeightAveraging`` callback gets under these strategies (see the module Note); mixed in
    ahead of the callback's own class."""

    _average_model: ShardedWeightAverage | None
    _device: Any
    _use_buffers: bool
    _kwargs: dict[str, Any]

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Nothing to copy yet: the strategy has not placed the weights. An earlier fit's average does not describe
        # another stage's weights (after fit the model already holds it).
        self._average_model = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]
        strategy: ColossalStrategy = trainer.strategy  # type: ignore[assignment]
        self._average_model = ShardedWeightAverage(
            live_state=strategy.weights_for_averaging,
            after_written=strategy.after_averaged_weights_written,
            buffer_names=[name for name, _ in pl_module.named_buffers()],
            use_buffers=self._use_buffers,
            avg_fn=self._kwargs.get("avg_fn"),
            multi_avg_fn=self._kwargs.get("multi_avg_fn"),
            # As AveragedModel takes it; by default the average lives where each weight's part lives.
            device=None if self._device is None else torch.device(self._device),
        )

    def _swap_models(self, pl_module: pl.LightningModule) -> None:
        assert self._average_model is not None
        self._average_model.swap_with_model()

    def _copy_average_to_current(self, pl_module: pl.LightningModule) -> None:
        assert self._average_model is not None
        self._average_model.write_into_model()

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if self._average_model is None:
            return  # outside fit: the model holds the average already (Lightning says the same in a log line)
        checkpoint[CURRENT_MODEL_STATE] = checkpoint["state_dict"]
        checkpoint["state_dict"] = self._average_model.state_for_checkpoint()
        checkpoint[AVERAGING_STATE] = {"n_averaged": self._average_model.n_averaged.clone()}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        average = self._average_model
        if average is None:
            return
        averaging_state = checkpoint.get(AVERAGING_STATE)
        if CURRENT_MODEL_STATE in checkpoint and averaging_state is not None:
            # A single-file checkpoint (Lightning's own format): the strategy loaded its `state_dict`, the average,
            # into the model. Keep that as the average, then load the weights being trained.
            average.take_from_model()
            strategy: ColossalStrategy = trainer.strategy  # type: ignore[assignment]
            strategy._load_full_model_state(checkpoint[CURRENT_MODEL_STATE], strict=pl_module.strict_loading)
        elif averaging_state is None:
            rank_zero_warn(
                "The checkpoint holds no weight average (it was saved without a WeightAveraging callback): the average"
                " starts from the loaded weights."
            )
            average.take_from_model()
            return
        # A sharded checkpoint was loaded into the average and the weights by the strategy (checkpointing.py).
        average.n_averaged.copy_(torch.as_tensor(averaging_state["n_averaged"]).cpu())


def adopt_averaging_callbacks(callbacks: Iterable[Any]) -> list[Any]:
    """Move each ``WeightAveraging`` callback into its subclass that averages through the strategy (the module Note);
    returns the adopted callbacks. Refuses two of them: both would claim the checkpoint's ``state_dict``."""
    base = weight_averaging_type()
    if base is None:
        return []
    adopted = [callback for callback in callbacks if isinstance(callback, base)]
    if len(adopted) > 1:
        raise ValueError(
            f"{len(adopted)} weight-averaging callbacks were given ({', '.join(type(c).__name__ for c in adopted)}),"
            " but a checkpoint holds one average as its `state_dict`: keep one of them."
        )
    for callback in adopted:
        if not isinstance(callback, _AveragedThroughStrategy):
            callback.__class__ = _through_strategy(type(callback))
    return adopted


_SUBCLASSES: dict[type, type] = {}


def _through_strategy(callback_class: type) -> type:
    """``callback_class`` with the overrides of ``_AveragedThroughStrategy``, made once per class and named like it
    (so logs and error messages show the user's callback)."""
    if callback_class not in _SUBCLASSES:
        _SUBCLASSES[callback_class] = type(
            callback_class.__name__,
            (_AveragedThroughStrategy, callback_class),
            {"__module__": callback_class.__module__, "__qualname__": callback_class.__qualname__},
        )
    return _SUBCLASSES[callback_class]


def active_average(callbacks: Iterable[Any]) -> ShardedWeightAverage | None:
    """The average an adopted callback keeps for this fit, if any (a checkpoint saves and loads it)."""
    for callback in callbacks:
        if isinstance(callback, _AveragedThroughStrategy) and callback._average_model is not None:
            return callback._average_model
    return None
