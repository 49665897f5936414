"""ColossalFSDPStrategy's arguments, names and precision hand-over, without a process group."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

import lightning_colossal  # noqa: F401  (registers the strategy names)
from lightning_colossal import ColossalFSDPStrategy, ColossalPrecision

NAMES = {"colossal_fsdp": False, "colossal_fsdp_offload": True}  # name -> cpu_offload


@pytest.mark.parametrize("name", sorted(NAMES))
def test_names_register_offload_and_launcher(name):
    for suffix in ("", "_notebook"):
        entry = StrategyRegistry[name + suffix]
        assert entry["strategy"] is ColossalFSDPStrategy
        assert bool(entry["init_params"].get("cpu_offload", False)) is NAMES[name], (name + suffix, entry)
    trainer = Trainer(strategy=name, accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ColossalFSDPStrategy)
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    notebook = Trainer(strategy=name + "_notebook", accelerator="cpu", devices=2, logger=False)
    assert isinstance(notebook.strategy, ColossalFSDPStrategy)
    assert isinstance(notebook.strategy.launcher, _MultiProcessingLauncher)
    assert notebook.strategy.launcher.is_interactive_compatible  # fork: usable from Jupyter


@pytest.mark.parametrize("replicate_size", [0, -2])
def test_bad_replicate_size_is_rejected(replicate_size):
    with pytest.raises(ValueError, match="replicate_size"):
        ColossalFSDPStrategy(replicate_size=replicate_size)


def test_valid_arguments_are_accepted():
    strategy = ColossalFSDPStrategy(
        wrap_policy=["Block"],
        reshard_after_forward=False,
        cpu_offload=True,
        activation_checkpointing=True,
        replicate_size=2,
    )
    assert strategy.is_distributed
    assert strategy.restore_checkpoint_after_setup


def test_trainer_precision_reaches_colossal_precision():
    trainer = Trainer(strategy="colossal_fsdp", accelerator="cpu", devices=2, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ColossalPrecision)
    assert plugin.precision == "bf16-mixed"
    assert trainer.precision_plugin is plugin
