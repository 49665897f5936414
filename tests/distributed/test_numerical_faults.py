"""A nan loss, or a nan gradient under a finite loss, on one rank without a loss scaler (``precision.py`` [Note:
non-finite values without a loss scaler]).

Rank 1 alone multiplies its loss by nan at step ``POISONED_STEP`` (or adds a term whose value is 0 and whose gradient
is nan: the loss stays finite and only the gradient check can see it). With ``on_nonfinite="skip"`` every rank must skip
that step together and land on the oracle that skips it; with ``"raise"`` every rank must raise a
``FloatingPointError`` that names the step and rank 1 (as the source of the bad loss) before any weight changes.
Without the check the nan reaches every weight through the gradient reduction, so these tests fail when it is removed.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything

from lightning_colossal import ColossalPrecision
from tests.distributed import hybrid_bodies
from tests.distributed.oracle import MODEL_SEED, RegressionModule, float_state, new_module, oracle_train, quiet_trainer

STEPS = 3
POISONED_STEP = 1
POISONED_RANK = 1


def _poison(module: Any, loss: torch.Tensor) -> torch.Tensor:
    if module.global_step == POISONED_STEP and module.global_rank == POISONED_RANK:
        return loss * float("nan")
    return loss


def _poison_gradient(module: Any, batch: Any, loss: torch.Tensor) -> torch.Tensor:
    """The same loss value, and nan gradients: a term over the model's output (a second forward, as sharded engines
    need) whose value is 0 and whose derivative is sqrt's at 0 (inf) times 0."""
    if module.global_step != POISONED_STEP:
        return loss
    inputs, _ = batch
    zero = module.model(inputs) * 0  # every rank runs the same forwards (sharded engines gather in them)
    return loss + (zero.sqrt() if module.global_rank == POISONED_RANK else zero).sum()


class NanLossOnRankOne(RegressionModule):
    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        return _poison(self, super().training_step(batch, batch_index))


class NanGradientOnRankOne(RegressionModule):
    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        return _poison_gradient(self, batch, super().training_step(batch, batch_index))


class NanLossOnRankOneGPT(hybrid_bodies.TinyGPTModule):
    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        return _poison(self, super().training_step(batch, batch_index))


def _strategy(name: str) -> Any:
    from lightning_colossal import ColossalDDPStrategy, ColossalFSDPStrategy, GeminiStrategy, ZeroStrategy

    return {
        "ddp": lambda: ColossalDDPStrategy(),
        "zero1": lambda: ZeroStrategy(stage=1),
        "zero2": lambda: ZeroStrategy(stage=2),
        "gemini": lambda: GeminiStrategy(chunk_numel=1100),
        "fsdp": lambda: ColossalFSDPStrategy(),
    }[name]()


def nan_loss_body(name: str, action: str, precision: str, poisoned: str = "loss") -> dict[str, Any]:
    plugin = ColossalPrecision(precision, on_nonfinite=action)  # type: ignore[arg-type]
    trainer_kwargs = {"max_steps": STEPS, "plugins": [plugin], "devices": torch.distributed.get_world_size()}
    if name == "hybrid_tp2":
        seed_everything(MODEL_SEED, verbose=False)
        module: Any = NanLossOnRankOneGPT()
        from lightning_colossal import HybridParallelStrategy

        strategy: Any = HybridParallelStrategy(tp_size=2)
    else:
        module = new_module()
        # Same initial weights as the oracle's module.
        module.__class__ = NanLossOnRankOne if poisoned == "loss" else NanGradientOnRankOne
        strategy = _strategy(name)
    trainer = quiet_trainer(strategy=strategy, **trainer_kwargs)
    try:
        trainer.fit(module)
    except FloatingPointError as error:
        return {"error": str(error), "global_step": trainer.global_step}
    weights = hybrid_bodies.full_weights(module, strategy) if name == "hybrid_tp2" else float_state(module)
    return {"error": None, "skipped": plugin.nonfinite_skipped_steps, "weights": weights}


def hybrid_oracle_skipping(steps: int, skip_step: int) -> dict[str, torch.Tensor]:
    """``hybrid_bodies.oracle`` at tp2 (one data-parallel replica), skipping the optimizer step ``skip_step``."""
    seed_everything(MODEL_SEED, verbose=False)
    model = hybrid_bodies.build_model("gpt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=hybrid_bodies.LEARNING_RATE, weight_decay=0.1)
    dataset = hybrid_bodies.token_dataset()
    inputs, targets = dataset.tensors
    batches = hybrid_bodies._rank_micro_batches(dataset, 1, 4)
    for step in range(steps):
        optimizer.zero_grad()
        chosen = [index for rank_indices in next(batches) for index in rank_indices]
        hybrid_bodies.language_model_loss(hybrid_bodies.logits_of(model, inputs[chosen]), targets[chosen]).backward()
        if step != skip_step:
            optimizer.step()
    return {f"model.{name}": value.detach().clone() for name, value in model.state_dict().items()}


NAMES = ["ddp", "zero1", "zero2", "gemini", "fsdp", "hybrid_tp2"]


@pytest.mark.parametrize("name", NAMES)
def test_nan_loss_on_one_rank_skips_the_step_on_every_rank(rank_pool_2, name):
    results = rank_pool_2.run(nan_loss_body, name, "skip", "32-true", timeout=120)
    for result in results:
        assert result["error"] is None and result["skipped"] == 1, result.get("error") or result["skipped"]
        assert all(torch.isfinite(value).all() for value in result["weights"].values())
    tolerance = {"rtol": 1e-4, "atol": 1e-5}
    if name == "hybrid_tp2":
        expected = hybrid_oracle_skipping(STEPS, POISONED_STEP)
        got = hybrid_bodies.merged_weights(results)
        tolerance["atol"] = 1e-4  # tensor-parallel matmuls reassociate sums (as in test_hybrid_oracle.py)
    else:
        oracle = oracle_train(world_size=2, steps=STEPS, skip_steps=(POISONED_STEP,))
        expected = oracle.parameters
        got = results[0]["weights"]
        torch.testing.assert_close(results[1]["weights"], got, rtol=0, atol=0)
    assert set(got) == set(expected), sorted(set(got) ^ set(expected))
    torch.testing.assert_close(got, expected, **tolerance)


@pytest.mark.parametrize("name", NAMES)
def test_nan_loss_on_one_rank_raises_on_every_rank_naming_step_and_rank(rank_pool_2, name):
    results = rank_pool_2.run(nan_loss_body, name, "raise", "32-true", timeout=120)
    for result in results:
        error = result["error"]
        assert error is not None, "a nan loss was trained on"
        assert f"Step {POISONED_STEP} " in error and f"non-finite loss on rank(s) [{POISONED_RANK}]" in error, error
        assert "on_nonfinite='skip'" in error, error  # the message says the fix
        assert result["global_step"] == POISONED_STEP


def test_bf16_nan_loss_skips_on_every_rank_and_stays_in_lock_step(rank_pool_2):
    results = rank_pool_2.run(nan_loss_body, "zero2", "skip", "bf16-mixed", timeout=120)
    for result in results:
        assert result["error"] is None and result["skipped"] == 1
        assert all(torch.isfinite(value).all() for value in result["weights"].values())
    torch.testing.assert_close(results[1]["weights"], results[0]["weights"], rtol=0, atol=0)
    oracle = oracle_train(world_size=2, steps=STEPS, skip_steps=(POISONED_STEP,), autocast_dtype=torch.bfloat16)
    torch.testing.assert_close(results[0]["weights"], oracle.parameters, rtol=2e-2, atol=2e-3)


GRADIENT_ROWS = [
    name if name in ("zero2", "gemini") else pytest.param(name, marks=pytest.mark.slow) for name in NAMES[:-1]
]


@pytest.mark.parametrize("name", GRADIENT_ROWS)
def test_a_nan_gradient_under_a_finite_loss_skips_the_step_on_every_rank(rank_pool_2, name):
    """Only the gradient check sees it: the loss flags nothing, and the skip must still land on the oracle."""
    results = rank_pool_2.run(nan_loss_body, name, "skip", "32-true", "gradient", timeout=120)
    for result in results:
        assert result["error"] is None and result["skipped"] == 1, result.get("error") or result["skipped"]
    oracle = oracle_train(world_size=2, steps=STEPS, skip_steps=(POISONED_STEP,))
    torch.testing.assert_close(results[1]["weights"], results[0]["weights"], rtol=0, atol=0)
    torch.testing.assert_close(results[0]["weights"], oracle.parameters, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_a_nan_gradient_raises_naming_gradients_not_the_loss(rank_pool_2, precision):
    results = rank_pool_2.run(nan_loss_body, "zero2", "raise", precision, "gradient", timeout=120)
    for result in results:
        error = result["error"]
        assert error is not None, "a nan gradient was trained on"
        assert "non-finite loss on rank(s) none" in error and "non-finite gradients on rank(s) [" in error, error
