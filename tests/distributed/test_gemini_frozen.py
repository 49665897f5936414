"""Gemini shards frozen parameters (``requires_grad=False``) in chunks of their own (gemini/layout.py [Note: frozen
chunks]): a model with frozen layers trains exactly like one process, and each rank holds only its rows of them."""

from __future__ import annotations

import math
from typing import Any

import pytest

from lightning_colossal import AutoPlacement, GeminiStrategy, StaticPlacement
from tests.distributed.oracle import assert_matches_oracle, oracle_train, train_and_record

STEPS = 4
FP32 = {"rtol": 1e-5, "atol": 1e-6}
SMALL_CHUNKS = 1100  # trainable: one chunk (norm, output); frozen: two (input 288 elements, hidden 1024)
# ``input`` runs on data that needs no gradient, so its chunk is never needed in backward; ``hidden`` follows the
# trainable norm, so backward needs its weight for the norm's input gradient: gathered, used, released.
FROZEN = ("input", "hidden")

PLACEMENTS = {
    "static": StaticPlacement(),
    "static-offload": StaticPlacement(offload_optim_frac=1.0),
    "static-offload-params": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0),
    "auto": AutoPlacement(compute_memory_budget=40_000),
}


def frozen_facts(module: Any) -> dict[str, Any]:
    engine = module.trainer.strategy.engine
    report = engine.memory_report()
    return {
        "frozen_chunks": [chunk.index for chunk in engine.manager.chunks if chunk.frozen],
        "frozen_gradients": [
            chunk.index for chunk in engine.manager.chunks if chunk.frozen and chunk.gradient is not None
        ],
        "frozen_shard_bytes": report.frozen_shard_bytes,
        "replicated_bytes": report.replicated_bytes,
    }


def train_frozen_body(placement: str) -> dict[str, Any]:
    strategy = GeminiStrategy(chunk_numel=SMALL_CHUNKS, placement=PLACEMENTS[placement])
    return train_and_record(strategy, STEPS, facts=frozen_facts, frozen=FROZEN)


def own_rows_bytes(shape: tuple[int, ...], world_size: int, rank: int) -> int:
    """Bytes of fp32 rows ``rank`` owns of a parameter of ``shape`` split along dim 0 (ceil rows per rank)."""
    rows_per_rank = math.ceil(shape[0] / world_size)
    rows = max(0, min(shape[0], (rank + 1) * rows_per_rank) - rank * rows_per_rank)
    return rows * math.prod(shape[1:]) * 4


@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_frozen_layers_train_like_one_process_and_are_sharded(rank_pool_2, placement):
    results = rank_pool_2.run(train_frozen_body, placement)
    oracle = oracle_train(world_size=2, steps=STEPS, frozen=FROZEN)
    assert_matches_oracle(results, oracle, accumulate=1, **FP32)
    from tests.distributed.oracle import new_module

    model = new_module(frozen=FROZEN).model
    frozen_shapes = [tuple(p.shape) for p in model.parameters() if not p.requires_grad]
    for rank, result in enumerate(results):
        assert result["frozen_chunks"] == [1, 2], result  # after the one trainable chunk
        assert result["frozen_gradients"] == []
        assert result["replicated_bytes"] == 0
        assert result["frozen_shard_bytes"] == sum(own_rows_bytes(shape, 2, rank) for shape in frozen_shapes)
