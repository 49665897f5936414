"""Whatever precision the user passes reaches ColossalPrecision; unsupported ones fail with the fix."""

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision

import lightning_colossal  # noqa: F401  (registers the strategy names)
from lightning_colossal import ColossalDDPStrategy, ColossalPrecision, LossScalerConfig
from lightning_colossal.precision import to_colossal_precision


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_trainer_precision_reaches_the_strategy(precision):
    trainer = Trainer(strategy="colossal_ddp", accelerator="cpu", devices=2, precision=precision, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ColossalPrecision)
    assert plugin.precision == precision
    assert trainer.precision_plugin is plugin


def test_plugin_instance_carries_fp16_on_cpu_and_strategy_loss_scaler_settings_apply():
    trainer = Trainer(strategy="colossal_ddp", accelerator="cpu", devices=2, plugins=[ColossalPrecision("16-mixed")])
    assert trainer.strategy.precision_plugin.precision == "16-mixed"
    strategy = ColossalDDPStrategy(loss_scaler=LossScalerConfig(initial_scale=128.0))
    strategy.precision_plugin = MixedPrecision("16-mixed", device="cpu")
    assert strategy.precision_plugin.loss_scaler is not None
    assert strategy.precision_plugin.loss_scaler.scale == 128.0


def test_strategy_without_plugin_does_not_preset_one():
    # A preset plugin makes Lightning ignore Trainer(precision=...); the strategy must leave the slot empty.
    strategy = ColossalDDPStrategy()
    assert strategy._precision_plugin is None
    assert strategy.precision_plugin.precision == "32-true"


def test_translation_of_generic_plugins():
    assert to_colossal_precision(Precision()).precision == "32-true"
    assert to_colossal_precision(HalfPrecision("bf16-true")).precision == "bf16-true"
    assert to_colossal_precision(MixedPrecision("bf16-mixed", device="cpu")).precision == "bf16-mixed"
    with pytest.raises(ValueError, match="16-mixed"):
        to_colossal_precision(HalfPrecision("16-true"))
    with pytest.raises(ValueError, match="32-true"):
        to_colossal_precision(DoublePrecision())
    custom_scaler = torch.amp.GradScaler(device="cpu", init_scale=8.0)
    with pytest.raises(TypeError, match="LossScalerConfig"):
        to_colossal_precision(MixedPrecision("16-mixed", device="cpu", scaler=custom_scaler))

    class QuantisedPrecision(Precision):
        pass

    with pytest.raises(TypeError, match="cannot be used"):
        to_colossal_precision(QuantisedPrecision())


def test_unknown_precision_string_is_rejected():
    with pytest.raises(ValueError, match="Choose one of"):
        ColossalPrecision("8-mixed")  # type: ignore[arg-type]


def test_unscale_and_check_divides_by_scale_and_flags_overflow():
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=4.0))
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    weight.grad = torch.tensor([4.0, 8.0, 12.0])
    assert plugin.unscale_and_check(optimizer) is False
    torch.testing.assert_close(weight.grad, torch.tensor([1.0, 2.0, 3.0]))
    weight.grad = torch.tensor([4.0, float("inf"), 12.0])
    assert plugin.unscale_and_check(optimizer) is True


def test_dtype_roles_and_module_conversion():
    assert ColossalPrecision("bf16-mixed").compute_dtype == torch.bfloat16
    assert ColossalPrecision("bf16-mixed").parameter_dtype == torch.float32
    assert ColossalPrecision("16-mixed").compute_dtype == torch.float16
    true_bf16 = ColossalPrecision("bf16-true")
    module = true_bf16.convert_module(torch.nn.Linear(2, 2))
    assert module.weight.dtype == torch.bfloat16
    with true_bf16.tensor_init_context():
        assert torch.empty(1).dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32
    with ColossalPrecision("bf16-mixed").forward_context():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.bfloat16
    assert ColossalPrecision("16-mixed").state_dict()["loss_scaler"]["scale"] == 2.0**16
    assert ColossalPrecision("32-true").state_dict() == {}
