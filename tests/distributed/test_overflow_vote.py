"""The cross-rank overflow vote (``precision.py`` [Note: overflow is global]) with an overflow only one rank can see.

Multiplying one rank's loss by inf does not test the vote: the gradient reduction sums that rank's inf/nan into every
rank's gradient, so every rank finds the overflow on its own. Here rank 0 alone poisons, at one step, the gradient
flowing into hidden unit ``POISONED_UNIT`` of ``model.input``. Only row ``POISONED_UNIT`` of ``model.input.weight`` and
element ``POISONED_UNIT`` of ``model.input.bias`` become non-finite, and after the reduction those rows belong to
rank 1's shard under ZeRO-1/2, Gemini and FSDP: rank 0's own gradients stay finite. Each body records what every rank
saw locally before the vote (asserted: rank 0 finite, rank 1 not), so without the vote the ranks would disagree on
skipping; the tests check that they all skip that step, back the scale off identically, and stay in lock-step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import Callback

from lightning_colossal import ColossalFSDPStrategy, ColossalPrecision, GeminiStrategy, LossScalerConfig, ZeroStrategy
from lightning_colossal.precision import optimizer_gradients
from tests.distributed.oracle import (
    MODEL_SEED,
    RegressionModel,
    RegressionModule,
    float_state,
    oracle_train,
    quiet_trainer,
)

STEPS = 4
POISONED_STEP = 1
POISONED_UNIT = 31  # the last of model.input's 32 rows: rank 1's half at 2 ranks
LOOSE = {"rtol": 2e-2, "atol": 2e-3}


class PoisonGradient(torch.autograd.Function):
    """Identity forward; backward makes the gradient of the last feature non-finite."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.clone()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        gradient = gradient.clone()
        gradient[..., POISONED_UNIT] = float("inf")
        return gradient


class PoisonableModel(RegressionModel):
    """``RegressionModel`` whose input layer's output gradient is poisoned while ``poison`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.poison = False

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        pre_activation = self.input(inputs)
        if self.poison:
            pre_activation = PoisonGradient.apply(pre_activation)
        hidden = torch.tanh(self.norm(pre_activation))
        hidden = self.dropout(torch.relu(self.hidden(hidden)))
        return self.output(hidden)


class PoisonOnRankZero(RegressionModule):
    def __init__(self) -> None:
        super().__init__()
        seed_everything(MODEL_SEED, verbose=False)
        self.model = PoisonableModel()  # the same initial weights as the oracle's RegressionModel

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        self.model.poison = self.global_step == POISONED_STEP and self.global_rank == 0
        return super().training_step(batch, batch_index)


class LocalOverflowRecorder(Callback):
    """Per step: whether this rank's own (unscaled) gradient shards hold an inf/nan, before any vote."""

    def __init__(self) -> None:
        self.local_overflow: list[bool] = []

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        gradients = optimizer_gradients(getattr(optimizer, "_optimizer", optimizer))
        self.local_overflow.append(not all(torch.isfinite(gradient).all().item() for gradient in gradients))


def overflow_body(kind: str, strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    seed_everything(MODEL_SEED, verbose=False)
    module = PoisonOnRankZero()
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=1024.0, hysteresis=1))
    strategy: Any = {"zero": ZeroStrategy, "gemini": GeminiStrategy, "fsdp": ColossalFSDPStrategy}[kind](
        **strategy_kwargs
    )
    recorder = LocalOverflowRecorder()
    trainer = quiet_trainer(
        strategy=strategy,
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        plugins=[plugin],
        callbacks=[recorder],
    )
    trainer.fit(module)
    scaler = plugin.loss_scaler
    assert scaler is not None
    return {
        "local_overflow": recorder.local_overflow,
        "skipped": scaler.skipped_steps,
        "scale": scaler.scale,
        "parameters": float_state(module),
    }


CASES = {
    "zero1": ("zero", {"stage": 1}),
    "zero2": ("zero", {"stage": 2}),
    "gemini": ("gemini", {"chunk_numel": 1100}),
    "fsdp": ("fsdp", {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_overflow_seen_by_one_rank_only_skips_the_step_everywhere(rank_pool_2, case):
    kind, kwargs = CASES[case]
    results = rank_pool_2.run(overflow_body, kind, kwargs, timeout=90)
    # The case needs the vote: at the poisoned step only rank 1's shard held the inf/nan.
    expected = [step == POISONED_STEP for step in range(STEPS)]
    assert results[1]["local_overflow"] == expected, results[1]["local_overflow"]
    assert results[0]["local_overflow"] == [False] * STEPS, results[0]["local_overflow"]
    for result in results:
        assert result["skipped"] == 1, result["skipped"]
        assert result["scale"] == 512.0, result["scale"]  # backed off once (hysteresis=1), on every rank
    torch.testing.assert_close(results[1]["parameters"], results[0]["parameters"], rtol=0, atol=0)
    if kind != "fsdp":  # FSDP gathers every parameter in fp16, which plain autocast does not: no tight oracle
        oracle = oracle_train(world_size=2, steps=STEPS, autocast_dtype=torch.float16, skip_steps=(POISONED_STEP,))
        torch.testing.assert_close(results[0]["parameters"], oracle.parameters, **LOOSE)
