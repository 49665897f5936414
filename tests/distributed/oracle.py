"""A small model, its data, and the single-process PyTorch oracle every engine is compared against.

The oracle trains the same initial model on the same *global* batch in one process with plain PyTorch: at each
optimizer step it takes every micro-batch of every rank (exactly the samples Lightning's DistributedSampler hands
each rank: Lightning always shuffles training data, seeded with ``PL_GLOBAL_SEED`` and the epoch), averages their
losses, back-propagates once, optionally clips, and steps. A data-parallel engine
that reduces gradients correctly must land on the same parameters up to float reassociation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FEATURES = 8
NUM_SAMPLES = 64
MODEL_SEED = 7


def make_dataset(num_samples: int = NUM_SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    inputs = torch.randn(num_samples, FEATURES, generator=generator)
    targets = torch.sin(inputs.sum(dim=1, keepdim=True)) + 0.1 * inputs[:, :1]
    return TensorDataset(inputs, targets)


class RegressionModel(nn.Module):
    """MLP with a norm layer and a bias-free layer, so param groups with and without weight decay both exist."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.input = nn.Linear(FEATURES, 32)
        self.norm = nn.LayerNorm(32)
        self.hidden = nn.Linear(32, 32, bias=False)
        self.dropout = nn.Dropout(dropout)
        self.output = nn.Linear(32, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.norm(self.input(inputs)))
        hidden = self.dropout(torch.relu(self.hidden(hidden)))
        return self.output(hidden)


def build_optimizer(model: nn.Module, learning_rate: float) -> torch.optim.Optimizer:
    decay = [param for name, param in model.named_parameters() if param.ndim >= 2]
    no_decay = [param for name, param in model.named_parameters() if param.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": learning_rate * 0.5}],
        lr=learning_rate,
    )


class RegressionModule(LightningModule):
    """LightningModule wrapping ``RegressionModel``; records every micro-batch loss it computes."""

    def __init__(
        self,
        batch_size: int = 4,
        learning_rate: float = 0.02,
        dropout: float = 0.0,
        shuffle: bool = False,
        with_scheduler: bool = False,
        overflow_at_step: int | None = None,
        frozen: tuple[str, ...] = (),
    ) -> None:
        super().__init__()
        self.model = RegressionModel(dropout)
        for name in frozen:  # submodules of the model whose parameters do not train (requires_grad=False)
            self.model.get_submodule(name).requires_grad_(False)
        self.batch_size = batch_size
        self.learning_rate = learning_rate
        self.shuffle = shuffle
        self.with_scheduler = with_scheduler
        self.overflow_at_step = overflow_at_step
        self.micro_batch_losses: list[float] = []

    def training_step(self, batch: Sequence[torch.Tensor], batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        loss = nn.functional.mse_loss(self.model(inputs).float(), targets.float())
        self.micro_batch_losses.append(loss.detach().item())
        self.log("train_loss", loss, sync_dist=True)
        if self.overflow_at_step is not None and self.global_step == self.overflow_at_step and self.global_rank == 1:
            loss = loss * float("inf")  # an overflow on one rank only
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = build_optimizer(self, self.learning_rate)
        if not self.with_scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(), batch_size=self.batch_size, shuffle=self.shuffle)


def quiet_trainer(**overrides: Any) -> Trainer:
    """A Trainer for tests: CPU, no logger/progress bar/summary/checkpointing unless asked."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    settings.update(overrides)
    return Trainer(**settings)


def new_module(**kwargs: Any) -> RegressionModule:
    """A module whose initial weights depend only on ``MODEL_SEED``."""
    seed_everything(MODEL_SEED, verbose=False)
    return RegressionModule(**kwargs)


def float_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full fp32 copies of the module's state; sharded (DTensor) entries are gathered, so every rank must call it."""
    from torch.distributed.tensor import DTensor

    state = module.state_dict()
    full = {name: tensor.full_tensor() if isinstance(tensor, DTensor) else tensor for name, tensor in state.items()}
    return {name: tensor.detach().float().cpu().clone() for name, tensor in full.items()}


NORM_TYPES = (1.0, 2.0, float("inf"))


@dataclass
class OracleResult:
    step_losses: list[float] = field(default_factory=list)
    parameters: dict[str, torch.Tensor] = field(default_factory=dict)
    # Per step, before clipping: the gradient's norm of each type in NORM_TYPES.
    gradient_norms: list[dict[float, float]] = field(default_factory=list)


def oracle_train(
    world_size: int,
    steps: int,
    batch_size: int = 4,
    accumulate: int = 1,
    clip_norm: float | None = None,
    clip_value: float | None = None,
    learning_rate: float = 0.02,
    autocast_dtype: torch.dtype | None = None,
    skip_steps: Sequence[int] = (),
    parameter_dtype: torch.dtype = torch.float32,
    frozen: tuple[str, ...] = (),
    device: str = "cpu",
) -> OracleResult:
    """Train like ``world_size`` data-parallel ranks would, in one process (unshuffled DistributedSampler order).

    ``device="cuda"`` trains on the GPU (the mixed-precision reference of the GPU tests: autocast there runs the
    GPU's kernels); the result's parameters are on the CPU either way.
    """
    module = new_module(batch_size=batch_size, learning_rate=learning_rate, frozen=frozen).to(parameter_dtype)
    module = module.to(device)
    model = module.model
    optimizer = build_optimizer(module, learning_rate)
    dataset = make_dataset()
    inputs, targets = (tensor.to(device=device, dtype=parameter_dtype) for tensor in dataset.tensors)
    result = OracleResult()
    micro_batches = _rank_micro_batches(dataset, world_size, batch_size)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        losses = []
        for _ in range(accumulate):
            for chosen in next(micro_batches):
                with torch.autocast(device, dtype=autocast_dtype) if autocast_dtype else _no_context():
                    prediction = model(inputs[chosen])
                losses.append(nn.functional.mse_loss(prediction.float(), targets[chosen].float()))
        loss = torch.stack(losses).mean()
        loss.backward()
        result.step_losses.append(loss.item())
        gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
        result.gradient_norms.append(
            {norm_type: torch.nn.utils.get_total_norm(gradients, norm_type).item() for norm_type in NORM_TYPES}
        )
        if step in skip_steps:
            continue
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
    result.parameters = {name: tensor.cpu() for name, tensor in float_state(module).items()}
    return result


def _rank_micro_batches(dataset: TensorDataset, world_size: int, batch_size: int) -> Iterator[list[list[int]]]:
    """Yield, micro-batch after micro-batch, the sample indices each rank reads (epoch after epoch)."""
    seed = MODEL_SEED  # new_module() called seed_everything(MODEL_SEED), which Lightning's sampler seed follows
    epoch = 0
    while True:
        per_rank = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            per_rank.append(list(sampler))
        for start in range(0, len(per_rank[0]), batch_size):
            yield [indices[start : start + batch_size] for indices in per_rank]
        epoch += 1


def train_and_record(
    strategy: Any,
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    precision: str = "32-true",
    facts: Callable[[LightningModule], dict[str, Any]] | None = None,
    frozen: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Rank body helper: train ``new_module()`` with ``strategy`` and return its micro-batch losses and weights.

    ``facts`` adds what a test wants to know about the trained module (e.g. how it was sharded) to the result.
    """
    module = new_module(frozen=frozen)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=torch.distributed.get_world_size(),
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        gradient_clip_algorithm=clip_algorithm,
        precision=precision,
    )
    trainer.fit(module)
    assert trainer.global_step == steps
    result = {"losses": module.micro_batch_losses, "parameters": float_state(module)}
    return {**result, **facts(module)} if facts is not None else result


def assert_matches_oracle(
    results: Sequence[dict[str, Any]], oracle: OracleResult, accumulate: int, rtol: float, atol: float
) -> None:
    """Per-step losses and final weights of every rank match the oracle; all replicas hold identical weights."""
    losses = step_losses_from_ranks([result["losses"] for result in results], accumulate)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(oracle.step_losses), rtol=rtol, atol=atol)
    for result in results:
        torch.testing.assert_close(result["parameters"], oracle.parameters, rtol=rtol, atol=atol)
    for result in results[1:]:
        torch.testing.assert_close(result["parameters"], results[0]["parameters"], rtol=0, atol=0)


def step_losses_from_ranks(rank_losses: Sequence[Sequence[float]], accumulate: int) -> list[float]:
    """Mean over ranks and micro-batches of each optimizer step's micro-batch losses."""
    world_size = len(rank_losses)
    steps = len(rank_losses[0]) // accumulate
    return [
        sum(rank_losses[rank][step * accumulate + micro] for rank in range(world_size) for micro in range(accumulate))
        / (world_size * accumulate)
        for step in range(steps)
    ]


class _no_context:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *args: object) -> None:
        return None
