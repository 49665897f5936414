"""String names resolve to our strategies once `lightning_colossal` is imported."""

import importlib

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

import lightning_colossal
from lightning_colossal import ColossalDDPStrategy


def test_names_resolve_to_the_right_class_and_launcher():
    trainer = Trainer(strategy="colossal_ddp", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, ColossalDDPStrategy)
    assert isinstance(trainer.strategy.launcher, _SubprocessScriptLauncher)
    notebook = Trainer(strategy="colossal_ddp_notebook", accelerator="cpu", devices=2, logger=False)
    assert isinstance(notebook.strategy.launcher, _MultiProcessingLauncher)
    assert notebook.strategy.launcher.is_interactive_compatible  # fork: usable from Jupyter


def test_registration_is_idempotent():
    before = dict(StrategyRegistry)
    lightning_colossal.register_strategies()
    importlib.reload(lightning_colossal)
    assert {name for name in StrategyRegistry if name.startswith("colossal_")} >= {
        "colossal_ddp",
        "colossal_ddp_notebook",
    }
    assert StrategyRegistry["colossal_ddp"]["strategy"].__name__ == before["colossal_ddp"]["strategy"].__name__


def test_strategy_is_distributed_and_restores_after_setup():
    strategy = ColossalDDPStrategy()
    assert strategy.is_distributed
    assert strategy.restore_checkpoint_after_setup
    assert not strategy.lightning_restore_optimizer


def test_unknown_name_and_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="colossal_dpp"):
        Trainer(strategy="colossal_dpp", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        ColossalDDPStrategy(bucket_cap_mb=-1)
    with pytest.raises(ValueError, match="start_method"):
        ColossalDDPStrategy(start_method="threads")  # type: ignore[arg-type]
