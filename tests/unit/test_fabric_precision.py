"""``FabricPrecision`` ([Note: precision in a hand-written loop]): Fabric's call shapes on one process."""

from __future__ import annotations

import pytest
import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision

from lightning_colossal import ColossalPrecision
from lightning_colossal.fabric.precision import FabricPrecision, to_fabric_precision


def _parameter_with_loss(scale: float = 1.0) -> tuple[torch.nn.Parameter, torch.optim.Optimizer, torch.Tensor]:
    parameter = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    return parameter, torch.optim.SGD([parameter], lr=0.1), (parameter * torch.tensor([3.0, 4.0])).sum() * scale


def test_fp16_scales_in_backward_and_unscales_once_whether_clipping_comes_first_or_not():
    plugin = FabricPrecision("16-mixed")
    scale = plugin.loss_scaler.scale
    parameter, optimizer, loss = _parameter_with_loss()
    assert plugin.pre_backward(loss, None) is loss  # Fabric discards this value: scaling must not happen here
    plugin.backward(loss, None)
    torch.testing.assert_close(parameter.grad, torch.tensor([3.0, 4.0]) * scale)
    plugin.unscale_gradients(optimizer)  # fabric.clip_gradients unscales first
    plugin.unscale_gradients(optimizer)  # ... and a second clip must not unscale again
    torch.testing.assert_close(parameter.grad, torch.tensor([3.0, 4.0]))
    plugin.optimizer_step(optimizer)  # nor the step
    torch.testing.assert_close(parameter.detach(), torch.tensor([0.7, 1.6]))
    # The next step unscales again.
    optimizer.zero_grad()
    loss = (parameter * torch.tensor([3.0, 4.0])).sum()
    plugin.backward(loss, None)
    plugin.optimizer_step(optimizer)
    torch.testing.assert_close(parameter.detach(), torch.tensor([0.4, 1.2]))


def test_an_overflow_skips_the_step():
    plugin = FabricPrecision("16-mixed")
    parameter, optimizer, loss = _parameter_with_loss(scale=float("inf"))
    plugin.backward(loss, None)
    plugin.optimizer_step(optimizer)
    assert plugin.last_step_skipped
    torch.testing.assert_close(parameter.detach(), torch.tensor([1.0, 2.0]))


def test_a_nonfinite_loss_without_a_scaler_raises_before_the_step():
    plugin = FabricPrecision("32-true")
    parameter, optimizer, loss = _parameter_with_loss(scale=float("nan"))
    plugin.backward(loss, None)
    with pytest.raises(FloatingPointError, match="non-finite loss"):
        plugin.optimizer_step(optimizer)
    torch.testing.assert_close(parameter.detach(), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize(
    ("plugin", "expected"),
    [
        (Precision(), "32-true"),
        (MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        (HalfPrecision("bf16-true"), "bf16-true"),
        (ColossalPrecision("bf16-mixed", on_nonfinite="skip"), "bf16-mixed"),
    ],
)
def test_fabric_and_trainer_plugins_are_translated(plugin, expected):
    translated = to_fabric_precision(plugin)
    assert isinstance(translated, FabricPrecision) and translated.precision == expected
    if isinstance(plugin, ColossalPrecision):
        assert translated.on_nonfinite == "skip"


def test_untranslatable_plugins_are_refused_naming_the_choices():
    with pytest.raises(ValueError):
        to_fabric_precision(HalfPrecision("16-true"))
    with pytest.raises(TypeError, match="cannot be used with lightning_colossal"):
        to_fabric_precision(object())
