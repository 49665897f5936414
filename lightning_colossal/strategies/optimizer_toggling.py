"""``toggle_optimizer`` / ``untoggle_optimizer`` when engines took the optimizers over.

[Note: toggling reaches the model's parameters]
Lightning's ``toggle_optimizer(optimizer)`` freezes (``requires_grad=False``) the parameters of every other optimizer,
found in the optimizers' ``param_groups``, so that a backward pass for one model (a generator's loss, which runs
through the discriminator) leaves no gradient on the other's parameters; ``untoggle_optimizer`` gives them their flags
back. Once a ZeRO engine took an optimizer over, its ``param_groups`` hold the engine's masters, rows of the
parameters rather than the parameters (optimizer_takeover.py [Note: optimizer takeover]), so Lightning's toggling
would flip flags nothing reads: the discriminator would receive the generator loss's gradients, which plain Lightning
never gives it, and step on them. So during a fit under manual optimization both methods are wrapped on the
LightningModule instance: the module's own (whatever class defines it) runs first, on the masters, where it is
harmless (optimizers step under ``no_grad``); then the same rule runs on the model parameters each engine steps.
The wrappers hold no strategy: they ask the module's trainer for the optimizers when called. They are removed at
teardown.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.strategies.optimizers import unwrap_optimizer

_METHODS = ("toggle_optimizer", "untoggle_optimizer")
# Marks the wrappers, so that removing them never removes an instance attribute the user set.
_MARK = "_toggles_engine_parameters"


def wrap_toggling(module: Any, stepped_parameters: Callable[[Optimizer], Sequence[Tensor]]) -> None:
    """Make ``module.toggle_optimizer`` / ``untoggle_optimizer`` also (un)freeze the model parameters that
    ``stepped_parameters(optimizer)`` names for each of the trainer's optimizers ([Note: toggling reaches the model's
    parameters])."""
    unwrap_toggling(module)
    toggle, untoggle = module.toggle_optimizer, module.untoggle_optimizer
    flags_before: dict[Tensor, bool] = {}

    def toggle_optimizer(optimizer: Any) -> None:
        toggle(optimizer)
        flags_before.clear()
        for other in module.trainer.optimizers:
            for parameter in stepped_parameters(other):
                if parameter not in flags_before:
                    flags_before[parameter] = parameter.requires_grad
                    parameter.requires_grad = False
        for parameter in stepped_parameters(unwrap_optimizer(optimizer)):
            parameter.requires_grad = flags_before[parameter]

    def untoggle_optimizer(optimizer: Any) -> None:
        untoggle(optimizer)
        toggled = unwrap_optimizer(optimizer)
        for other in module.trainer.optimizers:
            if other is not toggled:
                for parameter in stepped_parameters(other):
                    if parameter in flags_before:
                        parameter.requires_grad = flags_before[parameter]
        flags_before.clear()

    for name, wrapper in zip(_METHODS, (toggle_optimizer, untoggle_optimizer), strict=True):
        setattr(wrapper, _MARK, True)
        module.__dict__[name] = wrapper


def unwrap_toggling(module: Any) -> None:
    """Remove the wrappers ``wrap_toggling`` installed (if any): the class's methods apply again."""
    for name in _METHODS:
        if getattr(module.__dict__.get(name), _MARK, False):
            del module.__dict__[name]
