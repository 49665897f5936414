"""Rank bodies for checkpoint round trips, shared by every strategy's checkpoint tests.

A strategy is named by a picklable spec ``(kind, constructor arguments)`` with kind ``"ddp"``, ``"zero"`` or
``"fsdp"`` or ``"gemini"``, so one body serves every strategy and cross-strategy resumes (save with one, resume with another).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_colossal import ColossalDDPStrategy, ColossalFSDPStrategy, GeminiStrategy, ZeroStrategy
from tests.distributed.oracle import float_state, new_module, quiet_trainer

StrategySpec = tuple[str, dict[str, Any]]
STRATEGY_CLASSES = {
    "ddp": ColossalDDPStrategy,
    "zero": ZeroStrategy,
    "fsdp": ColossalFSDPStrategy,
    "gemini": GeminiStrategy,
}

DDP: StrategySpec = ("ddp", {})
ZERO1: StrategySpec = ("zero", {"stage": 1})
ZERO2: StrategySpec = ("zero", {"stage": 2})
FSDP: StrategySpec = ("fsdp", {})
GEMINI: StrategySpec = ("gemini", {"chunk_numel": 1100})  # two chunks of the oracle's model (352, 1057 elements)


def build_strategy(spec: StrategySpec) -> Any:
    kind, arguments = spec
    return STRATEGY_CLASSES[kind](**arguments)


def fit_epochs(
    spec: StrategySpec,
    epochs: int,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    batch_size: int = 4,
    dropout: float = 0.1,
) -> dict[str, torch.Tensor]:
    """Train the oracle's module for ``epochs`` (optionally resuming, optionally saving) and return its weights."""
    module = new_module(batch_size=batch_size, dropout=dropout, with_scheduler=True)
    trainer = quiet_trainer(
        strategy=build_strategy(spec), devices=torch.distributed.get_world_size(), max_epochs=epochs
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return float_state(module)


def uninterrupted_body(spec: StrategySpec, dropout: float) -> dict[str, torch.Tensor]:
    return fit_epochs(spec, epochs=2, dropout=dropout)


def save_after_one_epoch_body(spec: StrategySpec, path: str, dropout: float) -> dict[str, torch.Tensor]:
    return fit_epochs(spec, epochs=1, save_to=path, dropout=dropout)


def resume_body(spec: StrategySpec, path: str, batch_size: int, dropout: float) -> dict[str, torch.Tensor]:
    return fit_epochs(spec, epochs=2, ckpt_path=path, batch_size=batch_size, dropout=dropout)
