"""Lightning's learning-rate finder (``Tuner(trainer).lr_find``) under every strategy.

The finder saves a checkpoint, trains with its own LR scheduler (which adds ``initial_lr`` to the param groups),
then restores the checkpoint. Every strategy refused that restore with DCP's "Missing key in checkpoint state_dict:
optimizer_0.param_groups.0.initial_lr" until settings the checkpoint lacks kept their current value
(``strategies/checkpointing.py``). Checked here: the restore puts back the weights from before the search, every
strategy suggests the same learning rate, and a fit after it trains to the same weights everywhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.tuner import Tuner

from tests.distributed.checkpoint_bodies import StrategySpec
from tests.distributed.oracle import float_state, new_module, quiet_trainer
from tests.distributed.test_workflow_rows import EVERY_STRATEGY, _strategy


def learning_rate_finder_body(spec: StrategySpec, directory: str) -> dict[str, Any]:
    module = new_module()
    before = float_state(module)
    trainer = quiet_trainer(strategy=_strategy(spec), devices=2, max_steps=3, default_root_dir=directory)
    result = Tuner(trainer).lr_find(module, num_training=30, update_attr=False, early_stop_threshold=None)
    suggestion = result.suggestion(skip_begin=2, skip_end=1) if result is not None else None
    after_search = float_state(module)
    module.learning_rate = suggestion
    trainer.fit(module)
    return {"before": before, "after_search": after_search, "suggestion": suggestion, "trained": float_state(module)}


@pytest.fixture(scope="module")
def finder_results(rank_pool_2, tmp_path_factory) -> dict[str, dict[str, Any]]:
    return {
        name: rank_pool_2.run(
            learning_rate_finder_body, spec, str(tmp_path_factory.mktemp(f"lr_find_{name}")), timeout=180
        )[0]
        for name, spec in EVERY_STRATEGY.items()
    }


@pytest.mark.parametrize("strategy_name", list(EVERY_STRATEGY))
def test_learning_rate_finder_restores_the_weights_and_agrees_with_colossal_ddp(finder_results, strategy_name):
    result, reference = finder_results[strategy_name], finder_results["ddp"]
    for name, value in result["before"].items():
        torch.testing.assert_close(result["after_search"][name], value, rtol=0, atol=0, msg=name)
    assert result["suggestion"] is not None and result["suggestion"] == pytest.approx(reference["suggestion"])
    for name, value in reference["trained"].items():
        torch.testing.assert_close(result["trained"][name], value, rtol=1e-5, atol=1e-6, msg=name)
    # The fit after the search trained (the weights moved from where the search left them).
    assert any(not torch.equal(result["trained"][name], value) for name, value in result["before"].items())
