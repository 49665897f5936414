"""Training throughput in tokens per second, measured over windows of optimizer steps.

[Note: what a window counts]
A window spans ``log_every_n_steps`` optimizer steps. Its tokens are the token ids of every training batch
that ends inside it (so gradient-accumulation micro-batches all count), multiplied by the number of
data-parallel replicas: each replica consumes its own batch, while tensor- and pipeline-parallel ranks of
one replica share theirs. Its time is wall time between the window's boundaries, less any validation run
inside it. The first window is discarded: it holds start-up costs (allocator warm-up, compilation,
DataLoader workers starting) that say nothing about steady-state speed.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn

from lightning_colossal.distributed import device as devices

__all__ = ["TokenThroughput", "count_tokens", "data_parallel_replicas"]


def count_tokens(batch: Any) -> int:
    """Number of token ids in a batch: the ``numel`` of its first integer tensor.

    A mapping is searched at ``"input_ids"`` first, then in value order; sequences in order. Returns 0 when
    the batch holds no integer tensor.
    """
    if isinstance(batch, torch.Tensor):
        is_integer = not batch.dtype.is_floating_point and not batch.dtype.is_complex and batch.dtype != torch.bool
        return batch.numel() if is_integer else 0
    if isinstance(batch, Mapping):
        candidates = list(batch.values())
        if "input_ids" in batch:
            candidates.insert(0, batch["input_ids"])
    elif isinstance(batch, list | tuple):
        candidates = list(batch)
    else:
        return 0
    for candidate in candidates:
        tokens = count_tokens(candidate)
        if tokens:
            return tokens
    return 0


def data_parallel_replicas(trainer: Trainer) -> int:
    """Number of data-parallel replicas, each consuming a distinct batch per step."""
    sampler_kwargs = getattr(trainer.strategy, "distributed_sampler_kwargs", None)
    if isinstance(sampler_kwargs, Mapping) and sampler_kwargs.get("num_replicas") is not None:
        return int(sampler_kwargs["num_replicas"])
    return trainer.world_size


class TokenThroughput(Callback):
    """Log training tokens per second as ``train/tokens_per_sec``.

    See the module's Note "what a window counts". The value of the latest window is logged at every
    training batch after the first measured window, so it appears whatever the Trainer's
    ``log_every_n_steps``. Each rank computes it from its own clock, without synchronising; the loggers write
    rank zero's value.

    Args:
        log_every_n_steps: Optimizer steps per measurement window.
    """

    def __init__(self, log_every_n_steps: int = 10) -> None:
        super().__init__()
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}; pass e.g. 10.")
        self.log_every_n_steps = log_every_n_steps
        self._reset()

    def _reset(self) -> None:
        self._window_start: float | None = None
        self._window_tokens = 0
        self._last_boundary_step: int | None = None
        self._validation_start: float | None = None
        self.tokens_per_sec: float | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._reset()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._window_tokens += count_tokens(batch) * data_parallel_replicas(trainer)
        step = trainer.global_step
        at_boundary = step % self.log_every_n_steps == 0 and step != self._last_boundary_step and step > 0
        if at_boundary:
            _synchronize(pl_module.device)  # queued accelerator work belongs to this window
            now = time.perf_counter()
            if self._window_start is not None:
                self.tokens_per_sec = self._window_tokens / max(now - self._window_start, 1e-9)
            self._window_start = now
            self._window_tokens = 0
            self._last_boundary_step = step
        if self.tokens_per_sec is not None:
            pl_module.log(
                "train/tokens_per_sec",
                self.tokens_per_sec,
                prog_bar=True,
                on_step=True,
                on_epoch=False,
            )

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # Validation inside fit pauses the window; a stand-alone validate() has no window to pause.
        if trainer.state.fn == TrainerFn.FITTING and self._window_start is not None:
            self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._validation_start is not None and self._window_start is not None:
            # Shift the window's start so the validation run does not count as training time.
            self._window_start += time.perf_counter() - self._validation_start
        self._validation_start = None


def _synchronize(device: torch.device) -> None:
    """Wait for queued work on an accelerator; a no-op on CPU."""
    devices.synchronize(device)
