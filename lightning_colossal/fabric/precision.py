"""Precision under Lightning Fabric: ``ColossalPrecision`` with the call shapes of Fabric's precision plugins.

Fabric hands a strategy it does not know one of its generic plugins (``Precision``, ``MixedPrecision``,
``HalfPrecision``); ``to_fabric_precision`` translates each into ``FabricPrecision``, as ``to_colossal_precision``
does for the Trainer's, so ``Fabric(precision=...)`` is never silently dropped.

[Note: precision in a hand-written loop]
Fabric calls the plugin differently from the Trainer, and ``FabricPrecision`` takes each difference where it arises:

- Fabric discards what ``pre_backward`` returns, so the loss is scaled (``16-mixed``) or its finiteness noted in
  ``backward`` itself (``ColossalPrecision.scale_loss``).
- ``optimizer.step()`` comes after the user's own backward, with no closure: the step runs the Trainer's checks
  (the overflow or non-finite vote, then step, skip or raise) on a backward that already ran.
- The user may clip (``fabric.clip_gradients``, which unscales first) before stepping: the gradients are unscaled and
  the overflow voted on once per step, by whichever of the two comes first.
- There are no Lightning hooks to call around the step.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.config import LossScalerConfig, validate_precision
from lightning_colossal.precision import ColossalPrecision, refuse_a_custom_grad_scaler


def _backward_ran() -> bool:
    """The closure the Trainer's step path runs first: under Fabric the user's backward already ran."""
    return True


class FabricPrecision(ColossalPrecision):
    """``ColossalPrecision`` for Fabric loops ([Note: precision in a hand-written loop]); the arguments are
    ``ColossalPrecision``'s."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # This step's overflow, once its gradients were unscaled (by clipping or by the step); None before.
        self._overflow_this_step: bool | None = None

    def pre_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return tensor  # Fabric discards the return value: the loss is scaled in `backward`

    def backward(self, tensor: Tensor, model: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.scale_loss(tensor).backward(*args, **kwargs)

    def post_backward(self, tensor: Tensor, module: Any) -> Tensor:  # type: ignore[override]
        return tensor

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        try:
            if "closure" in kwargs:
                # A closure re-evaluates the loss inside step() (LBFGS): there is no backward to check up front.
                self.last_step_skipped = False
                return self.optimizer_stepper(optimizer, **kwargs)
            return super().optimizer_step(optimizer, None, _backward_ran, **kwargs)
        finally:
            self._overflow_this_step = None

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        pass  # no Lightning hooks, and clipping is the loop's own call (fabric.clip_gradients)

    def unscale_and_check(self, optimizer: Optimizer) -> bool:
        if self._overflow_this_step is None:
            self._overflow_this_step = super().unscale_and_check(optimizer)
        return self._overflow_this_step

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.loss_scaler is not None:
            self.unscale_and_check(optimizer)

    def main_params(self, optimizer: Optimizer) -> Any:
        return [parameter for group in optimizer.param_groups for parameter in group["params"]]


def to_fabric_precision(plugin: Any, loss_scaler: LossScalerConfig | None = None) -> FabricPrecision:
    """Translate whatever precision plugin Fabric handed over into a ``FabricPrecision``.

    Raises:
        ValueError: the plugin asks for a precision lightning_colossal does not train in.
        TypeError: the plugin is a specialised one (quantisation, transformer-engine, another strategy's) or a
            ``ColossalPrecision`` made for the Trainer.
    """
    if plugin is None:
        return FabricPrecision("32-true", loss_scaler)
    if isinstance(plugin, FabricPrecision):
        return plugin
    if isinstance(plugin, ColossalPrecision):
        # Its settings carry over; the Trainer's plugin itself calls Lightning's hooks, which a Fabric loop has not.
        translated = FabricPrecision(plugin.precision, device_type=plugin.device_type, on_nonfinite=plugin.on_nonfinite)
        translated.loss_scaler = plugin.loss_scaler
        return translated
    if isinstance(plugin, MixedPrecision):
        refuse_a_custom_grad_scaler(plugin.precision, plugin.scaler, "Fabric")
        return FabricPrecision(plugin.precision, loss_scaler, device_type=str(plugin.device))
    if isinstance(plugin, HalfPrecision):
        return FabricPrecision(validate_precision(plugin.precision), loss_scaler)
    if isinstance(plugin, DoublePrecision):
        validate_precision("64-true")  # raises, naming the precisions there are
    if type(plugin) is Precision:
        return FabricPrecision("32-true", loss_scaler)
    raise TypeError(
        f"The precision plugin {type(plugin).__name__} cannot be used with lightning_colossal strategies. Pass"
        " `Fabric(precision=...)` with one of '32-true', 'bf16-mixed', 'bf16-true', '16-mixed', or a"
        " `lightning_colossal.ColossalPrecision` in `Fabric(plugins=[...])`."
    )


__all__ = ["FabricPrecision", "to_fabric_precision"]
