"""colossal_hybrid with ``sequence_parallel="ring"`` against the single-process oracle: the demo GPT's losses,
gradient norms and weights after several AdamW and SGD steps, alone and with tensor, pipeline and ZeRO parallelism,
fp32 and bf16.

The oracle trains the same GPT in one process on each step's global batch (``hybrid_bodies``). Under ring attention
each sequence-parallel rank holds two zigzag chunks of every sequence; a step computes exactly the oracle's step,
so weights agree to fp32 rounding (bf16: to the autocast oracle's resolution, with SGD so that a wrong gradient
shows directly in the weights).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything

from tests.distributed import hybrid_bodies as bodies
from tests.distributed.oracle import _rank_micro_batches, quiet_trainer

STEPS = 3
SGD_LEARNING_RATE = 0.5


class RingGPTModule(bodies.TinyGPTModule):
    """The hybrid tests' GPT with a choice of optimizer; records the whole gradient's norm before each step and
    which attention cores the parallelised model runs."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.gradient_norms: list[float] = []

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=SGD_LEARNING_RATE)
        return super().configure_optimizers()

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.gradient_norms.append(float(self.trainer.strategy.gradient_norm(2.0)))


def ring_body(strategy_kwargs: dict[str, Any], optimizer: str, precision: str) -> dict[str, Any]:
    from lightning_colossal import HybridParallelStrategy

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = RingGPTModule(optimizer)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(
        devices=torch.distributed.get_world_size(), strategy=strategy, max_steps=STEPS, precision=precision
    )
    trainer.fit(module)
    cores = {type(module).__name__ for module in module.modules() if type(module).__name__.endswith("Attention")}
    return {
        "weights": bodies.full_weights(module, strategy),
        "losses": module.step_losses,
        "gradient_norms": module.gradient_norms,
        "cores": cores,
    }


def oracle(dp_size: int, optimizer: str, dtype: torch.dtype | None) -> dict[str, Any]:
    """One process, the global batch of each step (under ``autocast(dtype)`` when given)."""
    seed_everything(bodies.MODEL_SEED, verbose=False)
    model = bodies.build_model("gpt")
    if optimizer == "sgd":
        step_with: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=SGD_LEARNING_RATE)
    else:
        step_with = torch.optim.AdamW(model.parameters(), lr=bodies.LEARNING_RATE, weight_decay=0.1)
    dataset = bodies.token_dataset()
    inputs, targets = dataset.tensors
    batches = _rank_micro_batches(dataset, dp_size, batch_size=4)
    losses, gradient_norms = [], []
    for _ in range(STEPS):
        step_with.zero_grad()
        chosen = [index for rank_indices in next(batches) for index in rank_indices]
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = bodies.logits_of(model, inputs[chosen])
        loss = bodies.language_model_loss(logits, targets[chosen])
        loss.backward()
        losses.append(loss.item())
        gradients = [parameter.grad for parameter in model.parameters()]
        gradient_norms.append(torch.nn.utils.get_total_norm(gradients, 2.0).item())
        step_with.step()
    weights = {f"model.{name}": value.detach().clone() for name, value in model.state_dict().items()}
    return {"weights": weights, "losses": losses, "gradient_norms": gradient_norms}


def _assert_matches(results: list[dict[str, Any]], expected: dict[str, Any], bf16: bool) -> None:
    atol, rtol = (2e-3, 0.0) if bf16 else (1e-4, 1e-4)
    for result in results:
        assert result["cores"] == {"CausalSelfAttention", "RingAttention"}, result["cores"]
    got = bodies.merged_weights(results)
    assert set(got) == set(expected["weights"]), sorted(set(got) ^ set(expected["weights"]))
    for name, value in expected["weights"].items():
        torch.testing.assert_close(
            got[name], value, atol=atol, rtol=rtol, msg=lambda text, name=name: f"{name}: {text}"
        )
    # Each rank's loss is the mean over its own tokens; every rank holds as many, so their mean is the global loss.
    rank_mean = torch.tensor([result["losses"] for result in results]).mean(dim=0)
    loss_tolerance = 1e-2 if bf16 else 1e-5
    torch.testing.assert_close(rank_mean, torch.tensor(expected["losses"]), atol=loss_tolerance, rtol=loss_tolerance)
    for result in results:
        torch.testing.assert_close(
            torch.tensor(result["gradient_norms"]),
            torch.tensor(expected["gradient_norms"]),
            atol=0.0,
            rtol=2e-2 if bf16 else 1e-4,
        )


# name: (strategy arguments, data-parallel size, optimizer, precision)
TWO_RANKS = {
    "sp2_adamw": ({"sp_size": 2, "sequence_parallel": "ring"}, 1, "adamw", "32-true"),
    "sp2_sgd": ({"sp_size": 2, "sequence_parallel": "ring"}, 1, "sgd", "32-true"),
    "sp2_sgd_bf16": ({"sp_size": 2, "sequence_parallel": "ring"}, 1, "sgd", "bf16-mixed"),
    # Recomputation runs the ring's forward again inside backward: its exchanges must pair up the same way.
    "sp2_checkpointed_adamw": (
        {"sp_size": 2, "sequence_parallel": "ring", "activation_checkpointing": True},
        1,
        "adamw",
        "32-true",
    ),
}
FOUR_RANKS = {
    "sp4_adamw": ({"sp_size": 4, "sequence_parallel": "ring"}, 1, "adamw", "32-true"),
    "sp2_tp2_adamw": ({"sp_size": 2, "tp_size": 2, "sequence_parallel": "ring"}, 1, "adamw", "32-true"),
    "sp2_tp2_sgd_bf16": ({"sp_size": 2, "tp_size": 2, "sequence_parallel": "ring"}, 1, "sgd", "bf16-mixed"),
    "sp2_dp2_zero1_sgd": ({"sp_size": 2, "zero_stage": 1, "sequence_parallel": "ring"}, 2, "sgd", "32-true"),
    "sp2_dp2_zero2_adamw": ({"sp_size": 2, "zero_stage": 2, "sequence_parallel": "ring"}, 2, "adamw", "32-true"),
    "sp2_pp2_adamw": (
        {"sp_size": 2, "pp_size": 2, "num_microbatches": 2, "sequence_parallel": "ring"},
        1,
        "adamw",
        "32-true",
    ),
}
FAST = {"sp2_adamw", "sp2_sgd_bf16", "sp4_adamw"}


def _run(pool: Any, case: tuple[Any, ...]) -> None:
    strategy_kwargs, dp_size, optimizer, precision = case
    bf16 = precision == "bf16-mixed"
    results = pool.run(ring_body, strategy_kwargs, optimizer, precision, timeout=300)
    _assert_matches(results, oracle(dp_size, optimizer, torch.bfloat16 if bf16 else None), bf16)


def _rows(cases: dict[str, Any]) -> list[Any]:
    return [name if name in FAST else pytest.param(name, marks=pytest.mark.slow) for name in sorted(cases)]


@pytest.mark.parametrize("name", _rows(TWO_RANKS))
def test_ring_on_two_ranks_matches_one_process(rank_pool_2, name):
    _run(rank_pool_2, TWO_RANKS[name])


@pytest.mark.parametrize("name", _rows(FOUR_RANKS))
def test_ring_on_four_ranks_matches_one_process(rank_pool_4, name):
    _run(rank_pool_4, FOUR_RANKS[name])


def refusal_body() -> list[str]:
    """Every rank: the messages of what ring attention refuses, each caught so the pool survives."""
    from lightning_colossal import HybridParallelStrategy

    messages = []
    for module, length in ((bodies.TinyGPTModule(dropout=0.1), 16), (RingGPTModule("adamw"), 6)):
        seed_everything(bodies.MODEL_SEED, verbose=False)
        if length != bodies.SEQUENCE:
            module.train_dataloader = lambda length=length: torch.utils.data.DataLoader(  # type: ignore[method-assign]
                torch.utils.data.TensorDataset(*(torch.zeros(8, length, dtype=torch.long),) * 2), batch_size=4
            )
        strategy = HybridParallelStrategy(sp_size=2, sequence_parallel="ring")
        trainer = quiet_trainer(devices=torch.distributed.get_world_size(), strategy=strategy, max_steps=1)
        with pytest.raises(ValueError) as raised:
            trainer.fit(module)
        messages.append(str(raised.value))
    return messages


def test_ring_refuses_attention_dropout_and_sequences_that_do_not_zigzag(rank_pool_2):
    dropout, length = rank_pool_2.run(refusal_body, timeout=120)[0]
    assert "dropout=0.0" in dropout and "all_to_all" in dropout
    assert "2 * sp_size = 4 equal chunks" in length and "divisible by 4" in length
