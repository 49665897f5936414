"""What every lightning_colossal strategy inherits from ColossalStrategy, checked through colossal_ddp."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader

from lightning_colossal import ColossalDDPStrategy
from tests.distributed.oracle import (
    MODEL_SEED,
    RegressionModule,
    float_state,
    make_dataset,
    new_module,
    quiet_trainer,
)


class ProbeModule(LightningModule):
    """Logs rank-dependent values and records what the strategy hands it."""

    def __init__(self) -> None:
        super().__init__()
        self.layer: torch.nn.Linear | None = None
        self.seen_samples: list[float] = []
        self.mesh_axes: tuple[str, ...] = ()
        self.collectives: dict[str, Any] = {}

    def configure_model(self) -> None:
        if self.layer is not None:
            return
        self.mesh_axes = tuple(self.device_mesh.mesh_dim_names or ())
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        self.seen_samples.extend(inputs[:, 0].tolist())
        self.log("rank_value", float(self.global_rank), sync_dist=True)
        strategy = self.trainer.strategy
        rank_tensor = torch.tensor(float(self.global_rank + 1))
        self.collectives = {
            "sum": strategy.reduce(rank_tensor, reduce_op="sum").item(),
            "max": strategy.reduce(rank_tensor, reduce_op="max").item(),
            "mean": strategy.reduce(rank_tensor).item(),
            "gathered": strategy.all_gather(rank_tensor.unsqueeze(0)).flatten().tolist(),
            "broadcast": strategy.broadcast(f"from rank {self.global_rank}", src=1),
            "untouched": rank_tensor.item(),
        }
        assert self.layer is not None
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(), batch_size=4)


def probe_body() -> dict[str, Any]:
    module = ProbeModule()
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=torch.distributed.get_world_size(), max_epochs=1)
    trainer.fit(module)
    return {
        "logged": trainer.callback_metrics["rank_value"].item(),
        "samples": module.seen_samples,
        "mesh_axes": module.mesh_axes,
        "collectives": module.collectives,
        "sampler": trainer.strategy.distributed_sampler_kwargs,
    }


def test_collectives_sampler_and_mesh(rank_pool_2):
    results = rank_pool_2.run(probe_body)
    for rank, result in enumerate(results):
        assert result["logged"] == 0.5, "sync_dist=True must average over ranks"
        assert result["mesh_axes"] == ("pp", "dp", "sp", "tp")
        assert result["sampler"] == {"num_replicas": 2, "rank": rank}
        assert result["collectives"] == {
            "sum": 3.0,
            "max": 2.0,
            "mean": 1.5,
            "gathered": [1.0, 2.0],
            "broadcast": "from rank 1",
            "untouched": float(rank + 1),  # reduce works on a copy, never on the caller's tensor
        }
    # The ranks read disjoint halves of the data, together all of it.
    first, second = (set(result["samples"]) for result in results)
    assert not first & second
    assert len(first | second) == len(make_dataset())


class ValidatingModule(RegressionModule):
    def validation_step(self, batch: Any, batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.model(inputs), targets), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(), batch_size=4)


def validate_from_checkpoint_body(path: str) -> dict[str, Any]:
    world_size = torch.distributed.get_world_size()
    trained = new_module(with_scheduler=True)
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=world_size, max_epochs=1)
    trainer.fit(trained)
    trainer.save_checkpoint(path)
    seed_everything(MODEL_SEED + 1, verbose=False)  # different initial weights: loading must replace them all
    fresh = ValidatingModule(with_scheduler=True)
    # A fresh Trainer that never fitted: no optimizers exist, only the weights are loaded.
    evaluator = quiet_trainer(strategy=ColossalDDPStrategy(), devices=world_size)
    metrics = evaluator.validate(fresh, ckpt_path=path, verbose=False)
    return {"trained": float_state(trained), "loaded": float_state(fresh), "metrics": metrics}


def test_validate_with_checkpoint_before_any_fit_loads_weights(rank_pool_2, tmp_path):
    results = rank_pool_2.run(validate_from_checkpoint_body, str(tmp_path / "trained.ckpt"))
    for result in results:
        torch.testing.assert_close(result["loaded"], result["trained"], rtol=0, atol=0)
        assert result["metrics"][0]["val_loss"] > 0
