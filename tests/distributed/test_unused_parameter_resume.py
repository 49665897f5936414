"""A parameter no gradient ever reaches (an unused layer: a pooler a fine-tuning head skips) under every strategy.

The optimizer keeps no state for it, so a checkpoint holds none. Resuming must not demand any (the sharded load used
to refuse: "Missing key in checkpoint state_dict: optimizer_0.state.unused.weight.step") nor invent any: the resumed
run equals the uninterrupted one bit for bit.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_colossal import HybridParallelStrategy
from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec, build_strategy
from tests.distributed.oracle import RegressionModule, float_state, new_module, quiet_trainer

# DDP needs to be told that some parameters get no gradient, as torch's DDP does.
STRATEGIES: dict[str, StrategySpec] = {
    "ddp": (DDP[0], {"find_unused_parameters": True}),
    "zero1": ZERO1,
    "zero2": ZERO2,
    "gemini": GEMINI,
    "fsdp": FSDP,
}


class WithUnusedLayer(RegressionModule):
    def __init__(self) -> None:
        super().__init__(dropout=0.1, with_scheduler=True)
        self.unused = torch.nn.Linear(4, 4)


def _fit_body(name: str, epochs: int, save_to: str | None, resume_from: str | None) -> dict[str, torch.Tensor]:
    new_module()  # seeds the initial weights
    module = WithUnusedLayer()
    strategy: Any = HybridParallelStrategy(zero_stage=1) if name == "hybrid" else build_strategy(STRATEGIES[name])
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_epochs=epochs)
    trainer.fit(module, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return float_state(module)


@pytest.mark.parametrize("name", [*STRATEGIES, "hybrid"])
def test_a_checkpoint_without_state_for_an_unused_layer_resumes_exactly(rank_pool_2, tmp_path, name):
    checkpoint = str(tmp_path / "after-one-epoch.ckpt")
    straight = rank_pool_2.run(_fit_body, name, 2, None, None)
    rank_pool_2.run(_fit_body, name, 1, checkpoint, None)
    resumed = rank_pool_2.run(_fit_body, name, 2, None, checkpoint)
    for rank_result, reference in zip(resumed, straight, strict=True):
        for parameter, value in reference.items():
            assert torch.equal(rank_result[parameter], value), parameter
