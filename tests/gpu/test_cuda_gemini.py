"""CUDA-only checks of GeminiStrategy (skipped without a GPU): real compute-device <-> CPU moves for offloaded
optimizer state and parameter shards, and the allocator-based memory tracer of automatic placement, against the
CPU oracle. Each test runs a fresh interpreter so the process group and CUDA context never leak into pytest."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.fresh_interpreter import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning_colossal import AutoPlacement, GeminiStrategy, StaticPlacement
    from tests.distributed.oracle import float_state, new_module, oracle_train, quiet_trainer

    placements = {
        "offload": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0),
        "auto": AutoPlacement(compute_memory_budget=200_000),
    }
    module = new_module()
    strategy = GeminiStrategy(placement=placements[sys.argv[1]], chunk_numel=1100, max_prefetch=1)
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=4, gradient_clip_val=0.05)
    trainer.fit(module)
    engine = strategy.engine
    chunks = engine.manager.chunks
    if sys.argv[1] == "offload":
        assert all(chunk.master.device.type == "cpu" for chunk in chunks)
        assert all(chunk.shard.device.type == "cpu" for chunk in chunks)
    else:
        assert engine.tracer.finished and engine.tracer.peak_non_model_bytes > 0
    oracle = oracle_train(world_size=1, steps=4, clip_norm=0.05)
    state = float_state(module)
    worst = max((state[name] - oracle.parameters[name]).abs().max().item() for name in state)
    print("worst", worst)
    assert worst < 1e-4, worst
    """
)


@pytest.mark.parametrize("placement", ["offload", "auto"])
def test_gemini_on_cuda_matches_the_cpu_oracle(tmp_path, placement):
    run_script(tmp_path, SCRIPT, placement)
