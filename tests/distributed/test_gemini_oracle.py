"""Gemini (``GeminiStrategy``) against the single-process oracle: losses and parameters after several steps.

``RegressionModule`` (two param groups with different lr and weight decay) is split into several chunks by a small
``chunk_numel``, so gathers, releases and reductions happen per chunk; on the CPU the compute and offload devices
coincide, so every placement runs here and differs only in what it accounts where.
"""

from __future__ import annotations

from typing import Any

import pytest

from lightning_colossal import AutoPlacement, GeminiStrategy, StaticPlacement
from tests.distributed.oracle import assert_matches_oracle, oracle_train, train_and_record

STEPS = 4
FP32 = {"rtol": 1e-5, "atol": 1e-6}
SMALL_CHUNKS = 1100  # two chunks of RegressionModule, 352 and 1057 elements (the largest parameter has 1024)

PLACEMENTS = {
    "static": StaticPlacement(),
    "static-offload": StaticPlacement(offload_optim_frac=1.0),
    "static-offload-params": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0),
    "keep-gathered": StaticPlacement(shard_param_frac=0.0),
    "auto": AutoPlacement(compute_memory_budget=40_000),
}


def gemini_facts(module: Any) -> dict[str, Any]:
    engine = module.trainer.strategy.engine
    return {} if engine is None else {"num_chunks": len(engine.manager.chunks)}


def train_gemini_body(
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    kwargs = {"chunk_numel": SMALL_CHUNKS, **(strategy_kwargs or {})}
    return train_and_record(GeminiStrategy(**kwargs), steps, accumulate, clip, clip_algorithm, precision)


@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_fp32_matches_oracle_for_every_placement(rank_pool_2, placement):
    results = rank_pool_2.run(
        train_gemini_body, STEPS, 1, None, "norm", "32-true", {"placement": PLACEMENTS[placement]}
    )
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), accumulate=1, **FP32)


def pooled_buffers_body(placement_name: str, accumulate: int) -> dict[str, Any]:
    """Training with every host buffer pooled, however small ([Note: reusing large host buffers]): the test model's
    chunks are far below the pool's usual floor."""
    from lightning_colossal.engine_parts import buffer_pool

    floor = buffer_pool.SMALLEST_POOLED_BYTES
    buffer_pool.SMALLEST_POOLED_BYTES = 0
    reused: list[int] = []
    original_take = buffer_pool.BufferPool.take

    def counting_take(self: Any, *args: Any, **kwargs: Any) -> Any:
        buffer = original_take(self, *args, **kwargs)
        reused.append(self.reused)
        return buffer

    buffer_pool.BufferPool.take = counting_take  # type: ignore[method-assign]
    try:
        result = train_gemini_body(
            STEPS, accumulate, None, "norm", "32-true", {"placement": PLACEMENTS[placement_name]}
        )
    finally:
        buffer_pool.SMALLEST_POOLED_BYTES = floor
        buffer_pool.BufferPool.take = original_take  # type: ignore[method-assign]
    result["reused"] = max(reused, default=0)
    return result


@pytest.mark.parametrize(
    ("placement", "accumulate"), [("static", 1), ("static-offload-params", 2), ("auto", 1)], ids=str
)
def test_reused_host_buffers_never_hold_what_autograd_still_reads(rank_pool_2, placement, accumulate):
    # Gathered chunks are given back while autograd still holds the weights it saved from them; reusing one then would
    # overwrite those weights before backward reads them.
    results = rank_pool_2.run(pooled_buffers_body, placement, accumulate)
    for result in results:
        assert result.pop("reused") > 2 * STEPS, "the pool must actually hand buffers out again"
    assert_matches_oracle(
        results, oracle_train(world_size=2, steps=STEPS, accumulate=accumulate), accumulate=accumulate, **FP32
    )
