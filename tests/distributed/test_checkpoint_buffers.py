"""Buffers that differ between ranks (BatchNorm's running statistics, updated from each rank's own batches): every
rank follows the first replica's before each step as under Lightning's ddp ([Note: running statistics follow the
first replica] in ``engine_parts/running_statistics.py``), and they reach the checkpoint whole from the first replica,
never one layer's mean from one rank and its variance from another ([Note: buffers in checkpoints] in
``strategies/checkpointing.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_colossal.checkpoint import consolidate
from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec, build_strategy
from tests.distributed.oracle import quiet_trainer


class BatchNormModule(LightningModule):
    """Two BatchNorm layers; each rank's batches have their own scale, so the running statistics differ by rank."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 1)
        )

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def validation_step(self, batch: Any, batch_index: int) -> None:
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)

    def val_dataloader(self) -> Any:
        generator = torch.Generator().manual_seed(200 + self.trainer.global_rank)
        return DataLoader([(torch.randn(8, 4, generator=generator), torch.randn(8, 1))], batch_size=None)

    def train_dataloader(self) -> Any:
        rank = self.trainer.global_rank
        generator = torch.Generator().manual_seed(100 + rank)
        batches = [(torch.randn(8, 4, generator=generator) * (1 + 3 * rank), torch.randn(8, 1)) for _ in range(3)]
        return DataLoader(batches, batch_size=None)


def strategy_of(spec: StrategySpec | str) -> Any:
    """A strategy from a checkpoint-bodies spec, ``("hybrid", arguments)``, or a registered name (Lightning's "ddp")."""
    from lightning_colossal import HybridParallelStrategy

    if isinstance(spec, str):
        return spec
    kind, arguments = spec
    return HybridParallelStrategy(**arguments) if kind == "hybrid" else build_strategy(spec)


def _fit(spec: StrategySpec | str, **settings: Any) -> tuple[Any, BatchNormModule]:
    seed_everything(0, verbose=False)
    module = BatchNormModule()
    trainer = quiet_trainer(
        strategy=strategy_of(spec),
        devices=torch.distributed.get_world_size(),
        use_distributed_sampler=False,
        **settings,
    )
    trainer.fit(module)
    return trainer, module


def _buffers(module: BatchNormModule) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


def save_body(spec: StrategySpec, path: str) -> dict[str, torch.Tensor]:
    # No validation forward, which would make the ranks' statistics equal again.
    trainer, module = _fit(spec, max_steps=3, limit_val_batches=0)
    trainer.save_checkpoint(path)
    return _buffers(module)


@pytest.mark.parametrize(
    "spec",
    [DDP, ZERO1, ZERO2, FSDP, GEMINI, ("hybrid", {"zero_stage": 1})],
    ids=lambda spec: f"{spec[0]}{spec[1].get('stage', '')}",
)
def test_checkpoint_holds_the_first_replicas_buffers_whole(rank_pool_2, tmp_path, spec):
    path = tmp_path / "model.ckpt"
    first, second = rank_pool_2.run(save_body, spec, str(path))
    running = [name for name in first if name.endswith(("running_mean", "running_var"))]
    assert len(running) == 4
    assert all(not torch.equal(first[name], second[name]) for name in running), "the ranks' statistics must differ"
    saved = torch.load(consolidate(path, tmp_path / "weights.pt", weights_only=True), weights_only=True)
    for name, buffer in first.items():
        torch.testing.assert_close(saved[name], buffer, rtol=0, atol=0, msg=name)
    # The file next to the shards (what load_from_checkpoint reads) holds the same.
    loaded = BatchNormModule.load_from_checkpoint(path)
    for name, buffer in first.items():
        torch.testing.assert_close(loaded.get_buffer(name), buffer, rtol=0, atol=0, msg=name)


def fit_with_validation_body(spec: StrategySpec | str) -> dict[str, Any]:
    trainer, module = _fit(spec, max_epochs=2, num_sanity_val_steps=0)
    return {"buffers": _buffers(module), "val_loss": float(trainer.callback_metrics["val_loss"])}


@pytest.fixture(scope="module")
def lightning_ddp_run(rank_pool_2) -> list[dict[str, Any]]:
    return rank_pool_2.run(fit_with_validation_body, "ddp")


@pytest.mark.parametrize(
    "spec", [ZERO2, FSDP, GEMINI, ("hybrid", {"zero_stage": 1})], ids=["zero2", "fsdp", "gemini", "hybrid"]
)
def test_running_statistics_and_validation_follow_the_first_replica_as_under_ddp(rank_pool_2, lightning_ddp_run, spec):
    results = rank_pool_2.run(fit_with_validation_body, spec)
    reference = lightning_ddp_run
    assert not torch.equal(reference[0]["buffers"]["net.1.running_mean"], torch.zeros(16))
    for rank, (result, expected) in enumerate(zip(results, reference, strict=True)):
        for name, buffer in expected["buffers"].items():
            torch.testing.assert_close(result["buffers"][name], buffer, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
        assert abs(result["val_loss"] - expected["val_loss"]) < 1e-5, (result["val_loss"], expected["val_loss"])
