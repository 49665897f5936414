"""Portable checkpoints through Lightning: save, resume at the same and another world size, plain files, crashes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_colossal import ColossalDDPStrategy, ColossalPrecision, LossScalerConfig
from lightning_colossal.checkpoint import consolidate
from lightning_colossal.checkpoint.layout import leftovers_of_interrupted_save
from lightning_colossal.checkpoint.sharded import shard_directory
from tests.distributed.oracle import float_state, new_module, quiet_trainer

STEPS_PER_EPOCH_AT_2_RANKS = 8  # 64 samples / (2 ranks * batch 4)


class PerRankRandomState(Callback):
    """Gives each rank its own random state as training starts (Lightning seeds every rank alike before that)."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        torch.manual_seed(1000 + trainer.global_rank)


def _fit(
    epochs: int,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    strategy: Any = None,
    batch_size: int = 4,
    dropout: float = 0.1,
    callbacks: list[Any] | None = None,
    plugins: list[Any] | None = None,
    per_rank_random_state: bool = False,
) -> dict[str, torch.Tensor]:
    world_size = torch.distributed.get_world_size()
    module = new_module(batch_size=batch_size, dropout=dropout, with_scheduler=True)
    if per_rank_random_state and ckpt_path is None:
        callbacks = [*(callbacks or []), PerRankRandomState()]  # a resumed run gets the states from the checkpoint
    trainer = quiet_trainer(
        strategy=strategy if strategy is not None else ColossalDDPStrategy(),
        devices=world_size,
        max_epochs=epochs,
        callbacks=callbacks,
        enable_checkpointing=any(isinstance(callback, ModelCheckpoint) for callback in callbacks or []),
        plugins=plugins,
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return float_state(module)


def uninterrupted_body(dropout: float, per_rank_random_state: bool = False) -> dict[str, torch.Tensor]:
    return _fit(epochs=2, dropout=dropout, per_rank_random_state=per_rank_random_state)


def save_after_one_epoch_body(
    path: str, strategy_name: str = "colossal_ddp", dropout: float = 0.1, per_rank_random_state: bool = False
) -> dict[str, torch.Tensor]:
    strategy = ColossalDDPStrategy() if strategy_name == "colossal_ddp" else strategy_name
    return _fit(epochs=1, save_to=path, strategy=strategy, dropout=dropout, per_rank_random_state=per_rank_random_state)


def resume_body(
    path: str, batch_size: int = 4, dropout: float = 0.1, per_rank_random_state: bool = False
) -> dict[str, torch.Tensor]:
    return _fit(
        epochs=2,
        ckpt_path=path,
        batch_size=batch_size,
        dropout=dropout,
        per_rank_random_state=per_rank_random_state,
    )


def test_resume_at_same_world_size_continues_identically(rank_pool_2, tmp_path):
    reference = rank_pool_2.run(uninterrupted_body, 0.1)
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, path)
    assert Path(path).is_file(), "load_from_checkpoint needs a file"
    assert len(list(shard_directory(path).glob("*.distcp"))) == 2, "each rank writes its own piece"
    resumed = rank_pool_2.run(resume_body, path)
    for rank in range(2):
        # Same processes, same order of operations, RNG (dropout), sampler epoch and LR schedule restored: exact.
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=0, atol=0)


def test_resume_restores_each_rank_its_own_random_state(rank_pool_2, tmp_path):
    # Under seed_everything all ranks share one random state, so restoring rank 0's state on every rank would pass the
    # test above: here the ranks' states differ (their dropout masks too), and each must get its own back.
    reference = rank_pool_2.run(uninterrupted_body, 0.1, True)
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, path, "colossal_ddp", 0.1, True)
    resumed = rank_pool_2.run(resume_body, path, 4, 0.1, True)
    shared = rank_pool_2.run(uninterrupted_body, 0.1, False)
    assert max((shared[0][name] - reference[0][name]).abs().max().item() for name in shared[0]) > 1e-3, (
        "per-rank random states must change the training, or this test proves nothing"
    )
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=0, atol=0)


def test_resume_at_one_rank_continues_the_same_training(rank_pool_2, rank_pool_1, tmp_path):
    reference = rank_pool_2.run(uninterrupted_body, 0.0)[0]
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, path, "colossal_ddp", 0.0)
    # One rank with twice the per-rank batch sees the same global batches (same shuffled order, same sets).
    resumed = rank_pool_1.run(resume_body, path, 8, 0.0)[0]
    torch.testing.assert_close(resumed, reference, rtol=1e-5, atol=1e-6)
    moved = max((resumed[name] - reference[name]).abs().max().item() for name in reference)
    assert moved < 1e-5


def model_checkpoint_body(directory: str, strategy_name: str = "colossal_ddp") -> list[str]:
    callback = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=3, save_top_k=-1)
    strategy = ColossalDDPStrategy() if strategy_name == "colossal_ddp" else strategy_name
    _fit(epochs=1, callbacks=[callback], strategy=strategy, dropout=0.0)
    return sorted(path.name for path in Path(directory).iterdir())


def resume_with_body(path: str, strategy_name: str) -> dict[str, torch.Tensor]:
    strategy = ColossalDDPStrategy() if strategy_name == "colossal_ddp" else strategy_name
    return _fit(epochs=2, ckpt_path=path, strategy=strategy, dropout=0.0)


def test_model_checkpoint_callback_writes_sharded_directories(rank_pool_2, tmp_path):
    names = rank_pool_2.run(model_checkpoint_body, str(tmp_path))[0]
    checkpoints = ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    assert names == sorted(checkpoints + [f"{name}.shards" for name in checkpoints])
    # Resuming from a mid-epoch checkpoint follows Lightning's rules for the rest of the epoch (it restarts the
    # epoch's data): Lightning's own ddp, resumed from its own mid-epoch checkpoint, is the reference (dropout off:
    # plain files carry no per-rank random state).
    rank_pool_2.run(model_checkpoint_body, str(tmp_path / "lightning"), "ddp")
    reference = rank_pool_2.run(resume_with_body, str(tmp_path / "lightning" / "last.ckpt"), "ddp")
    resumed = rank_pool_2.run(resume_with_body, str(tmp_path / "last.ckpt"), "colossal_ddp")
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=1e-6, atol=1e-7)


def test_plain_lightning_checkpoint_loads_into_colossal_ddp(rank_pool_2, tmp_path):
    # The RNG state is per-process and not in plain files, so the values are compared with dropout off.
    reference = rank_pool_2.run(uninterrupted_body, 0.0)
    plain = str(tmp_path / "plain.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, plain, "ddp", 0.0)
    assert Path(plain).is_file(), "Lightning's own ddp writes one file"
    resumed = rank_pool_2.run(resume_body, plain, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=1e-6, atol=1e-7)


def test_consolidated_files_hold_the_weights_and_resume(rank_pool_2, tmp_path):
    from safetensors.torch import load_file

    sharded = str(tmp_path / "epoch1.ckpt")
    saved = rank_pool_2.run(save_after_one_epoch_body, sharded, "colossal_ddp", 0.0)[0]
    weights = load_file(str(consolidate(sharded, tmp_path / "model.safetensors")))
    torch.testing.assert_close(weights, saved, rtol=0, atol=0)
    stripped = torch.load(
        consolidate(sharded, tmp_path / "inner.pt", weights_only=True, strip_prefix="model."), weights_only=True
    )
    assert set(stripped) == {name.removeprefix("model.") for name in saved}
    full = consolidate(sharded, tmp_path / "full.ckpt")
    reference = rank_pool_2.run(uninterrupted_body, 0.0)
    resumed = rank_pool_2.run(resume_body, str(full), 4, 0.0)
    torch.testing.assert_close(resumed[0], reference[0], rtol=1e-6, atol=1e-7)


def crash_mid_save_body(path: str) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    world_size = torch.distributed.get_world_size()
    module = new_module(with_scheduler=True)
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=world_size, max_epochs=1)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    before = float_state(module)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(1.0)
    original_write = FileSystemWriter.write_data

    def dying_write(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
        if torch.distributed.get_rank() == 1:
            raise OSError("simulated crash while writing")
        return original_write(self, plan, planner)

    FileSystemWriter.write_data = dying_write  # type: ignore[method-assign]
    try:
        trainer.save_checkpoint(path)
        raised = None
    except Exception as error:  # DCP reports the failing rank's error on every rank
        raised = type(error).__name__
    finally:
        FileSystemWriter.write_data = original_write  # type: ignore[method-assign]
    torch.distributed.barrier()
    leftovers = [leftover.name for leftover in leftovers_of_interrupted_save(path)]
    fresh = new_module(with_scheduler=True)
    validator = quiet_trainer(strategy=ColossalDDPStrategy(), devices=world_size, max_epochs=1)
    validator.fit(fresh, ckpt_path=path)  # max_epochs reached: loads, trains no further
    return {"raised": raised, "leftovers": leftovers, "before": before, "loaded": float_state(fresh)}


def test_crash_during_save_keeps_previous_checkpoint(rank_pool_2, tmp_path):
    results = rank_pool_2.run(crash_mid_save_body, str(tmp_path / "last.ckpt"))
    for result in results:
        assert result["raised"] is not None, "the failed save must raise, not pretend to succeed"
        assert result["leftovers"] == []
        torch.testing.assert_close(result["loaded"], result["before"], rtol=0, atol=0)


def loss_scaler_state_body(path: str, resume: bool) -> dict[str, Any]:
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=4096.0, hysteresis=1))
    module = new_module(overflow_at_step=None if resume else 2)
    trainer = quiet_trainer(
        strategy=ColossalDDPStrategy(), devices=torch.distributed.get_world_size(), max_epochs=1, plugins=[plugin]
    )
    trainer.fit(module, ckpt_path=path if resume else None)
    if not resume:
        trainer.save_checkpoint(path)
    assert plugin.loss_scaler is not None
    return plugin.loss_scaler.state_dict()


def test_loss_scaler_state_is_saved_and_restored(rank_pool_2, tmp_path):
    path = str(tmp_path / "fp16.ckpt")
    saved = rank_pool_2.run(loss_scaler_state_body, path, False)[0]
    assert saved["scale"] == 2048.0 and saved["skipped_steps"] == 1
    restored = rank_pool_2.run(loss_scaler_state_body, path, True)[0]
    assert restored == saved  # max_epochs already reached: nothing trained after loading


def wrong_inputs_body(kind: str, path: str) -> str:
    world_size = torch.distributed.get_world_size()
    module = new_module()
    devices = 1 if kind == "devices" else world_size
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=devices, max_epochs=1)
    try:
        trainer.fit(module, ckpt_path=path if kind != "devices" else None)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("devices", "number of processes"),
        ("parent_directory", "not a lightning_colossal checkpoint"),
        ("missing", "No checkpoint at"),
        ("not_lightning", "not a Lightning checkpoint"),
    ],
)
def test_bad_inputs_fail_with_the_fix(rank_pool_2, tmp_path, kind, expected):
    path = {"parent_directory": tmp_path, "missing": tmp_path / "nope.ckpt", "devices": tmp_path}.get(kind, tmp_path)
    if kind == "not_lightning":
        path = tmp_path / "weights.pt"
        torch.save({"weight": torch.ones(1)}, path)
    messages = rank_pool_2.run(wrong_inputs_body, kind, str(path))
    for message in messages:
        assert expected in message, message


def strict_loading_body(path: str, strict: bool) -> str:
    module = new_module()
    module.model.extra = torch.nn.Linear(2, 2)  # a parameter the checkpoint does not have
    module.strict_loading = strict
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=torch.distributed.get_world_size(), max_epochs=1)
    try:
        trainer.fit(module, ckpt_path=path)
    except RuntimeError as error:
        return str(error)
    return "loaded"


def test_strict_loading_reports_keys_and_can_be_relaxed(rank_pool_2, tmp_path):
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, path)
    strict_messages = rank_pool_2.run(strict_loading_body, path, True)
    assert "model.extra.weight" in strict_messages[0] and "strict_loading = False" in strict_messages[0]
    assert rank_pool_2.run(strict_loading_body, path, False) == ["loaded", "loaded"]


def test_resume_at_more_ranks_than_saved(rank_pool_1, rank_pool_2, tmp_path):
    reference = rank_pool_2.run(uninterrupted_body, 0.0)[0]
    path = str(tmp_path / "one_rank.ckpt")
    # One rank with batch 8 trains on the same global batches as two ranks with batch 4.
    rank_pool_1.run(_fit_and_save_body, path, 8)
    resumed = rank_pool_2.run(resume_body, path, 4, 0.0)
    torch.testing.assert_close(resumed[0], reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(resumed[1], resumed[0], rtol=0, atol=0)


def _fit_and_save_body(path: str, batch_size: int) -> dict[str, torch.Tensor]:
    return _fit(epochs=1, save_to=path, batch_size=batch_size, dropout=0.0)


def keep_latest_body(directory: str) -> list[str]:
    callback = ModelCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=3, save_top_k=1)
    _fit(epochs=1, callbacks=[callback])
    return sorted(path.name for path in Path(directory).iterdir())


def test_model_checkpoint_removes_superseded_checkpoint_directories(rank_pool_2, tmp_path):
    assert rank_pool_2.run(keep_latest_body, str(tmp_path))[0] == [
        "epoch=0-step=6.ckpt",
        "epoch=0-step=6.ckpt.shards",
        "last.ckpt",
        "last.ckpt.shards",
    ]


def gpt_body(directory: str, resume_from: str | None) -> dict[str, torch.Tensor]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    module = GPTLightningModule(
        vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=32, tie_weights=True, warmup_steps=2
    )
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=5), batch_size=4)
    # The uninterrupted run leaves an end-of-epoch checkpoint behind, as a run that later crashes would.
    callback = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1)
    trainer = quiet_trainer(
        strategy=ColossalDDPStrategy(),
        devices=torch.distributed.get_world_size(),
        max_epochs=2,
        callbacks=[callback],
        enable_checkpointing=True,
    )
    trainer.fit(module, train_dataloaders=loader, ckpt_path=resume_from)
    assert module.model is not None
    assert module.model.lm_head.weight is module.model.token_embedding.weight, "the tie must survive loading"
    return float_state(module)


def test_tied_weights_gpt_resumes_identically(rank_pool_2, tmp_path):
    reference = rank_pool_2.run(gpt_body, str(tmp_path / "first"), None)
    epoch_end = tmp_path / "first" / "epoch=0-step=4.ckpt"
    assert epoch_end.is_file() and shard_directory(epoch_end).is_dir()
    resumed = rank_pool_2.run(gpt_body, str(tmp_path / "second"), str(epoch_end))
    torch.testing.assert_close(resumed[0], reference[0], rtol=0, atol=0)


def damaged_resume_body(path: str) -> str:
    try:
        _fit(epochs=2, ckpt_path=path, strategy="colossal_zero2")
    except ValueError as error:
        return str(error)
    return "resumed"


def test_resume_from_damaged_shards_fails_on_every_rank_naming_the_fix(rank_pool_2, tmp_path):
    path = tmp_path / "epoch1.ckpt"
    rank_pool_2.run(save_after_one_epoch_body, str(path), "colossal_zero2")
    data_file = sorted(shard_directory(path).glob("*.distcp"))[-1]
    data_file.write_bytes(data_file.read_bytes()[:100])  # an interrupted copy
    for message in rank_pool_2.run(damaged_resume_body, str(path), timeout=60):
        assert "Cannot read the checkpoint's shards" in message and "Copy the whole shards directory" in message
