"""TokenThroughput: token counting, replica scaling, windows, warm-up skip and validation pauses."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader

from lightning_colossal.callbacks import TokenThroughput
from lightning_colossal.callbacks import throughput as throughput_module
from lightning_colossal.callbacks.throughput import count_tokens, data_parallel_replicas
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.module import GPTLightningModule


class FakeClock:
    """Stands in for ``time`` in the callback's module; ``now`` is moved by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class RecordingModule:
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.logged: list[float] = []

    def log(self, name: str, value: float, **kwargs: Any) -> None:
        assert name == "train/tokens_per_sec"
        self.logged.append(value)


def _fake_trainer(num_replicas: int | None = 2, world_size: int = 4) -> SimpleNamespace:
    return SimpleNamespace(
        global_step=0,
        world_size=world_size,
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": num_replicas, "rank": 0}),
        state=SimpleNamespace(fn=TrainerFn.FITTING),
    )


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(throughput_module, "time", fake)
    return fake


def test_count_tokens_finds_the_first_integer_tensor() -> None:
    ids = torch.zeros(4, 8, dtype=torch.long)
    assert count_tokens(ids) == 32
    assert count_tokens((torch.zeros(3, 5), ids)) == 32  # float tensor skipped
    assert count_tokens({"mask": torch.ones(2, dtype=torch.bool), "labels": ids[:2], "input_ids": ids}) == 32
    assert count_tokens({"pixel_values": torch.zeros(2), "labels": ids[:1]}) == 8
    assert count_tokens([[torch.zeros(1)], {"x": ids.int()}]) == 32
    assert count_tokens({"text": "no tensors"}) == 0


def test_replicas_come_from_the_sampler_settings_else_world_size() -> None:
    assert data_parallel_replicas(_fake_trainer(num_replicas=2, world_size=8)) == 2  # type: ignore[arg-type]
    assert data_parallel_replicas(_fake_trainer(num_replicas=None, world_size=8)) == 8  # type: ignore[arg-type]
    no_sampler = SimpleNamespace(world_size=3, strategy=object())
    assert data_parallel_replicas(no_sampler) == 3  # type: ignore[arg-type]


def test_windows_skip_warm_up_and_count_every_accumulated_batch(clock: FakeClock) -> None:
    callback = TokenThroughput(log_every_n_steps=2)
    trainer, module = _fake_trainer(num_replicas=2), RecordingModule()
    batch = (torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))  # 32 tokens x 2 replicas
    callback.on_train_start(trainer, module)  # type: ignore[arg-type]
    # Gradient accumulation over 2 batches: the global step advances on every second batch.
    global_steps = [0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6]
    for batch_idx, step in enumerate(global_steps):
        clock.now += 100.0 if batch_idx <= 3 else 1.0  # slow warm-up window, then 1 s per batch
        trainer.global_step = step
        callback.on_train_batch_end(trainer, module, None, batch, batch_idx)  # type: ignore[arg-type]
        if batch_idx == 3:
            assert module.logged == []  # the warm-up window (steps 1-2) is not reported
    # Window steps 3-4: batches 5..8 (4 batches x 64 tokens) in 4 s; window 5-6 the same.
    assert callback.tokens_per_sec == pytest.approx(64.0)
    assert module.logged[0] == pytest.approx(64.0)
    assert len(module.logged) == len(global_steps) - 7  # logged at every batch once a window is measured


def test_validation_inside_a_window_is_not_training_time(clock: FakeClock) -> None:
    callback = TokenThroughput(log_every_n_steps=1)
    trainer, module = _fake_trainer(num_replicas=1), RecordingModule()
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long)}
    callback.on_train_start(trainer, module)  # type: ignore[arg-type]
    trainer.global_step = 1
    callback.on_train_batch_end(trainer, module, None, batch, 0)  # type: ignore[arg-type]
    clock.now += 1.0
    callback.on_validation_start(trainer, module)  # type: ignore[arg-type]
    clock.now += 50.0
    callback.on_validation_end(trainer, module)  # type: ignore[arg-type]
    clock.now += 1.0
    trainer.global_step = 2
    callback.on_train_batch_end(trainer, module, None, batch, 1)  # type: ignore[arg-type]
    assert callback.tokens_per_sec == pytest.approx(10 / 2.0)


def test_rejects_an_empty_window() -> None:
    with pytest.raises(ValueError, match="log_every_n_steps"):
        TokenThroughput(log_every_n_steps=0)


def test_inside_a_real_trainer_with_gradient_accumulation(clock: FakeClock, tmp_path: Any) -> None:
    # Every clock read advances one second, so tokens_per_sec equals the tokens of one window.
    original = clock.perf_counter

    def ticking() -> float:
        clock.now += 1.0
        return original()

    clock.perf_counter = ticking  # type: ignore[method-assign]
    callback = TokenThroughput(log_every_n_steps=1)
    module = GPTLightningModule(vocab_size=16, block_size=8, num_layers=1, num_heads=1, embed_dim=8)
    trainer = Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        accumulate_grad_batches=2,
        limit_val_batches=0,
        log_every_n_steps=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    loader = DataLoader(RandomTokenDataset(vocab_size=16, block_size=8, num_samples=64), batch_size=4)
    trainer.fit(module, train_dataloaders=loader)
    assert callback.tokens_per_sec == pytest.approx(2 * 4 * 8)  # 2 micro-batches of 4 x 8 tokens per step
    assert trainer.callback_metrics["train/tokens_per_sec"].item() == pytest.approx(64.0)
