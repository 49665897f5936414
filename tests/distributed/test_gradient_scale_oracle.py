"""Gradient *scale* against the oracle: plain SGD and a clip threshold that triggers on some steps only.

AdamW divides each update by the root of the gradient's second moment, so a gradient that is twice too large (a
reduction that sums over ranks instead of averaging) moves the weights almost exactly as the right one does; and a
clip threshold that triggers on every step rescales every gradient to the same norm, hiding the scale a second time.
The tests here remove both disguises: SGD without momentum moves each weight by ``lr * gradient``, and the clip
threshold lies between the oracle's gradient norms, so that it clips some steps and leaves others alone (each test
checks this on the oracle it compares with, and that a doubled gradient would land measurably elsewhere).

The second half trains a model with a zero-dimensional parameter (a learnable output temperature). ZeRO and Gemini
hold such a parameter whole on every rank (it has no rows to shard), so the global gradient norm must count it on
one rank only; counting it on every rank changes the norm, and with it the clip coefficient of the clipped steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything
from torch import nn

from lightning_colossal import (
    AutoPlacement,
    ColossalDDPStrategy,
    ColossalFSDPStrategy,
    GeminiStrategy,
    StaticPlacement,
    ZeroStrategy,
)
from tests.distributed.oracle import (
    MODEL_SEED,
    RegressionModel,
    RegressionModule,
    _rank_micro_batches,
    assert_matches_oracle,
    float_state,
    make_dataset,
    quiet_trainer,
)

STEPS = 6
ACCUMULATE = 2
LEARNING_RATE = 0.1
# Between the oracle's pre-clip gradient norms (see test_clip_thresholds_split_the_steps): some steps clip, some not.
CLIP = 0.9
CLIP_WITH_TEMPERATURE = 1.5
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
CHUNK_NUMEL = 1100  # RegressionModel in two Gemini chunks (352 and 1057 elements; 1058 with the temperature)

STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    # Tiny buckets (about 262 elements) step bucket by bucket with the exchanges overlapped (zero/exchange.py).
    "zero1": ("zero", {"stage": 1, "bucket_size_mb": 0.001}),
    "zero2": ("zero", {"stage": 2}),
    "zero2-offload": ("zero", {"stage": 2, "cpu_offload": True, "bucket_size_mb": 0.001}),
    "gemini-static": ("gemini", {}),
    "gemini-auto": ("gemini", {"placement": "auto"}),
    "gemini-offload": ("gemini", {"placement": "offload"}),
    "fsdp": ("fsdp", {}),
}


def build_strategy(kind: str, arguments: dict[str, Any]) -> Any:
    if kind == "ddp":
        return ColossalDDPStrategy(**arguments)
    if kind == "zero":
        return ZeroStrategy(**arguments)
    if kind == "fsdp":
        return ColossalFSDPStrategy(**arguments)
    placement = {
        None: StaticPlacement(),
        "auto": AutoPlacement(compute_memory_budget=40_000),
        "offload": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0),
    }[arguments.get("placement")]
    return GeminiStrategy(chunk_numel=CHUNK_NUMEL, placement=placement)


class TemperatureModel(RegressionModel):
    """``RegressionModel`` whose output is multiplied by a learnable zero-dimensional temperature.

    The temperature enters with a gain, so that its gradient is a sizeable part of the global norm.
    """

    GAIN = 8.0

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.tensor(1.5 / self.GAIN))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return super().forward(inputs) * (self.GAIN * self.temperature)


class SGDModule(RegressionModule):
    """``RegressionModule`` stepped by plain SGD (no momentum): the update is proportional to the gradient."""

    def __init__(self, temperature: bool = False) -> None:
        super().__init__(learning_rate=LEARNING_RATE)
        if temperature:
            self.model = TemperatureModel()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_sgd(self)


def build_sgd(module: nn.Module) -> torch.optim.Optimizer:
    # Two groups with different learning rates: the engines must keep the user's groups.
    matrices = [parameter for parameter in module.parameters() if parameter.ndim >= 2]
    others = [parameter for parameter in module.parameters() if parameter.ndim < 2]
    return torch.optim.SGD(
        [{"params": matrices}, {"params": others, "lr": LEARNING_RATE * 0.5}], lr=LEARNING_RATE, momentum=0.0
    )


def new_sgd_module(temperature: bool = False) -> SGDModule:
    seed_everything(MODEL_SEED, verbose=False)
    return SGDModule(temperature)


@dataclass
class SGDOracle:
    step_losses: list[float] = field(default_factory=list)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)  # global gradient norm of each step, before clipping


def sgd_oracle(
    world_size: int,
    clip: float | None,
    temperature: bool = False,
    gradient_factor: float = 1.0,
    scalar_counted: int = 1,
) -> SGDOracle:
    """The oracle of ``oracle.oracle_train`` with SGD; ``gradient_factor`` and ``scalar_counted`` model bugs (a summed
    reduction, a zero-dimensional gradient counted on every rank) so the tests can show that they would be seen."""
    module = new_sgd_module(temperature)
    model = module.model
    optimizer = build_sgd(module)
    dataset = make_dataset()
    inputs, targets = dataset.tensors
    micro_batches = _rank_micro_batches(dataset, world_size, batch_size=4)
    result = SGDOracle()
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses = [
            nn.functional.mse_loss(model(inputs[chosen]), targets[chosen])
            for _ in range(ACCUMULATE)
            for chosen in next(micro_batches)
        ]
        loss = torch.stack(losses).mean()
        loss.backward()
        result.step_losses.append(loss.item())
        gradients = [parameter.grad for parameter in model.parameters()]
        for gradient in gradients:
            gradient.mul_(gradient_factor)
        squares = sum(
            gradient.double().pow(2).sum() * (scalar_counted if gradient.ndim == 0 else 1) for gradient in gradients
        )
        norm = float(squares.sqrt())
        result.norms.append(norm)
        if clip is not None and norm > clip:
            for gradient in gradients:
                gradient.mul_(clip / (norm + 1e-6))
        optimizer.step()
    result.parameters = float_state(module)
    return result


def sgd_body(name: str, clip: float | None, temperature: bool) -> dict[str, Any]:
    module = new_sgd_module(temperature)
    trainer = quiet_trainer(
        strategy=build_strategy(*STRATEGIES[name]),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=clip,
    )
    trainer.fit(module)
    assert trainer.global_step == STEPS
    return {"losses": module.micro_batch_losses, "parameters": float_state(module)}


def _distance(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    return max((first[name] - second[name]).abs().max().item() for name in first)


@pytest.mark.parametrize("temperature", [False, True], ids=["plain", "temperature"])
def test_clip_thresholds_split_the_steps(temperature):
    """The threshold clips some of the oracle's steps and not others, never within 2% of a norm (float noise)."""
    clip = CLIP_WITH_TEMPERATURE if temperature else CLIP
    oracle = sgd_oracle(world_size=2, clip=clip, temperature=temperature)
    clipped = [norm > clip for norm in oracle.norms]
    assert any(clipped) and not all(clipped), (clip, oracle.norms)
    assert all(abs(norm - clip) > 0.02 * clip for norm in oracle.norms), (clip, oracle.norms)
    # A gradient twice too large lands measurably elsewhere, even though some steps are clipped.
    doubled = sgd_oracle(world_size=2, clip=clip, temperature=temperature, gradient_factor=2.0)
    assert _distance(doubled.parameters, oracle.parameters) > 1e-2
    if temperature:
        # So does a temperature gradient counted on both ranks in the norm (the clipped steps clip harder).
        counted_twice = sgd_oracle(world_size=2, clip=clip, temperature=True, scalar_counted=2)
        assert _distance(counted_twice.parameters, oracle.parameters) > 1e-4


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_sgd_with_partial_clipping_matches_oracle(rank_pool_2, name):
    results = rank_pool_2.run(sgd_body, name, CLIP, False)
    assert_matches_oracle(results, sgd_oracle(world_size=2, clip=CLIP), ACCUMULATE, **TIGHT)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["zero1", "zero2", "gemini-static"])
def test_zero_dimensional_parameter_is_counted_once_and_trained(rank_pool_2, name):
    results = rank_pool_2.run(sgd_body, name, CLIP_WITH_TEMPERATURE, True)
    oracle = sgd_oracle(world_size=2, clip=CLIP_WITH_TEMPERATURE, temperature=True)
    assert_matches_oracle(results, oracle, ACCUMULATE, **TIGHT)  # type: ignore[arg-type]
    assert abs(results[0]["parameters"]["model.temperature"].item() - 1.5 / TemperatureModel.GAIN) > 1e-3, (
        "the temperature must train"
    )
