"""Per-rank memory of ZeRO-1/2 measured from the real tensors (``engine.memory_report()``) against the ZeRO formula.

With Ψ parameters in fp32 on N data-parallel ranks and AdamW, each rank holds the full parameters (4Ψ bytes), the
moments of its own rows only (8Ψ/N), gradients of full size under stage 1 (4Ψ) and of its own rows under stage 2
(4Ψ/N), and no second fp32 copy of fp32 parameters unless the master shard is offloaded (then 4Ψ/N, with a 4Ψ/N
fp32 gradient shard next to it on the host, on top of the compute-device gradients). "Its own rows" follows
``torch.chunk`` along dim 0: rank r owns rows [r*k, min((r+1)*k, R)) with k = ceil(R/N), so the expected byte
counts below are exact, not approximate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_colossal import ZeroStrategy
from tests.distributed.oracle import float_state, quiet_trainer

FLOAT32_BYTES = 4
STEP_SCALAR_BYTES = 4  # torch's Adam/AdamW keep "step" as a 0-dim float32 tensor per parameter
SAMPLES, WIDTH, OUTPUTS = 64, 64, 31


def owned_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 size ``rows`` that ``rank`` owns (torch.chunk semantics), computed independently."""
    per_rank = math.ceil(rows / world_size)
    start = min(rank * per_rank, rows)
    return min(start + per_rank, rows) - start


def owned_numel(shape: torch.Size | tuple[int, ...], world_size: int, rank: int) -> int:
    if len(shape) == 0:
        return 1  # a scalar parameter cannot be split
    return owned_rows(shape[0], world_size, rank) * math.prod(shape[1:])


def test_owned_rows_follow_torch_chunk():
    for rows in [1, 2, 3, 5, 6, 31, 64]:
        for world_size in [1, 2, 3, 4]:
            chunks = torch.arange(rows).chunk(world_size)
            expected = [len(chunk) for chunk in chunks] + [0] * (world_size - len(chunks))
            assert [owned_rows(rows, world_size, rank) for rank in range(world_size)] == expected


class MemoryModule(LightningModule):
    """Enough parameters for the shards to matter, uneven row counts (31 over 2 or 4 ranks), every shard non-empty."""

    def __init__(self, optimizer: str = "adamw") -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, WIDTH),
            nn.ReLU(),
            nn.Linear(WIDTH, WIDTH),
            nn.ReLU(),
            nn.Linear(WIDTH, WIDTH),
            nn.ReLU(),
            nn.Linear(WIDTH, OUTPUTS),
        )
        self.optimizer_name = optimizer
        self.before_step: dict[str, int] | None = None
        self.full_gradient_bytes_before_step: int | None = None
        self.full_gradient_bytes_per_micro_batch: list[int] = []
        self.collectives_per_micro_batch: list[int] = []
        self.after_step: dict[str, int] | None = None
        self.optimizer_state_bytes: int | None = None

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        weights = [parameter for parameter in self.parameters() if parameter.ndim >= 2]
        biases = [parameter for parameter in self.parameters() if parameter.ndim < 2]
        groups = [{"params": weights}, {"params": biases, "lr": 5e-3, "weight_decay": 0.0}]
        if self.optimizer_name == "adamw":
            return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)
        if self.optimizer_name == "adam":
            return torch.optim.Adam(groups, lr=1e-2)
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(groups, lr=5e-2, momentum=0.9, nesterov=True, weight_decay=1e-2)
        raise ValueError(self.optimizer_name)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(11)
        inputs = torch.randn(SAMPLES, WIDTH, generator=generator)
        targets = torch.randn(SAMPLES, OUTPUTS, generator=generator)
        return DataLoader(TensorDataset(inputs, targets), batch_size=4)

    # Reports taken with the gradients of the step alive (before it) and after the step.
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            self.before_step = engine.memory_report()._asdict()
        self.full_gradient_bytes_before_step = self._full_gradient_bytes()

    def _full_gradient_bytes(self) -> int:
        """Bytes of the ``.grad`` the model's own parameters hold (not the engine's report: the real tensors)."""
        return sum(p.grad.numel() * p.grad.element_size() for p in self.parameters() if p.grad is not None)

    def on_train_batch_start(self, *args: Any) -> None:
        self._collectives_at_start = COLLECTIVE_CALLS[0]

    def on_train_batch_end(self, *args: Any) -> None:
        self.full_gradient_bytes_per_micro_batch.append(self._full_gradient_bytes())
        self.collectives_per_micro_batch.append(COLLECTIVE_CALLS[0] - self._collectives_at_start)
        engine = getattr(self.trainer.strategy, "engine", None)
        if engine is not None:
            self.after_step = engine.memory_report()._asdict()
        optimizer = self.trainer.optimizers[0]
        self.optimizer_state_bytes = sum(
            value.numel() * value.element_size()
            for state in optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )


def _strategy(spec: dict[str, Any] | str) -> Any:
    return spec if isinstance(spec, str) else ZeroStrategy(**spec)


COLLECTIVE_CALLS = [0]
# Point-to-point sends count too: on gloo the engines' reduce-scatters and all-gathers are built from them. Flat
# collectives under either of torch's names, whichever this torch has.
COUNTED_COLLECTIVES = tuple(
    name
    for name in (
        "all_reduce",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "all_gather_single",
        "all_gather_into_tensor",
        "all_gather",
        "broadcast",
        "isend",
        "irecv",
    )
    if hasattr(torch.distributed, name)
)


@contextmanager
def counting_collectives() -> Iterator[None]:
    """Count calls of torch.distributed's tensor collectives (the engine reaches them as ``dist.<name>``)."""
    originals = {name: getattr(torch.distributed, name) for name in COUNTED_COLLECTIVES}

    def counted(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            COLLECTIVE_CALLS[0] += 1
            return original(*args, **kwargs)

        return call

    for name, original in originals.items():
        setattr(torch.distributed, name, counted(original))
    try:
        yield
    finally:
        for name, original in originals.items():  # the worker process lives on: leave torch as it was
            setattr(torch.distributed, name, original)


def memory_body(
    strategy_spec: dict[str, Any] | str, precision: str = "32-true", steps: int = 2, accumulate: int = 1
) -> dict[str, Any]:
    seed_everything(5, verbose=False)
    module = MemoryModule()
    trainer = quiet_trainer(
        strategy=_strategy(strategy_spec),
        devices=torch.distributed.get_world_size(),
        max_steps=steps,
        precision=precision,
        accumulate_grad_batches=accumulate,
    )
    with counting_collectives():
        trainer.fit(module)
    return {
        "collectives_per_micro_batch": module.collectives_per_micro_batch,
        "full_gradient_bytes_before_step": module.full_gradient_bytes_before_step,
        "full_gradient_bytes_per_micro_batch": module.full_gradient_bytes_per_micro_batch,
        "before_step": module.before_step,
        "after_step": module.after_step,
        "optimizer_state_bytes": module.optimizer_state_bytes,
        "shapes": [tuple(parameter.shape) for parameter in module.parameters()],
    }


def _expected(shapes: list[tuple[int, ...]], world_size: int, rank: int) -> dict[str, int]:
    total = sum(math.prod(shape) for shape in shapes)
    owned = sum(owned_numel(shape, world_size, rank) for shape in shapes)
    assert all(owned_numel(shape, world_size, rank) > 0 for shape in shapes), "the model must have no empty shard"
    return {"psi": total, "owned": owned, "steps": STEP_SCALAR_BYTES * len(shapes)}


@pytest.mark.parametrize("cpu_offload", [False, True], ids=["no-offload", "offload"])
@pytest.mark.parametrize("stage", [1, 2], ids=["stage1", "stage2"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_per_rank_bytes_follow_the_zero_formula(request, world_size, stage, cpu_offload):
    pool = request.getfixturevalue(f"rank_pool_{world_size}")
    results = pool.run(memory_body, {"stage": stage, "cpu_offload": cpu_offload})
    moments = []
    for rank, result in enumerate(results):
        expected = _expected(result["shapes"], world_size, rank)
        psi, owned = expected["psi"], expected["owned"]
        for when in ("before_step", "after_step"):
            report = result[when]
            assert report is not None, f"no memory report {when}"
            assert report["parameter_bytes"] == FLOAT32_BYTES * psi, (rank, when, report)
            assert report["num_parameters"] == psi, (rank, when, report)
            # Compute-device gradients (stage 1: full size, stage 2: own rows) plus, when offloaded, the fp32
            # gradient shard the optimizer reads on the host.
            expected_gradient = FLOAT32_BYTES * ((psi if stage == 1 else owned) + (owned if cpu_offload else 0))
            assert report["gradient_bytes"] == expected_gradient, (rank, when, report, expected)
            assert report["master_bytes"] == (FLOAT32_BYTES * owned if cpu_offload else 0), (rank, when, report)
        # Measured on the parameters themselves: stage 1 keeps full-size .grad (views into its buckets), stage 2
        # frees each full gradient as soon as its rows were staged for reduction.
        assert result["full_gradient_bytes_before_step"] == (FLOAT32_BYTES * psi if stage == 1 else 0), rank
        optimizer_bytes = result["after_step"]["optimizer_state_bytes"]
        assert optimizer_bytes == 2 * FLOAT32_BYTES * owned + expected["steps"], (rank, result["after_step"], expected)
        # 1/N of the moments (padding aside; only 31-row tensors do not split evenly here).
        assert abs((optimizer_bytes - expected["steps"]) - 8 * psi / world_size) <= 8 * WIDTH * 2
        moments.append(optimizer_bytes - expected["steps"])
    if stage == 2 and not cpu_offload:
        assert max(result["after_step"]["gradient_bytes"] for result in results) < 4.1 * expected["psi"] / world_size
    # The moments of every row live on exactly one rank: together they are DDP's 8Ψ.
    assert sum(moments) == 8 * expected["psi"]


def test_optimizer_state_summed_over_ranks_equals_colossal_ddp(rank_pool_2):
    ddp = rank_pool_2.run(memory_body, "colossal_ddp")
    zero = rank_pool_2.run(memory_body, {"stage": 2})
    psi = sum(math.prod(shape) for shape in ddp[0]["shapes"])
    steps = STEP_SCALAR_BYTES * len(ddp[0]["shapes"])
    assert ddp[0]["optimizer_state_bytes"] == 8 * psi + steps  # DDP: both moments of every parameter, every rank
    zero_moments = sum(result["after_step"]["optimizer_state_bytes"] - steps for result in zero)
    assert zero_moments == ddp[0]["optimizer_state_bytes"] - steps


@pytest.mark.parametrize(
    "strategy_spec",
    [{"stage": 1}, {"stage": 2, "stage2_accumulation": "sharded"}, {"stage": 2, "stage2_accumulation": "local"}],
    ids=["stage1", "stage2-sharded", "stage2-local"],
)
def test_accumulation_modes_hold_and_communicate_what_they_promise(rank_pool_2, strategy_spec):
    # Accumulating 2 micro-batches. Stage 1 keeps full gradients (its buckets) and communicates only on the last
    # micro-batch. Stage 2 "sharded" reduces every micro-batch into the shard accumulator, so no full-size gradient
    # outlives a micro-batch; "local" keeps full gradients until the last micro-batch and reduces once.
    results = rank_pool_2.run(memory_body, strategy_spec, "32-true", 2, 2)
    sharded = strategy_spec.get("stage2_accumulation") == "sharded"
    for rank, result in enumerate(results):
        psi = _expected(result["shapes"], 2, rank)["psi"]
        held = result["full_gradient_bytes_per_micro_batch"]
        calls = result["collectives_per_micro_batch"]
        assert len(held) == len(calls) == 4
        if strategy_spec["stage"] == 1:
            assert held == [FLOAT32_BYTES * psi] * 4, held
        else:
            assert held[1::2] == [0, 0], held  # the last micro-batch's gradients were reduced and freed
            assert held[0::2] == ([0, 0] if sharded else [FLOAT32_BYTES * psi] * 2), held
        assert all(count > 0 for count in calls[1::2]), calls  # reduction, parameter exchange
        if sharded:
            assert all(count > 0 for count in calls[0::2]), calls
        else:
            assert calls[0::2] == [0, 0], f"a non-final micro-batch communicated: {calls}"


def test_bf16_true_keeps_fp32_master_shards(rank_pool_2):
    results = rank_pool_2.run(memory_body, {"stage": 2}, "bf16-true")
    for rank, result in enumerate(results):
        expected = _expected(result["shapes"], 2, rank)
        report = result["after_step"]
        assert report["parameter_bytes"] == 2 * expected["psi"], report  # bf16 weights
        assert report["master_bytes"] == FLOAT32_BYTES * expected["owned"], report  # fp32 master of the own rows
        assert report["optimizer_state_bytes"] == 2 * FLOAT32_BYTES * expected["owned"] + expected["steps"], report


def train_optimizer_body(strategy_spec: dict[str, Any] | str, optimizer: str) -> dict[str, torch.Tensor]:
    seed_everything(5, verbose=False)
    module = MemoryModule(optimizer)
    trainer = quiet_trainer(strategy=_strategy(strategy_spec), devices=torch.distributed.get_world_size(), max_steps=4)
    trainer.fit(module)
    return float_state(module)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_other_optimizers_on_uneven_shards_match_colossal_ddp(rank_pool_2, optimizer):
    # 31 output rows split 16/15: the shards are uneven; SGD's momentum buffer and Adam's moments live per shard.
    reference = rank_pool_2.run(train_optimizer_body, "colossal_ddp", optimizer)[0]
    for spec in ({"stage": 1}, {"stage": 2, "cpu_offload": True}):
        for result in rank_pool_2.run(train_optimizer_body, spec, optimizer):
            torch.testing.assert_close(result, reference, rtol=1e-5, atol=1e-6, msg=lambda m, s=spec: f"{s}: {m}")
    seed_everything(5, verbose=False)
    initial = float_state(MemoryModule(optimizer))
    assert max((reference[name] - initial[name]).abs().max().item() for name in initial) > 1e-3
