"""Lightning's model summary with whole-parameter counts, for engines that keep parameters as per-rank shards.

Lightning's ``ModelSummary`` callback counts ``parameter.numel()``. Gemini points each chunked parameter at an
empty placeholder between gathers, so the summary would print "Total params: 0". Lightning special-cases DeepSpeed
ZeRO-3 the same way (``DeepSpeedSummary``, chosen inside its callback) but offers strategies no hook, so the strategy
swaps Lightning's own summary callbacks on the Trainer for these subclasses, which ask the engine for the counts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from torch import Tensor

#: Elements of a parameter as the model defines it (not this rank's shard).
NumelOf = Callable[[Tensor], int]


class WholeParameterSummary(Summary):
    """``lightning.pytorch.utilities.model_summary.ModelSummary`` counting whole parameters through ``numel_of``."""

    def __init__(self, model: pl.LightningModule, numel_of: NumelOf, max_depth: int = 1) -> None:
        self._numel_of = numel_of
        super().__init__(model, max_depth=max_depth)

    def _count(self, parameters: Iterable[Tensor]) -> int:
        return sum(self._numel_of(parameter) for parameter in parameters)

    @property
    def param_nums(self) -> list[int]:
        modules = dict(self.named_modules)
        return [self._count(modules[name].parameters()) for name in self.layer_names]

    @property
    def total_parameters(self) -> int:
        return self._count(self._model.parameters())

    @property
    def trainable_parameters(self) -> int:
        return self._count(parameter for parameter in self._model.parameters() if parameter.requires_grad)


class _WholeParameterCallback:
    """Mixin for Lightning's summary callbacks: the printed summary counts whole parameters."""

    _max_depth: int

    def __init__(self, numel_of: NumelOf, max_depth: int = 1, **summarize_kwargs: Any) -> None:
        super().__init__(max_depth=max_depth, **summarize_kwargs)  # type: ignore[call-arg]
        self._numel_of = numel_of

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Summary:
        return WholeParameterSummary(pl_module, self._numel_of, max_depth=self._max_depth)


class WholeParameterModelSummary(_WholeParameterCallback, ModelSummary):
    """``ModelSummary`` callback that counts whole parameters (see the module docstring)."""


class WholeParameterRichModelSummary(_WholeParameterCallback, RichModelSummary):
    """``RichModelSummary`` callback that counts whole parameters (see the module docstring)."""


def count_whole_parameters_in_model_summary(trainer: pl.Trainer, numel_of: NumelOf) -> None:
    """Replace the Trainer's Lightning summary callbacks by ones counting whole parameters, in place and in order.

    Only Lightning's own two classes are replaced (``enable_model_summary=True`` adds one; users pass them with
    their ``max_depth``); a user's subclass stays as it is, since it may compute the summary its own way.
    """
    replacements = {ModelSummary: WholeParameterModelSummary, RichModelSummary: WholeParameterRichModelSummary}
    for index, callback in enumerate(trainer.callbacks):
        replacement = replacements.get(type(callback))
        if replacement is not None:
            trainer.callbacks[index] = replacement(
                numel_of, max_depth=callback._max_depth, **callback._summarize_kwargs
            )
