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
        # On a GPU, non-model memory includes cuBLAS's workspace (32 MiB on an H100, seen as 34.6 MB of it when a
        # 200 kB budget was refused): a budget must leave room for it.
        "auto": AutoPlacement(compute_memory_budget=64 * 2**20),
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


BUDGET_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader
    from lightning_colossal import AutoPlacement, GeminiStrategy
    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule
    from tests.distributed.oracle import float_state, quiet_trainer
    from tests.distributed.test_gemini_memory import DeviceBytesProbe

    class PartlyFrozen(GPTLightningModule):
        def configure_model(self):
            super().configure_model()
            self.model.blocks[0].requires_grad_(False)  # a frozen chunk: its shard is its master and moves whole

    def train(accelerator, budget):
        seed_everything(3, verbose=False)
        # 31M parameters: 126 MB of fp32 shards, beyond a budget that also holds cuBLAS's 32 MiB workspace.
        module = PartlyFrozen(vocab_size=64, block_size=8, num_layers=10, num_heads=4, embed_dim=512, warmup_steps=2)
        loader = DataLoader(RandomTokenDataset(num_samples=8, block_size=8, vocab_size=64, seed=5), batch_size=1)
        probe = DeviceBytesProbe()
        strategy = GeminiStrategy(placement=AutoPlacement(compute_memory_budget=budget), chunk_numel=1 << 20)
        trainer = quiet_trainer(accelerator=accelerator, devices=1, strategy=strategy, max_steps=3, callbacks=[probe])
        trainer.fit(module, train_dataloaders=loader)
        return module, probe, strategy.engine

    budget = 64 * 2**20  # below the 126 MB of fp32 shards at one rank
    module, probe, engine = train(sys.argv[1], budget)
    assert probe.shard_bytes > 1.5 * budget, probe.shard_bytes
    assert max(probe.peaks) <= budget, probe.peaks
    assert engine.memory_report().evictions > 0
    reference, reference_probe, _ = train("cpu", None)
    print("losses", probe.losses, reference_probe.losses)
    torch.testing.assert_close(torch.tensor(probe.losses), torch.tensor(reference_probe.losses), rtol=1e-4, atol=1e-5)
    state, expected = float_state(module), float_state(reference)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=1e-4, atol=1e-5, msg=name)
    """
)


def test_auto_placement_under_a_budget_below_the_model_moves_shards_and_frozen_chunks(tmp_path):
    # Shards start on the CPU and come onto the GPU as modules need them; evicting a frozen chunk moves its shard,
    # which is its own master, across devices (on the CPU both are the same memory, so only a GPU tests it).
    run_script(tmp_path, BUDGET_SCRIPT, "cuda")
