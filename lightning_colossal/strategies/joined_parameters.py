"""Parameters that join an optimizer after an engine took it over: a frozen backbone unfrozen by hand (a parameter
the optimizer held frozen made trainable, or a param group added). A part of ``EngineStrategy``
(``strategies/engine_strategy.py``), split out by what it owns.

Before each training batch the strategy asks: an engine that can (ZeRO, ``takes_joining_parameters``) is rebuilt over
its optimizer, continuing from its optimizer state and masters (zero/engine.py [Note: parameters that join the
optimizer]); a mode that cannot (Gemini, hybrid) refuses with the fix, rather than train the new parameters on each
rank's own gradient or not at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.strategies.optimizers import unwrap_optimizer


class JoinedParametersMixin:
    """Takes or refuses parameters that join the engines' optimizers mid-run (see the module docstring)."""

    #: Whether an engine whose optimizer gains parameters mid-run (a group added, a held frozen parameter made
    #: trainable) is rebuilt to take them (zero/engine.py [Note: parameters that join the optimizer]); otherwise a
    #: group added is refused.
    takes_joining_parameters: ClassVar[bool] = False
    # Set by the strategy: its engines, their optimizers as Lightning holds them, and how engines are built and wired.
    engines: list[Any]
    optimizers: list[Any]
    _fitted_engines: list[Any]
    _group_counts: list[int]
    _held_frozen: list[Tensor]

    def _record_held_frozen(self, optimizers: Sequence[Optimizer]) -> None:
        """Note the parameters ``optimizers`` hold frozen, before an engine takes them over (and drops them), where
        one made trainable later is refused (``_take_over_joined_parameters``); an engine that rebuilds keeps its own
        list (``ZeroEngine.optimizer_gained_parameters``)."""
        if self.takes_joining_parameters:
            return
        self._held_frozen = [
            parameter
            for optimizer in optimizers
            for group in optimizer.param_groups
            for parameter in group["params"]
            if not parameter.requires_grad
        ]

    def _optimizer_group_counts(self) -> list[int]:
        """How many param groups each engine's optimizer has: one added later is refused where engines cannot take
        it (``_take_over_joined_parameters``)."""
        return [len(unwrap_optimizer(optimizer).param_groups) for optimizer in self.optimizers]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        self._take_over_joined_parameters()

    def _take_over_joined_parameters(self) -> None:
        """Before a batch: an engine whose optimizer gained parameters (a backbone unfrozen by hand: a group added,
        or a parameter it held frozen made trainable) is rebuilt over it, continuing from its masters and state
        (zero/engine.py [Note: parameters that join the optimizer]); a mode that cannot rebuild refuses, naming the
        fix, rather than train them wrongly."""
        rebuilt = False
        for index, engine in enumerate(self.engines):
            gained = getattr(engine, "optimizer_gained_parameters", None)
            if gained is None or not gained():
                continue
            assert self.lightning_module is not None
            masters = engine.give_back_optimizer()
            # (`_trainer`: None under Fabric, where the module may be a plain nn.Module)
            replacement = self._build_engine(getattr(self.lightning_module, "_trainer", None), engine.optimizer)
            assert replacement is not None
            replacement.adopt_masters(masters)
            self.engines[index] = replacement
            self._fitted_engines = [replacement if each is engine else each for each in self._fitted_engines]
            rebuilt = True
        if rebuilt:
            self._wire_precision_plugin()
            self._group_counts = self._optimizer_group_counts()
            return
        if any(parameter.requires_grad for parameter in self._held_frozen):
            raise ValueError(
                f"A parameter the optimizer held frozen was made trainable during training, but under"
                f" {type(self).__name__} the engine laid out the trainable parameters at setup and would not train it."
                " Make it trainable before `fit` (with a learning rate of 0 for its group while it should stay"
                " fixed), or train with `colossal_zero1` / `colossal_zero2`, `colossal_ddp` or `colossal_fsdp`."
            )
        if self._optimizer_group_counts() != self._group_counts:
            raise ValueError(
                f"A param group was added to the optimizer during training, but under {type(self).__name__} the engine"
                " took over the optimizer's parameters at setup and cannot take more. Put the parameters in the"
                " optimizer from the start, in their own param group (a frozen stage is a learning rate of 0 for that"
                " group), or train with `colossal_zero1` / `colossal_zero2`, `colossal_ddp` or `colossal_fsdp`, which"
                " take parameters that join later."
            )
