"""Everyday Lightning Trainer features under every lightning_colossal strategy (issue 12).

One row per (feature group, strategy). To stay fast (the whole matrix runs on 2 ranks and 2 cores) several features
share one ``fit`` of the oracle's tiny model, and each is checked by something that fails when the feature is ignored:

- ``training_loop``: ``LightningDataModule``, ``limit_train_batches``, ``accumulate_grad_batches``,
  ``gradient_clip_val``, ``detect_anomaly``, ``profiler="simple"`` and ``self.log(on_epoch=True, sync_dist=True)``;
  the weights must equal the single-process oracle trained on the same micro-batches with the same clipping.
- ``validation``: ``num_sanity_val_steps``, ``limit_val_batches``, ``val_check_interval`` and a synced epoch metric.
- ``model_checkpoint``: ``ModelCheckpoint(save_top_k=2, monitor="val_loss")`` keeps the two best of three.
- ``overfit_batches``: every epoch trains on the same two batches.
- ``barebones``: ``Trainer(barebones=True)`` trains like the oracle.
- ``predict``: ``trainer.predict`` returns one plain tensor per batch, equal to the model's outputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningDataModule, Trainer, seed_everything
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.profilers import SimpleProfiler
from torch import nn
from torch.utils.data import DataLoader

from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec, build_strategy
from tests.distributed.oracle import (
    MODEL_SEED,
    RegressionModule,
    float_state,
    make_dataset,
    oracle_train,
    quiet_trainer,
)

WORLD_SIZE = 2
BATCH_SIZE = 4
CLIP_NORM = 0.05
FP32 = {"rtol": 1e-5, "atol": 1e-6}
STRATEGIES = {"ddp": DDP, "zero1": ZERO1, "zero2": ZERO2, "gemini": GEMINI, "fsdp": FSDP}
GROUPS = ["training_loop", "validation", "model_checkpoint", "overfit_batches", "barebones", "predict"]


class FeatureModule(RegressionModule):
    """The oracle's module with epoch-level synced logging, validation and prediction, recording what ran."""

    def __init__(self) -> None:
        super().__init__(batch_size=BATCH_SIZE)
        self.anomaly_detection_seen: list[bool] = []
        self.train_batch_sums: list[list[float]] = []  # per epoch: the sum of each training batch's inputs
        self.sanity_validation_batches = 0
        self.validation_batches = 0

    def training_step(self, batch: Sequence[torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.model(inputs), targets)
        self.micro_batch_losses.append(loss.detach().item())
        self.anomaly_detection_seen.append(torch.is_anomaly_enabled())
        if batch_index == 0:
            self.train_batch_sums.append([])
        self.train_batch_sums[-1].append(inputs.sum().item())
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Sequence[torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        if self.trainer.sanity_checking:
            self.sanity_validation_batches += 1
        else:
            self.validation_batches += 1
        loss = nn.functional.mse_loss(self.model(inputs), targets)
        self.log("val_loss", loss, on_epoch=True, sync_dist=True)
        return loss

    def predict_step(self, batch: Sequence[torch.Tensor], batch_index: int) -> torch.Tensor:
        return self.model(batch[0])

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(32), batch_size=BATCH_SIZE)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(16), batch_size=BATCH_SIZE)


def new_feature_module() -> FeatureModule:
    seed_everything(MODEL_SEED, verbose=False)  # the oracle's initial weights and sampler seed
    return FeatureModule()


class RegressionDataModule(LightningDataModule):
    """The oracle's training data through a DataModule; counts the hooks Lightning called."""

    def __init__(self) -> None:
        super().__init__()
        self.setup_stages: list[str] = []
        self.train_dataloader_calls = 0

    def setup(self, stage: str) -> None:
        self.setup_stages.append(stage)

    def train_dataloader(self) -> DataLoader:
        self.train_dataloader_calls += 1
        return DataLoader(make_dataset(), batch_size=BATCH_SIZE)


class Recorder(Callback):
    """What is only visible while the run is set up: synced validation metrics and the profiler's records."""

    def __init__(self) -> None:
        self.validation_losses: list[float] = []
        self.profiled_actions: list[str] = []

    def on_validation_end(self, trainer: Trainer, pl_module: Any) -> None:
        if not trainer.sanity_checking:
            self.validation_losses.append(float(trainer.callback_metrics["val_loss"]))

    def on_train_end(self, trainer: Trainer, pl_module: Any) -> None:
        if isinstance(trainer.profiler, SimpleProfiler):
            self.profiled_actions = sorted(trainer.profiler.recorded_durations)


def feature_body(group: str, spec: StrategySpec, directory: str) -> dict[str, Any]:
    module = new_feature_module()
    recorder = Recorder()
    common: dict[str, Any] = {"strategy": build_strategy(spec), "devices": torch.distributed.get_world_size()}
    result: dict[str, Any] = {}
    if group == "training_loop":
        datamodule = RegressionDataModule()
        trainer = quiet_trainer(
            **common,
            max_epochs=1,
            limit_train_batches=6,
            limit_val_batches=0,
            accumulate_grad_batches=2,
            gradient_clip_val=CLIP_NORM,
            detect_anomaly=True,
            profiler="simple",
            callbacks=[recorder],
        )
        trainer.fit(module, datamodule=datamodule)
        result["datamodule"] = {"setup": datamodule.setup_stages, "loaders": datamodule.train_dataloader_calls}
        result["logged_train_loss"] = float(trainer.callback_metrics["train_loss"])
        result["profiled_actions"] = recorder.profiled_actions
    elif group in ("validation", "model_checkpoint"):
        callbacks: list[Callback] = [recorder]
        checkpoint = None
        if group == "model_checkpoint":
            checkpoint = ModelCheckpoint(
                dirpath=directory, filename="{step}-{val_loss:.6f}", save_top_k=2, monitor="val_loss"
            )
            callbacks.append(checkpoint)
        trainer = quiet_trainer(
            **common,
            max_epochs=1,
            limit_train_batches=6,
            limit_val_batches=2,
            num_sanity_val_steps=2,
            val_check_interval=2,
            enable_checkpointing=checkpoint is not None,
            callbacks=callbacks,
        )
        trainer.fit(module)
        if checkpoint is not None:
            result["best_scores"] = sorted(float(score) for score in checkpoint.best_k_models.values())
            result["kept"] = sorted(Path(path).name for path in checkpoint.best_k_models)
            result["saved"] = sorted(path.name for path in Path(directory).iterdir())
    elif group == "overfit_batches":
        trainer = quiet_trainer(**common, max_epochs=2, overfit_batches=2)
        trainer.fit(module)
    elif group == "barebones":
        trainer = Trainer(accelerator="cpu", barebones=True, max_steps=3, limit_val_batches=0, **common)
        trainer.fit(module)
    elif group == "predict":
        trainer = quiet_trainer(**common)
        predictions = trainer.predict(module)
        result["prediction_types"] = [type(prediction).__name__ for prediction in predictions or []]
        result["predictions"] = [prediction.detach().cpu() for prediction in predictions or []]
    else:
        raise ValueError(f"unknown feature group {group!r}")
    result.update(
        {
            "global_step": trainer.global_step,
            "losses": module.micro_batch_losses,
            "anomaly_detection_seen": module.anomaly_detection_seen,
            "train_batch_sums": module.train_batch_sums,
            "sanity_validation_batches": module.sanity_validation_batches,
            "validation_batches": module.validation_batches,
            "validation_losses": recorder.validation_losses,
            "parameters": float_state(module),
        }
    )
    return result


def _check_training_loop(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["global_step"] == 3, "6 micro-batches accumulated 2 at a time are 3 optimizer steps"
        assert result["datamodule"] == {"setup": ["fit"], "loaders": 1}, result["datamodule"]
        assert result["anomaly_detection_seen"] == [True] * 6
        assert any("training_step" in action for action in result["profiled_actions"]), result["profiled_actions"]
    # The synced epoch mean of every rank's micro-batch losses, on every rank.
    all_losses = [loss for result in results for loss in result["losses"]]
    for result in results:
        assert result["logged_train_loss"] == pytest.approx(sum(all_losses) / len(all_losses), rel=1e-5)
    oracle = oracle_train(world_size=WORLD_SIZE, steps=3, accumulate=2, clip_norm=CLIP_NORM)
    unclipped = oracle_train(world_size=WORLD_SIZE, steps=3, accumulate=2)
    assert max((oracle.parameters[n] - unclipped.parameters[n]).abs().max().item() for n in unclipped.parameters) > 1e-3
    for result in results:
        torch.testing.assert_close(result["parameters"], oracle.parameters, **FP32)


def _check_validation(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["global_step"] == 6
        assert result["sanity_validation_batches"] == 2
        # val_check_interval=2 over 6 batches: 3 validation runs of limit_val_batches=2 batches each.
        assert result["validation_batches"] == 6
        assert len(result["validation_losses"]) == 3
        assert result["validation_losses"] == results[0]["validation_losses"], "sync_dist gives every rank one value"


def _check_model_checkpoint(results: list[dict[str, Any]]) -> None:
    _check_validation(results)
    for result in results:
        best_two = sorted(result["validation_losses"])[:2]
        assert result["best_scores"] == pytest.approx(best_two, rel=1e-6), (result["best_scores"], best_two)
        # The third (worst) checkpoint was deleted: every file left belongs to one of the two kept (a checkpoint may
        # be one file or a file with a shard folder beside it).
        assert len(result["kept"]) == 2 and set(result["kept"]) <= set(result["saved"]), result
        assert all(any(name.startswith(kept) for kept in result["kept"]) for name in result["saved"]), result["saved"]


def _check_overfit_batches(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["global_step"] == 4
        first, second = result["train_batch_sums"]
        assert len(first) == 2 and first == second, result["train_batch_sums"]
    assert results[0]["train_batch_sums"] != results[1]["train_batch_sums"], "each rank overfits its own batches"


def _check_barebones(results: list[dict[str, Any]]) -> None:
    oracle = oracle_train(world_size=WORLD_SIZE, steps=3)
    for result in results:
        assert result["global_step"] == 3
        torch.testing.assert_close(result["parameters"], oracle.parameters, **FP32)


def _check_predict(results: list[dict[str, Any]]) -> None:
    inputs, _ = make_dataset(16).tensors
    with torch.no_grad():
        expected = new_feature_module().model(inputs)
    for rank, result in enumerate(results):
        assert result["prediction_types"] == ["Tensor", "Tensor"], result["prediction_types"]
        # The DistributedSampler (no shuffling for predict) gives rank r the samples r, r + 2, r + 4, ...
        torch.testing.assert_close(torch.cat(result["predictions"]), expected[rank::WORLD_SIZE], **FP32)


CHECKS = {
    "training_loop": _check_training_loop,
    "validation": _check_validation,
    "model_checkpoint": _check_model_checkpoint,
    "overfit_batches": _check_overfit_batches,
    "barebones": _check_barebones,
    "predict": _check_predict,
}


@pytest.mark.parametrize("name", sorted(STRATEGIES))
@pytest.mark.parametrize("group", GROUPS)
def test_lightning_feature(rank_pool_2, tmp_path, group, name):
    results = rank_pool_2.run(feature_body, group, STRATEGIES[name], str(tmp_path), timeout=90)
    CHECKS[group](results)
