"""The LightningModule that trains the demo :class:`~lightning_colossal.demo.model.GPT`.

The model is built in ``configure_model``, not in ``__init__``: sharded strategies call that hook inside
their own init contexts (meta device, sharded init), so a model too large for one rank never exists whole.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.types import OptimizerLRSchedulerConfig

from lightning_colossal.demo.model import GPT, GPTConfig

__all__ = ["GPTLightningModule", "warmup_cosine_lr_ratio"]


def warmup_cosine_lr_ratio(step: int, *, warmup_steps: int, total_steps: int | None, min_lr_ratio: float) -> float:
    """Learning-rate multiplier: linear warm-up to 1, then cosine decay to ``min_lr_ratio``.

    Args:
        step: Number of optimizer steps taken so far (0 for the first step).
        warmup_steps: Steps of linear warm-up; the first step runs at ``1 / warmup_steps``.
        total_steps: Step at which the decay reaches ``min_lr_ratio`` (and stays); ``None`` for no decay.
        min_lr_ratio: Final multiplier.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class GPTLightningModule(LightningModule):
    """Next-token training of a :class:`GPT` with AdamW and a warm-up + cosine schedule.

    Args:
        vocab_size: Number of token ids (256 for bytes).
        block_size: Longest sequence the model accepts.
        num_layers: Number of transformer blocks.
        num_heads: Number of attention heads; must divide ``embed_dim``.
        embed_dim: Width of the residual stream.
        dropout: Dropout probability.
        tie_weights: Whether the LM head shares the token embedding's weight.
        learning_rate: Peak learning rate of AdamW.
        weight_decay: Weight decay, applied to parameters with two or more dimensions only.
        betas: AdamW's ``(beta1, beta2)``.
        warmup_steps: Optimizer steps of linear warm-up.
        min_lr_ratio: Final learning rate as a fraction of ``learning_rate``, reached at ``max_steps``.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        num_layers: int = 4,
        num_heads: int = 4,
        embed_dim: int = 128,
        dropout: float = 0.0,
        tie_weights: bool = True,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 20,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}; pass e.g. warmup_steps=20.")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}; pass e.g. min_lr_ratio=0.1.")
        self.save_hyperparameters()
        # Validated now, so a bad shape fails when the CLI parses it rather than after the processes launch.
        self.config = GPTConfig(
            vocab_size=vocab_size,
            block_size=block_size,
            num_layers=num_layers,
            num_heads=num_heads,
            embed_dim=embed_dim,
            dropout=dropout,
            tie_weights=tie_weights,
        )
        self.model: GPT | None = None

    def configure_model(self) -> None:
        """Build the GPT; idempotent, since Lightning may call this hook more than once."""
        if self.model is not None:
            return
        self.model = GPT(self.config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[batch, time, vocab]`` for ``input_ids`` ``[batch, time]``."""
        return self._require_model()(input_ids)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of one micro-batch; pipeline-parallel strategies call it on the last stage (``colossal_hybrid``)."""
        return self._cross_entropy(logits, targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Under a pipeline the strategy runs the schedule instead of training_step; its loss (already on every
        # rank) is logged here.
        if getattr(self.trainer.strategy, "pipelined", False) and isinstance(outputs, dict):
            self.log("train/loss", outputs["loss"], prog_bar=True)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("val/loss", loss, sync_dist=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> OptimizerLRSchedulerConfig:
        decay = [parameter for parameter in self.parameters() if parameter.requires_grad and parameter.dim() >= 2]
        no_decay = [parameter for parameter in self.parameters() if parameter.requires_grad and parameter.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams["weight_decay"]},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams["learning_rate"],
            betas=tuple(self.hparams["betas"]),
        )
        schedule = partial(
            warmup_cosine_lr_ratio,
            warmup_steps=self.hparams["warmup_steps"],
            total_steps=self._total_steps(),
            min_lr_ratio=self.hparams["min_lr_ratio"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _total_steps(self) -> int | None:
        """Optimizer steps of the whole run, or ``None`` when the run has no known end."""
        if self.trainer.max_steps > 0:
            return self.trainer.max_steps
        estimated: Any = self.trainer.estimated_stepping_batches
        if math.isinf(estimated):
            return None
        return int(estimated)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        input_ids, targets = batch
        return self._cross_entropy(self._require_model()(input_ids), targets)

    @staticmethod
    def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # float(): keep the softmax in fp32 under bf16/fp16 precision.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def _require_model(self) -> GPT:
        if self.model is None:
            raise RuntimeError(
                "GPTLightningModule.model is built in configure_model(); call it first (the Trainer does)."
            )
        return self.model
