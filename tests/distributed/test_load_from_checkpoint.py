"""`LightningModule.load_from_checkpoint` on the checkpoints every strategy writes, the way users load a trained
model: the user's unchanged class, in the plain pytest process (no process group, no strategy), from the path
`ModelCheckpoint` hands back. The weights must equal the trained ones and the consolidate command's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_colossal.checkpoint import consolidate, locate_checkpoint
from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec, build_strategy
from tests.distributed.oracle import RegressionModule, float_state, new_module, quiet_trainer


def fit_with_model_checkpoint_body(spec: StrategySpec, directory: str) -> dict[str, Any]:
    module = new_module(dropout=0.0)
    # Every epoch kept, so an earlier checkpoint (epoch 0) and last.ckpt (the trained weights) are both there.
    callback = ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=-1)
    trainer = quiet_trainer(
        strategy=build_strategy(spec),
        devices=torch.distributed.get_world_size(),
        max_epochs=2,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    trainer.fit(module)
    first = str(Path(directory) / "epoch=0-step=8.ckpt")
    return {"best": first, "last": callback.last_model_path, "weights": float_state(module)}


def hybrid_fit_with_model_checkpoint_body(strategy_kwargs: dict[str, Any], directory: str) -> dict[str, Any]:
    from lightning.pytorch import seed_everything

    from lightning_colossal import HybridParallelStrategy
    from tests.distributed.hybrid_bodies import MODEL_SEED, TinyGPTModule, full_weights

    seed_everything(MODEL_SEED, verbose=False)
    module = TinyGPTModule()
    strategy = HybridParallelStrategy(**strategy_kwargs)
    callback = ModelCheckpoint(dirpath=directory, save_last=True)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=torch.distributed.get_world_size(),
        max_steps=3,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    trainer.fit(module)
    return {
        "best": callback.best_model_path,
        "last": callback.last_model_path,
        "weights": full_weights(module, strategy),
    }


def _check_loaded(module: torch.nn.Module, trained: dict[str, torch.Tensor], path: str, tmp_path: Path) -> None:
    assert not torch.distributed.is_initialized(), "the test must load in a plain process"
    loaded = {name: tensor.detach().float() for name, tensor in module.state_dict().items()}
    assert set(loaded) == set(trained)
    for name, expected in trained.items():
        torch.testing.assert_close(
            loaded[name], expected, rtol=0, atol=0, msg=lambda message, name=name: f"{name}: {message}"
        )
    consolidated = torch.load(consolidate(path, tmp_path / "weights.pt", weights_only=True), weights_only=True)
    for name, tensor in consolidated.items():
        torch.testing.assert_close(loaded[name], tensor.float(), rtol=0, atol=0)


@pytest.mark.parametrize(
    "spec", [DDP, ZERO1, ZERO2, FSDP, GEMINI], ids=lambda spec: f"{spec[0]}{spec[1].get('stage', '')}"
)
def test_load_from_checkpoint_in_a_plain_process(rank_pool_2, tmp_path, spec):
    results = rank_pool_2.run(fit_with_model_checkpoint_body, spec, str(tmp_path))
    best, last, trained = results[0]["best"], results[0]["last"], results[0]["weights"]
    assert Path(best).is_file() and Path(last).is_file()
    assert best != last, "the top-k checkpoint and last.ckpt are different files"
    module = RegressionModule.load_from_checkpoint(last)
    assert isinstance(module, RegressionModule)
    _check_loaded(module, trained, last, tmp_path)
    # An earlier checkpoint loads too, with weights_only=True asked for explicitly: plain tensors and entries only.
    earlier = RegressionModule.load_from_checkpoint(best, weights_only=True)
    assert not torch.equal(earlier.state_dict()["model.input.weight"], module.state_dict()["model.input.weight"])


@pytest.mark.parametrize(
    "strategy_kwargs",
    [{"tp_size": 2, "zero_stage": 1}, {"pp_size": 2, "num_microbatches": 2}],
    ids=["tp2_zero1", "pp2"],
)
def test_load_from_checkpoint_after_hybrid(rank_pool_2, tmp_path, strategy_kwargs):
    from tests.distributed.hybrid_bodies import TinyGPTModule, merged_weights

    results = rank_pool_2.run(hybrid_fit_with_model_checkpoint_body, strategy_kwargs, str(tmp_path))
    last, trained = results[0]["last"], merged_weights(results)  # pipeline stages: each rank holds its own layers
    module = TinyGPTModule.load_from_checkpoint(last)
    _check_loaded(module, trained, last, tmp_path)


def test_file_copied_without_shards_loads_weights_and_refuses_to_resume(rank_pool_2, tmp_path):
    import shutil

    results = rank_pool_2.run(fit_with_model_checkpoint_body, DDP, str(tmp_path / "run"))
    copied = tmp_path / "copied.ckpt"
    shutil.copyfile(results[0]["last"], copied)
    assert not locate_checkpoint(copied).has_shards
    module = RegressionModule.load_from_checkpoint(copied)
    for name, expected in results[0]["weights"].items():
        torch.testing.assert_close(module.state_dict()[name].float(), expected, rtol=0, atol=0)
    messages = rank_pool_2.run(resume_without_shards_body, str(copied))
    assert all("sharded training state" in message and "Copy that directory" in message for message in messages)


def resume_without_shards_body(path: str) -> str:
    module = new_module()
    trainer = quiet_trainer(strategy=build_strategy(DDP), devices=torch.distributed.get_world_size(), max_epochs=3)
    try:
        trainer.fit(module, ckpt_path=path)
    except FileNotFoundError as error:
        return str(error)
    return "resumed"
