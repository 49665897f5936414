"""ZeRO-1/2 (``ZeroStrategy``) against the single-process oracle: losses and parameters after several steps.

Every body runs on each rank of a rank pool (see ``tests/harness/rank_pool.py``) and trains ``RegressionModule``
(two param groups with different lr and weight decay) with ``ZeroStrategy``; the oracle trains the same global
batches in one process with plain PyTorch. After every step the engine re-synchronises the parameters, so each
rank must also hold exactly the same weights as every other rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_colossal import ColossalPrecision, LossScalerConfig, ZeroStrategy
from tests.distributed.oracle import (
    RegressionModule,
    assert_matches_oracle,
    float_state,
    new_module,
    oracle_train,
    quiet_trainer,
    train_and_record,
)
from tests.distributed.test_zero_memory import owned_numel

STEPS = 4
FP32 = {"rtol": 1e-5, "atol": 1e-6}


def train_zero_body(
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    strategy = ZeroStrategy(**(strategy_kwargs or {}))
    return train_and_record(strategy, steps, accumulate, clip, clip_algorithm, precision)


def _assert_trained(parameters: dict[str, torch.Tensor]) -> None:
    initial = float_state(new_module())
    moved = max((parameters[name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-3, "the parameters did not train: the comparison would prove nothing"


def _assert_clipping_matters(steps: int, accumulate: int, **clip: float) -> None:
    """The clipped oracle differs from the unclipped one, so a strategy that ignores clipping cannot pass."""
    clipped = oracle_train(world_size=2, steps=steps, accumulate=accumulate, **clip).parameters
    unclipped = oracle_train(world_size=2, steps=steps, accumulate=accumulate).parameters
    assert max((clipped[name] - unclipped[name]).abs().max().item() for name in clipped) > 1e-3


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["no-offload", "offload"])
@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_fp32_matches_oracle(rank_pool_2, stage, cpu_offload):
    strategy_kwargs = {"stage": stage, "cpu_offload": cpu_offload}
    results = rank_pool_2.run(train_zero_body, STEPS, 1, None, "norm", "32-true", strategy_kwargs)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), 1, **FP32)
    _assert_trained(results[0]["parameters"])


@pytest.mark.parametrize(
    ("strategy_kwargs", "accumulate"),
    [
        ({"stage": 1}, 2),
        ({"stage": 2, "stage2_accumulation": "sharded"}, 2),
        ({"stage": 2, "stage2_accumulation": "local"}, 2),
        ({"stage": 2, "stage2_accumulation": "sharded"}, 4),
        ({"stage": 2, "stage2_accumulation": "sharded", "cpu_offload": True}, 2),
    ],
    ids=["stage1-acc2", "stage2-sharded-acc2", "stage2-local-acc2", "stage2-sharded-acc4", "stage2-offload-acc2"],
)
def test_accumulation_with_clip_by_norm_matches_oracle(rank_pool_2, strategy_kwargs, accumulate):
    results = rank_pool_2.run(train_zero_body, STEPS, accumulate, 0.05, "norm", "32-true", strategy_kwargs)
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=accumulate, clip_norm=0.05)
    assert_matches_oracle(results, oracle, accumulate, **FP32)
    _assert_clipping_matters(STEPS, accumulate, clip_norm=0.05)


def test_clip_by_value_matches_oracle(rank_pool_2):
    results = rank_pool_2.run(train_zero_body, STEPS, 2, 0.01, "value", "32-true", {"stage": 2})
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_value=0.01)
    assert_matches_oracle(results, oracle, 2, **FP32)
    _assert_clipping_matters(STEPS, 2, clip_value=0.01)


def test_four_ranks_with_empty_shards_and_accumulation(rank_pool_4):
    # With 4 ranks, model.output.weight (1 x 32) and model.output.bias (1,) live on rank 0 alone: ranks 1-3 hold
    # empty shards of them, and must still take part in every collective.
    results = rank_pool_4.run(train_zero_body, 2, 2, 0.05, "norm", "32-true", {"stage": 2})
    assert_matches_oracle(results, oracle_train(world_size=4, steps=2, accumulate=2, clip_norm=0.05), 2, **FP32)


def test_bf16_mixed_matches_oracle_loosely(rank_pool_2):
    results = rank_pool_2.run(train_zero_body, STEPS, 2, None, "norm", "bf16-mixed", {"stage": 2})
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, autocast_dtype=torch.bfloat16)
    assert_matches_oracle(results, oracle, 2, rtol=2e-2, atol=2e-3)
    _assert_trained(results[0]["parameters"])


@pytest.mark.parametrize(
    "strategy_kwargs",
    [{"stage": 2, "overlap_communication": False}, {"stage": 1, "overlap_communication": False}],
    ids=["stage2-no-overlap", "stage1-no-overlap"],
)
def test_communication_settings_still_match_oracle(rank_pool_2, strategy_kwargs):
    # Tiny buckets (several per step) are test_exchange_overlapped_with_the_step_matches_oracle's rows.
    results = rank_pool_2.run(train_zero_body, STEPS, 2, 0.05, "norm", "32-true", strategy_kwargs)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_norm=0.05), 2, **FP32)


@contextmanager
def counted_overlapped_steps() -> Iterator[list[int]]:
    """Inside: each optimizer step that went bucket by bucket with the exchanges overlapped ([Note: exchange
    overlapped with the step]) appends its number of buckets to the yielded list."""
    from lightning_colossal.zero import engine as engine_module

    original = engine_module.step_overlapping_exchange
    overlapped: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> None:
        overlapped.append(len(args[2]))  # the buckets stepped one at a time
        original(*args, **kwargs)

    engine_module.step_overlapping_exchange = counted
    try:
        yield overlapped
    finally:
        engine_module.step_overlapping_exchange = original


def overlapped_exchange_body(strategy_kwargs: dict[str, Any], steps: int) -> dict[str, Any]:
    """``train_zero_body`` with accumulation and a clip, and the overlapped steps' bucket counts."""
    with counted_overlapped_steps() as overlapped:
        result = train_zero_body(steps, 2, 0.05, "norm", "32-true", strategy_kwargs)
    return {**result, "overlapped_buckets": overlapped}


# About 26 fp32 elements: each of the 7 parameters gets a bucket of its own, more buckets than exchanges in flight.
TINY = {"bucket_size_mb": 0.0001}


@pytest.mark.parametrize(
    ("strategy_kwargs", "overlapped"),
    [
        ({"stage": 2, **TINY}, True),
        ({"stage": 2, "cpu_offload": True, **TINY}, True),
        ({"stage": 1, "cpu_offload": True, "communication": "all_reduce", **TINY}, True),
        ({"stage": 2, "communication": "all_reduce", **TINY}, True),
        ({"stage": 2, "overlap_parameter_exchange": False, **TINY}, False),
    ],
    # Stage 1 gathering from fp32 parameters that are their own masters: test_gradient_scale_oracle.py's zero1 row.
    ids=["stage2", "stage2-offload", "stage1-offload-all-reduce", "stage2-all-reduce", "switched-off"],
)
def test_exchange_overlapped_with_the_step_matches_oracle(rank_pool_2, strategy_kwargs, overlapped):
    results = rank_pool_2.run(overlapped_exchange_body, strategy_kwargs, STEPS)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_norm=0.05), 2, **FP32)
    for result in results:
        if overlapped:
            # Every step went bucket by bucket, over more buckets than may be in flight at once.
            assert len(result["overlapped_buckets"]) == STEPS
            assert min(result["overlapped_buckets"]) > 2
        else:
            assert result["overlapped_buckets"] == []


def test_exchange_overlapped_with_the_step_on_four_ranks_with_empty_shards(rank_pool_4):
    results = rank_pool_4.run(overlapped_exchange_body, {"stage": 2, **TINY}, 2)
    assert_matches_oracle(results, oracle_train(world_size=4, steps=2, accumulate=2, clip_norm=0.05), 2, **FP32)
    assert all(len(result["overlapped_buckets"]) == 2 for result in results)


def overlapped_and_after_body(strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    results: dict[Any, Any] = {}
    for overlap in (True, False):
        strategy = ZeroStrategy(**strategy_kwargs, overlap_parameter_exchange=overlap, **TINY)
        with counted_overlapped_steps() as overlapped:
            results[overlap] = train_and_record(strategy, STEPS, 2, 0.05, "norm", "bf16-true")
        results[overlap]["overlapped_steps"] = len(overlapped)
    return results


@pytest.mark.parametrize("stage", [1, 2])
def test_bf16_weights_train_the_same_with_the_exchange_overlapped_or_after_the_step(rank_pool_2, stage):
    # bf16 parameters get separate fp32 masters, written into the parameters bucket by bucket when overlapped.
    results = rank_pool_2.run(overlapped_and_after_body, {"stage": stage})
    for result in results:
        overlapped, after = result[True], result[False]
        assert (overlapped["overlapped_steps"], after["overlapped_steps"]) == (STEPS, 0)
        assert overlapped["losses"] == after["losses"]
        for name, value in after["parameters"].items():
            assert torch.equal(overlapped["parameters"][name], value), name
    _assert_trained(results[0][True]["parameters"])


def fp16_overflow_body(overflow_at_step: int) -> dict[str, Any]:
    world_size = torch.distributed.get_world_size()
    module = new_module(overflow_at_step=overflow_at_step)
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=1024.0, hysteresis=1))
    trainer = quiet_trainer(strategy=ZeroStrategy(stage=2), devices=world_size, max_steps=STEPS, plugins=[plugin])
    trainer.fit(module)
    scaler = plugin.loss_scaler
    assert scaler is not None
    return {
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
        "skipped": scaler.skipped_steps,
        "scale": scaler.scale,
    }


def test_fp16_overflow_on_one_rank_skips_exactly_that_step_everywhere(rank_pool_2):
    # Rank 1 alone multiplies its loss by inf in step 1: every rank must skip that step (and only that one) and
    # back off the scale once, leaving stage 2's sharded accumulator clean for the next step.
    results = rank_pool_2.run(fp16_overflow_body, 1)
    for result in results:
        assert result["skipped"] == 1
        assert result["scale"] == 512.0  # backed off once (hysteresis=1)
    oracle = oracle_train(world_size=2, steps=STEPS, autocast_dtype=torch.float16, skip_steps=(1,))
    torch.testing.assert_close(results[0]["parameters"], oracle.parameters, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)
    # Had step 1 not been skipped, the weights would be measurably elsewhere.
    unskipped = oracle_train(world_size=2, steps=STEPS, autocast_dtype=torch.float16)
    assert max((unskipped.parameters[n] - oracle.parameters[n]).abs().max().item() for n in oracle.parameters) > 1e-2


class MemoryProbe(Callback):
    """Keeps the engine's memory report of the latest training batch (taken after its optimizer step)."""

    def __init__(self) -> None:
        self.report: Any = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.report = trainer.strategy.engine.memory_report()


def named_strategy_body(name: str) -> dict[str, Any]:
    world_size = torch.distributed.get_world_size()
    module = new_module()
    probe = MemoryProbe()
    trainer = quiet_trainer(strategy=name, devices=world_size, max_steps=STEPS, callbacks=[probe])
    strategy = trainer.strategy
    trainer.fit(module)
    shapes = [parameter.shape for parameter in module.parameters()]
    return {
        "class": type(strategy).__name__,
        "is_zero": isinstance(strategy, ZeroStrategy),
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
        "report": probe.report._asdict(),
        "owned_bytes": 4 * sum(owned_numel(shape, world_size, torch.distributed.get_rank()) for shape in shapes),
    }


def test_string_name_resolves_and_trains(rank_pool_2):
    results = rank_pool_2.run(named_strategy_body, "colossal_zero2_offload")
    assert all(result["is_zero"] for result in results), results[0]["class"]
    for result in results:
        report = result["report"]
        # Stage 2: only this rank's gradient rows, once on the compute device and once (offload) on the host.
        assert report["gradient_bytes"] == 2 * result["owned_bytes"], (report, result["owned_bytes"])
        assert report["master_bytes"] == result["owned_bytes"], "cpu_offload keeps an fp32 master of the owned rows"
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), 1, **FP32)


class ManualModule(RegressionModule):
    """``RegressionModule`` stepped by hand: the same steps as automatic optimization."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        optimizer = self.optimizers()
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
        self.micro_batch_losses.append(loss.detach().item())
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def manual_optimization_body(stage: int) -> dict[str, Any]:
    from lightning.pytorch import seed_everything

    from tests.distributed.oracle import MODEL_SEED

    seed_everything(MODEL_SEED, verbose=False)
    module = ManualModule()
    trainer = quiet_trainer(
        strategy=ZeroStrategy(stage=stage), devices=torch.distributed.get_world_size(), max_steps=STEPS
    )
    trainer.fit(module)
    return {"losses": module.micro_batch_losses, "parameters": float_state(module)}


@pytest.mark.parametrize("stage", [1, 2])
def test_manual_optimization_matches_oracle(rank_pool_2, stage):
    """One optimizer stepped by hand trains as automatic optimization does (tests/distributed/
    test_manual_optimization.py has several optimizers)."""
    results = rank_pool_2.run(manual_optimization_body, stage, timeout=60)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), 1, **FP32)
    _assert_trained(results[0]["parameters"])


def one_process_oracle_body(steps: int) -> Any:
    return oracle_train(world_size=1, steps=steps)


@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
def test_one_rank_matches_the_oracle_bit_for_bit(rank_pool_1, stage):
    """At one rank nothing is reduced: the engine's own bookkeeping (a gradient summed into its accumulator, a
    bucket completed without partners) must leave one process's exact bits. The oracle runs in the same worker, with
    its one thread: in the pytest process its matmuls may split over more threads and round differently."""
    results = rank_pool_1.run(train_zero_body, STEPS, 1, None, "norm", "32-true", {"stage": stage})
    (oracle,) = rank_pool_1.run(one_process_oracle_body, STEPS)
    assert_matches_oracle(results, oracle, 1, rtol=0, atol=0)
    _assert_trained(results[0]["parameters"])
