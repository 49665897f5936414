"""User workflows of ``colossal_hybrid`` through Lightning's real ``Trainer`` (issue 12).

- Checkpointing mid-run (the default ``ModelCheckpoint``) leaves training untouched, and the checkpoint resumes:
  tp2 with every valid ZeRO stage on the demo GPT and a tiny Hugging Face Llama, and pp2 without ZeRO. Both the
  uninterrupted run and the resumed run must land on the single-process oracle's weights.
- What the user sees is plain tensors: ``self.log`` values in the trainer's metrics, step outputs, predictions.
- After ``fit``/``validate``/``test``/``predict`` the module keeps its parallel form (docs/hybrid.md, "What you get
  back"), holds no ``DTensor``, and ``strategy.full_model_state_dict()`` gives the whole model's weights.
- A second ``fit`` of the same Trainer under ZeRO replaces the first fit's ZeRO engine and its gradient hooks.
- Everyday Trainer features: anomaly detection, barebones, the profiler, validation intervals, a
  ``LightningDataModule`` with ``overfit_batches``, and ``ModelCheckpoint(monitor=)`` with ``EarlyStopping``.

One epoch is 4 optimizer steps (32 samples, 8 per step at data-parallel size 1).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from tests.distributed import hybrid_bodies as bodies
from tests.distributed.oracle import quiet_trainer

STEPS_PER_EPOCH = 4
BATCH_SIZE = 8


# ---------------------------------------------------------------------------------------------- bodies
def _fit(strategy_kwargs: dict[str, Any], kind: str, directory: str | None, resume_from: str | None) -> dict[str, Any]:
    from lightning_colossal import HybridParallelStrategy

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = bodies.TinyGPTModule(batch_size=BATCH_SIZE, kind=kind)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    # The default checkpoint callback, kept for every epoch: epoch 1's file is saved while training goes on.
    callbacks = [ModelCheckpoint(dirpath=directory, save_top_k=-1)] if directory is not None else []
    trainer = quiet_trainer(
        devices=torch.distributed.get_world_size(),
        strategy=strategy,
        max_epochs=2,
        enable_checkpointing=directory is not None,
        callbacks=callbacks,
    )
    trainer.fit(module, ckpt_path=resume_from)
    return {"weights": bodies.full_weights(module, strategy), "losses": module.step_losses}


def save_continue_resume_body(strategy_kwargs: dict[str, Any], kind: str, directory: str) -> dict[str, Any]:
    """Two epochs checkpointing after each, then a fresh run resumed from the end of epoch 1."""
    uninterrupted = _fit(strategy_kwargs, kind, directory, None)
    resumed = _fit(strategy_kwargs, kind, None, os.path.join(directory, f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"))
    return {"uninterrupted": uninterrupted, "resumed": resumed}


class LoggingModule(bodies.TinyGPTModule):
    """Logs its losses inside the steps (DTensors under tensor parallelism) and records what the hooks receive."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.received: list[str] = []

    def _record(self, hook: str, outputs: Any) -> None:
        values = outputs.values() if isinstance(outputs, dict) else [outputs]
        self.received += [f"{hook}: {type(value).__name__}" for value in values]

    def training_step(self, batch: Any, batch_index: int) -> Any:
        loss = super().training_step(batch, batch_index)
        self.log("train_loss", loss, prog_bar=True)
        self.log_dict({"train_loss_again": loss})
        return {"loss": loss, "detached": loss.detach()}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        super().on_train_batch_end(outputs, batch, batch_index)
        self._record("on_train_batch_end", outputs)
        self.log("train_loss_hook", outputs["loss"])

    def validation_step(self, batch: Any, batch_index: int) -> Any:
        loss = super().validation_step(batch, batch_index)
        self.log("val_step_loss", loss, prog_bar=True)
        return {"loss": loss}

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_index: int, dataloader_index: int = 0) -> None:
        # Pipelines run no validation_step: the outputs are the batch's loss.
        self._record(f"on_{self.trainer.state.stage.value}_batch_end", outputs)
        self.log("val_loss", outputs["loss"] if isinstance(outputs, dict) else outputs)

    def test_step(self, batch: Any, batch_index: int) -> Any:
        return self.validation_step(batch, batch_index)

    def on_test_batch_end(self, outputs: Any, batch: Any, batch_index: int, dataloader_index: int = 0) -> None:
        self.on_validation_batch_end(outputs, batch, batch_index, dataloader_index)


def _metric_types(trainer: Any) -> dict[str, str]:
    return {
        f"{collection} {name}": type(value).__name__
        for collection in ("callback_metrics", "logged_metrics", "progress_bar_metrics")
        for name, value in getattr(trainer, collection).items()
    }


def _dtensors_in_module(module: torch.nn.Module) -> list[str]:
    return [name for name, value in module.state_dict().items() if isinstance(value, DTensor)]


def plain_values_body(strategy_kwargs: dict[str, Any], directory: str, kind: str) -> dict[str, Any]:
    """Fit two steps (validating once), then validate, test and predict; report the types the user saw."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_colossal import HybridParallelStrategy

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = LoggingModule(batch_size=BATCH_SIZE, kind=kind)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(
        devices=torch.distributed.get_world_size(),
        strategy=strategy,
        max_steps=2,
        val_check_interval=2,
        limit_val_batches=1,
        limit_test_batches=1,
        limit_predict_batches=2,
        log_every_n_steps=1,
        logger=CSVLogger(directory),
    )
    loader = DataLoader(bodies.token_dataset(), batch_size=BATCH_SIZE)
    report: dict[str, Any] = {"metric types": {}, "module DTensors": {}}
    trainer.fit(module)
    report["metric types"]["fit"] = _metric_types(trainer)
    report["module DTensors"]["fit"] = _dtensors_in_module(module)
    report["full weights"] = strategy.full_model_state_dict()
    report["validate"] = trainer.validate(module, loader, verbose=False)
    report["metric types"]["validate"] = _metric_types(trainer)
    report["module DTensors"]["validate"] = _dtensors_in_module(module)
    trainer.test(module, loader, verbose=False)
    report["metric types"]["test"] = _metric_types(trainer)
    report["module DTensors"]["test"] = _dtensors_in_module(module)
    predictions = trainer.predict(module, loader)
    report["module DTensors"]["predict"] = _dtensors_in_module(module)
    report["prediction types"] = [type(prediction).__name__ for prediction in predictions]
    report["predictions"] = [prediction.detach().float().cpu() for prediction in predictions]
    report["received"] = module.received
    return report


# ---------------------------------------------------------------------------------------------- tests
def _assert_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], label: str) -> None:
    assert set(got) == set(expected), f"{label}: {sorted(set(got) ^ set(expected))}"
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, atol=1e-4, rtol=1e-4, msg=lambda message, name=name: f"{label} {name}: {message}"
        )


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("gpt", {"tp_size": 2}),
        ("gpt", {"tp_size": 2, "zero_stage": 1}),
        ("gpt", {"tp_size": 2, "zero_stage": 2}),
        ("llama", {"tp_size": 2}),
        ("llama", {"tp_size": 2, "zero_stage": 1}),
        ("llama", {"tp_size": 2, "zero_stage": 2}),
        ("gpt", {"pp_size": 2, "num_microbatches": 2}),
        ("llama", {"pp_size": 2, "num_microbatches": 2}),
    ],
    ids=[
        "gpt-tp2",
        "gpt-tp2-zero1",
        "gpt-tp2-zero2",
        "llama-tp2",
        "llama-tp2-zero1",
        "llama-tp2-zero2",
        "gpt-pp2",
        "llama-pp2",
    ],
)
def test_checkpoint_mid_run_then_continue_and_resume(rank_pool_2, tmp_path, kind, layout):
    if kind == "llama":
        pytest.importorskip("transformers")
    results = rank_pool_2.run(save_continue_resume_body, layout, kind, str(tmp_path), timeout=300)
    reference = bodies.oracle(1, 2 * STEPS_PER_EPOCH, batch_size=BATCH_SIZE, kind=kind)
    for run in ("uninterrupted", "resumed"):
        _assert_weights(bodies.merged_weights([result[run] for result in results]), reference["weights"], run)
    second_epoch = torch.tensor(reference["losses"][STEPS_PER_EPOCH:])
    for result in results:
        torch.testing.assert_close(torch.tensor(result["resumed"]["losses"]), second_epoch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("kind", "layout"),
    [
        ("gpt", {"tp_size": 2}),
        ("gpt", {"tp_size": 2, "sequence_parallel": "split_gather"}),
        ("llama", {"tp_size": 2, "zero_stage": 1}),
        ("gpt", {"pp_size": 2, "num_microbatches": 2}),
    ],
    ids=["gpt-tp2", "gpt-tp2-split-gather", "llama-tp2-zero1", "gpt-pp2"],
)
def test_metrics_outputs_predictions_and_weights_after_fit_are_plain(rank_pool_2, tmp_path, kind, layout):
    """Logged values, step outputs and predictions are plain tensors; after every Trainer call the module holds no
    DTensor, and ``full_model_state_dict`` is the oracle's whole model (which gives the same predictions)."""
    if kind == "llama":
        pytest.importorskip("transformers")
    results = rank_pool_2.run(plain_values_body, layout, str(tmp_path), kind, timeout=300)
    reference = bodies.oracle(1, 2, batch_size=BATCH_SIZE, kind=kind)
    whole_model = bodies.build_model(kind)
    whole_model.load_state_dict({name.removeprefix("model."): value for name, value in reference["weights"].items()})
    inputs, _ = bodies.token_dataset().tensors
    with torch.no_grad():
        expected_predictions = [bodies.logits_of(whole_model, batch) for batch in inputs[: 2 * BATCH_SIZE].split(8)]
    for rank, result in enumerate(results):
        for call, types in result["metric types"].items():
            # (Lightning turns progress-bar values into Python floats.)
            assert types and set(types.values()) <= {"Tensor", "float"}, f"rank {rank} after {call}: {types}"
        assert "callback_metrics val_loss" in result["metric types"]["test"]
        if "pp_size" not in layout:
            assert "progress_bar_metrics train_loss" in result["metric types"]["fit"]
        assert result["received"] and {entry.split(": ")[1] for entry in result["received"]} == {"Tensor"}
        assert result["prediction types"] == ["Tensor", "Tensor"]
        assert not any(result["module DTensors"].values()), result["module DTensors"]
        # Every rank gets the whole model, under the unsplit model's names.
        _assert_weights(result["full weights"], reference["weights"], f"rank {rank} full_model_state_dict")
        for got, expected in zip(result["predictions"], expected_predictions, strict=True):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def _gradient_hook_counts(module: torch.nn.Module) -> list[int]:
    return [len(getattr(parameter, "_post_accumulate_grad_hooks", None) or {}) for parameter in module.parameters()]


def second_fit_body(strategy_name: str) -> dict[str, Any]:
    """Two fits of the tiny GPT with the same Trainer (2 steps, then 2 more), each with a fresh optimizer; the ZeRO
    gradient hooks on the parameters while each fit trains, and after the run."""
    from lightning.pytorch import Callback

    from lightning_colossal import ColossalDDPStrategy, HybridParallelStrategy

    class CountHooks(Callback):
        def __init__(self) -> None:
            self.counts: list[list[int]] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_index: int) -> None:
            self.counts.append(_gradient_hook_counts(module))

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = bodies.TinyGPTModule(num_layers=2)
    strategy: Any = HybridParallelStrategy(zero_stage=1) if strategy_name == "hybrid" else ColossalDDPStrategy()
    counter = CountHooks()
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=2, callbacks=[counter]
    )
    trainer.fit(module)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module)
    assert trainer.global_step == 4
    return {
        "hooks during fits": counter.counts,
        "hooks after": _gradient_hook_counts(module),
        "weights": bodies.full_weights(module, strategy),
    }


def test_second_fit_under_hybrid_zero_replaces_the_first_fits_gradient_hooks(rank_pool_2):
    """A second ``fit`` of the same Trainer gives ZeRO a new optimizer: the first fit's ZeRO engine must not keep
    reducing every gradient from its hooks (each parameter has one ZeRO hook while a fit trains, none after it), and
    the two fits train as ``colossal_ddp`` does."""
    reference = rank_pool_2.run(second_fit_body, "ddp", timeout=300)[0]["weights"]
    for result in rank_pool_2.run(second_fit_body, "hybrid", timeout=300):
        assert result["hooks during fits"] and all(set(counts) == {1} for counts in result["hooks during fits"]), (
            result["hooks during fits"]
        )
        assert set(result["hooks after"]) == {0}
        _assert_weights(result["weights"], reference, "hybrid zero1 after two fits")


# --------------------------------------------------------------------------------------------- the Trainer's features
def trainer_feature_body(strategy_kwargs: dict[str, Any], feature: str) -> dict[str, Any]:
    """Fit the tiny GPT three steps with one everyday Trainer feature on; whole weights, or the error's message."""
    from lightning.pytorch.profilers import SimpleProfiler

    from lightning_colossal import HybridParallelStrategy

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = bodies.TinyGPTModule()
    settings = {
        "detect_anomaly": {"detect_anomaly": True},
        "barebones": {"barebones": True},
        "profiler": {"profiler": SimpleProfiler()},
        "validation": {"val_check_interval": 2, "limit_val_batches": 2, "num_sanity_val_steps": 2},
    }[feature]
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=3, **settings)
    try:
        trainer.fit(module)
    except RuntimeError as error:
        return {"error": str(error), "steps_run": len(module.step_losses)}
    return {"weights": bodies.full_weights(module, strategy), "steps": trainer.global_step}


FEATURE_ROWS = [
    pytest.param({"pp_size": 2, "num_microbatches": 2}, "detect_anomaly", id="pp2-detect_anomaly"),
    pytest.param({"tp_size": 2}, "barebones", id="tp2-barebones"),
    pytest.param({"tp_size": 2, "sequence_parallel": "split_gather"}, "profiler", id="tp2_sp-profiler"),
    pytest.param({"pp_size": 2, "num_microbatches": 2}, "validation", id="pp2-validation"),
]


@pytest.mark.parametrize(("strategy_kwargs", "feature"), FEATURE_ROWS)
def test_everyday_trainer_features_train_like_single_process(rank_pool_2, strategy_kwargs, feature):
    expected = bodies.oracle(1, 3)["weights"]
    results = rank_pool_2.run(trainer_feature_body, strategy_kwargs, feature, timeout=120)
    assert all(result.get("steps") == 3 for result in results), [result.get("error") for result in results]
    got = bodies.merged_weights(results)
    for name, value in expected.items():
        torch.testing.assert_close(
            got[name], value, atol=1e-4, rtol=1e-4, msg=lambda text, name=name: f"{name}: {text}"
        )


def test_anomaly_detection_on_tensor_parallel_pieces_is_refused_with_the_fix(rank_pool_2):
    # torch's anomaly mode checks each gradient with aten._is_any_true, which DTensor has no rule for.
    for result in rank_pool_2.run(trainer_feature_body, {"tp_size": 2}, "detect_anomaly", timeout=120):
        assert result["steps_run"] == 0, result
        assert "detect_anomaly=True) cannot run under tensor parallelism" in result["error"]
        assert "tp_size=1" in result["error"] and "on_nonfinite='raise'" in result["error"]


# ------------------------------------------------------------------------------ data and checkpoint-selection features
def data_and_selection_body(strategy_kwargs: dict[str, Any], feature: str, directory: str) -> dict[str, Any]:
    """Fit the tiny GPT from a ``LightningDataModule`` with ``overfit_batches``, or with ``ModelCheckpoint(monitor=)``,
    ``EarlyStopping`` and ``limit_train_batches``; records each training batch and every synced validation loss."""
    from lightning.pytorch import Callback, LightningDataModule
    from lightning.pytorch.callbacks import EarlyStopping

    from lightning_colossal import HybridParallelStrategy

    class TokenData(LightningDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(bodies.token_dataset(), batch_size=4)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(bodies.token_dataset(), batch_size=4)

    class Record(Callback):
        def __init__(self) -> None:
            self.batches: list[tuple[int, float]] = []
            self.validation_losses: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_index: int) -> None:
            self.batches.append((trainer.current_epoch, float(batch[0].float().sum())))

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            self.validation_losses.append(float(trainer.callback_metrics["val_loss"]))

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = bodies.TinyGPTModule()
    record = Record()
    checkpoint = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=2, filename="{step}")
    settings: dict[str, Any] = {
        "overfit": {"overfit_batches": 2, "max_epochs": 2},
        "selection": {
            "max_epochs": 1,
            "limit_train_batches": 6,
            "val_check_interval": 2,
            "limit_val_batches": 2,
            "enable_checkpointing": True,
            "callbacks": [record, checkpoint, EarlyStopping(monitor="val_loss", patience=100)],
        },
    }[feature]
    settings.setdefault("callbacks", [record])
    trainer = quiet_trainer(strategy=HybridParallelStrategy(**strategy_kwargs), devices=2, **settings)
    trainer.fit(module, datamodule=TokenData())
    # Only rank 0 deletes replaced checkpoints (file, then shards), with no barrier after: list once it is done.
    trainer.strategy.barrier()
    return {
        "steps": trainer.global_step,
        "losses": module.step_losses,
        "batches": record.batches,
        "validation_losses": record.validation_losses,
        "best": sorted((float(score), os.path.basename(path)) for path, score in checkpoint.best_k_models.items()),
        "files": sorted(os.listdir(directory)) if os.path.isdir(directory) else [],
    }


def test_overfit_batches_from_a_datamodule_repeats_the_first_batches_on_every_tensor_parallel_rank(
    rank_pool_2, tmp_path
):
    results = rank_pool_2.run(data_and_selection_body, {"tp_size": 2}, "overfit", str(tmp_path), timeout=120)
    inputs, targets = bodies.token_dataset().tensors
    seed_everything(bodies.MODEL_SEED, verbose=False)
    model = bodies.build_model("gpt")
    with torch.no_grad():
        first_loss = float(bodies.language_model_loss(bodies.logits_of(model, inputs[:4]), targets[:4]))
    first_two = [float(inputs[:4].float().sum()), float(inputs[4:8].float().sum())]
    for result in results:
        assert result["steps"] == 4
        # overfit_batches turns the shuffled sampler sequential: batches 0 and 1, again in the second epoch.
        assert result["batches"] == [(0, first_two[0]), (0, first_two[1]), (1, first_two[0]), (1, first_two[1])]
        assert result["losses"][0] == pytest.approx(first_loss, rel=1e-5)
        assert result["losses"] == results[0]["losses"]


def test_model_checkpoint_keeps_the_best_and_early_stopping_runs_under_a_pipeline(rank_pool_2, tmp_path):
    expected = bodies.oracle(1, 6)
    results = rank_pool_2.run(
        data_and_selection_body, {"pp_size": 2, "num_microbatches": 2}, "selection", str(tmp_path), timeout=120
    )
    for result in results:
        assert result["steps"] == 6  # limit_train_batches=6, one epoch
        assert result["losses"] == pytest.approx(expected["losses"], rel=1e-5)
        assert len(result["validation_losses"]) == 3 and result["validation_losses"] == results[0]["validation_losses"]
        best_two = sorted(result["validation_losses"])[:2]
        assert [score for score, _ in result["best"]] == pytest.approx(best_two, rel=1e-6)
        assert {name for _, name in result["best"]} <= set(result["files"])
        assert all(
            any(name.startswith(kept.removesuffix(".ckpt")) for _, kept in result["best"]) for name in result["files"]
        ), result["files"]
