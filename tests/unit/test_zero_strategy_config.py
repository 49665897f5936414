"""ZeroStrategy's arguments, names and precision hand-over, without a process group."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

import lightning_colossal  # noqa: F401  (registers the strategy names)
from lightning_colossal import ColossalPrecision, ZeroStrategy

NAMES = {
    "colossal_zero1": {"stage": 1, "cpu_offload": False},
    "colossal_zero2": {"stage": 2, "cpu_offload": False},
    "colossal_zero1_offload": {"stage": 1, "cpu_offload": True},
    "colossal_zero2_offload": {"stage": 2, "cpu_offload": True},
}


def test_stage_3_points_to_the_sharded_parameter_strategies():
    with pytest.raises(ValueError) as caught:
        ZeroStrategy(stage=3)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "colossal_gemini" in message and "colossal_fsdp" in message, message


def test_stage_0_points_to_plain_data_parallelism():
    with pytest.raises(ValueError) as caught:
        ZeroStrategy(stage=0)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "stage" in message and "colossal_ddp" in message, message


@pytest.mark.parametrize("bucket_size_mb", [0, -1.0, float("nan"), float("inf")])
def test_bad_bucket_size_is_rejected(bucket_size_mb):
    with pytest.raises(ValueError, match="bucket_size_mb"):
        ZeroStrategy(bucket_size_mb=bucket_size_mb)


def test_bad_stage2_accumulation_is_rejected_naming_the_choices():
    with pytest.raises(ValueError, match="stage2_accumulation") as caught:
        ZeroStrategy(stage=2, stage2_accumulation="global")  # type: ignore[arg-type]
    assert "sharded" in str(caught.value) and "local" in str(caught.value)


def test_valid_arguments_are_accepted():
    for stage in (1, 2):
        for accumulation in ("sharded", "local"):
            strategy = ZeroStrategy(
                stage=stage,
                cpu_offload=True,
                bucket_size_mb=0.001,
                overlap_communication=False,
                stage2_accumulation=accumulation,
            )
            assert strategy.is_distributed
            assert strategy.restore_checkpoint_after_setup


@pytest.mark.parametrize("name", sorted(NAMES))
def test_names_register_stage_offload_and_launcher(name):
    for suffix in ("", "_notebook"):
        entry = StrategyRegistry[name + suffix]
        assert entry["strategy"] is ZeroStrategy
        for key, value in NAMES[name].items():
            assert entry["init_params"].get(key) == value, (name + suffix, entry["init_params"])
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ZeroStrategy)
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    notebook = Trainer(strategy=name + "_notebook", accelerator="cpu", devices=2, logger=False)
    assert isinstance(notebook.strategy, ZeroStrategy)
    assert isinstance(notebook.strategy.launcher, _MultiProcessingLauncher)
    assert notebook.strategy.launcher.is_interactive_compatible  # fork: usable from Jupyter


def test_trainer_precision_reaches_colossal_precision():
    trainer = Trainer(strategy="colossal_zero1", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ColossalPrecision)
    assert plugin.precision == "bf16-mixed"
    assert trainer.precision_plugin is plugin
