"""BatchNorm running statistics under ``colossal_hybrid`` with pipeline stages (``pp_size > 1``): the data-parallel
replicas of each stage follow the first replica's statistics before every training and fitting-validation step, as
under Lightning's ddp ([Note: running statistics follow the first replica] in ``engine_parts/running_statistics.py``).

The reference is what one process computes on the same micro-batches in the same order (``expected_statistics``):
each replica of the model runs its own micro-batches one after the other, as the schedule runs them through each
stage, after taking the first replica's statistics; gradients are averaged over the replicas. Each stage's statistics
on each rank must equal that replica's statistics of the stage's norm layers.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_colossal.parallel import ModelPolicy
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext
from tests.distributed.oracle import quiet_trainer

FEATURES, WIDTH = 4, 8
BATCH_SIZE, NUM_MICROBATCHES, STEPS = 8, 2, 3
LEARNING_RATE = 0.1


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.relu(self.norm(self.linear(hidden)))


class NormNetwork(nn.Module):
    """Input layer, two blocks with a BatchNorm each (one per pipeline stage), output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.output = nn.Linear(WIDTH, 1)

    def forward(self, inputs: Tensor) -> Tensor:
        hidden = self.input(inputs)
        for block in self.blocks:
            hidden = block(hidden)
        return self.output(hidden)

    def parallel_policy(self) -> ModelPolicy:
        return NormNetworkPolicy()


class NormNetworkStage(nn.Module):
    """One pipeline stage; it references the network's modules, as the built-in policies' stages do."""

    def __init__(self, network: NormNetwork, layer_indices: list[int], first: bool, last: bool) -> None:
        super().__init__()
        self.input = network.input if first else None
        self.blocks = nn.ModuleList(network.blocks[index] for index in layer_indices)
        self.output = network.output if last else None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.input is not None:
            hidden = self.input(hidden)
        for block in self.blocks:
            hidden = block(hidden)
        return hidden if self.output is None else self.output(hidden)


class NormNetworkPolicy(ModelPolicy):
    """Pipeline stages only (no tensor parallelism)."""

    name = "NormNetwork"

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, NormNetwork)

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        return ParallelPlan()

    def layers(self, model: nn.Module) -> nn.ModuleList:
        assert isinstance(model, NormNetwork)
        return model.blocks

    def stage_module(
        self, model: nn.Module, layer_indices: list[int], first: bool, last: bool, context: ParallelContext
    ) -> nn.Module:
        assert isinstance(model, NormNetwork)
        return NormNetworkStage(model, layer_indices, first, last)

    def prune(self, model: nn.Module, keep_layers: set[int], first: bool, last: bool) -> None:
        assert isinstance(model, NormNetwork)
        for index in range(len(model.blocks)):
            if index not in keep_layers:
                model.blocks[index] = nn.Identity()
        if not first:
            model.input = None  # type: ignore[assignment]
        if not last:
            model.output = None  # type: ignore[assignment]


def dataset(num_samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(num_samples, FEATURES, generator=generator)
    return TensorDataset(inputs, torch.randn(num_samples, 1, generator=generator))


def samples_of_replica(samples: TensorDataset, replica: int, num_replicas: int) -> list[int]:
    """The samples Lightning's sampler deals this replica in the first epoch (shuffled with seed 0)."""
    return list(DistributedSampler(samples, num_replicas=num_replicas, rank=replica, shuffle=True, seed=0))


def new_network() -> NormNetwork:
    seed_everything(0, verbose=False)
    return NormNetwork()


class NormModule(LightningModule):
    def __init__(self, data_parallel_size: int) -> None:
        super().__init__()
        self.net = new_network()
        self.data_parallel_size = data_parallel_size

    def pipeline_loss(self, outputs: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def training_step(self, batch: Any, batch_index: int) -> Tensor:  # replaced by the pipeline schedule
        inputs, targets = batch
        return self.pipeline_loss(self.net(inputs), targets)

    def validation_step(self, batch: Any, batch_index: int) -> None:  # replaced by the pipeline schedule
        pass

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(dataset(STEPS * BATCH_SIZE * self.data_parallel_size), batch_size=BATCH_SIZE)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(dataset(BATCH_SIZE * self.data_parallel_size), batch_size=BATCH_SIZE)


def _statistics(module: nn.Module) -> dict[str, Tensor]:
    return {name: buffer.detach().clone() for name, buffer in module.named_buffers()}


class RecordStatistics(Callback):
    """The statistics when training ends (before validation, whose steps copy the first replica's again)."""

    def on_validation_start(self, trainer: Any, module: Any) -> None:
        module.statistics_after_training = _statistics(module.net)


def fit_body(strategy_arguments: dict[str, Any], empty_init: bool) -> dict[str, Any]:
    from lightning_colossal import HybridParallelStrategy

    strategy = HybridParallelStrategy(num_microbatches=NUM_MICROBATCHES, **strategy_arguments)
    data_parallel_size = torch.distributed.get_world_size() // strategy_arguments.get("pp_size", 1)
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_epochs=1, callbacks=[RecordStatistics()]
    )
    # On the meta device, a rank materialises only its own stage: the other stage's norm layers keep meta tensors.
    with trainer.init_module(empty_init=empty_init):
        module = NormModule(data_parallel_size)
    trainer.fit(module)
    assert trainer.global_step == STEPS
    return {
        "replica": strategy.device_mesh["dp"].get_local_rank(),
        "after_training": module.statistics_after_training,
        "after_fit": _statistics(module.net),
    }


def expected_statistics(data_parallel_size: int) -> list[dict[str, Tensor]]:
    """Each replica's statistics when training ends, computed in this process: before every step each replica takes
    the first replica's statistics, then runs its micro-batches in order; the step averages the replicas'
    gradients."""
    replicas = [new_network() for _ in range(data_parallel_size)]
    samples = dataset(STEPS * BATCH_SIZE * data_parallel_size)
    for step in range(STEPS):
        for replica in replicas[1:]:
            for buffer, first in zip(replica.buffers(), replicas[0].buffers(), strict=True):
                buffer.copy_(first)
        for index, replica in enumerate(replicas):
            replica.zero_grad()
            mine = samples_of_replica(samples, index, data_parallel_size)[step * BATCH_SIZE : (step + 1) * BATCH_SIZE]
            inputs, targets = samples[mine]
            for micro_inputs, micro_targets in zip(
                inputs.chunk(NUM_MICROBATCHES), targets.chunk(NUM_MICROBATCHES), strict=True
            ):
                (nn.functional.mse_loss(replica(micro_inputs), micro_targets) / NUM_MICROBATCHES).backward()
        with torch.no_grad():
            for parameters in zip(*(replica.parameters() for replica in replicas), strict=True):
                mean = torch.stack([parameter.grad for parameter in parameters]).mean(0)
                for parameter in parameters:
                    parameter -= LEARNING_RATE * mean
    return [_statistics(replica) for replica in replicas]


def _assert_statistics(got: dict[str, Tensor], expected: dict[str, Tensor], label: str) -> None:
    for name, buffer in got.items():  # this rank's stage: the other stage's blocks were pruned
        torch.testing.assert_close(buffer, expected[name], rtol=1e-5, atol=1e-6, msg=f"{label}: {name}")


@pytest.mark.parametrize(
    ("pool_size", "strategy_arguments", "empty_init"),
    [
        pytest.param(4, {"pp_size": 2}, False, id="pp2-dp2"),
        pytest.param(4, {"pp_size": 2}, True, id="pp2-dp2-meta"),
        # No replicas: nothing to copy; each stage's statistics stay its own, as one process computes them.
        pytest.param(2, {"pp_size": 2}, False, id="pp2"),
    ],
)
def test_each_pipeline_stage_follows_its_first_replicas_running_statistics(
    rank_pools, pool_size, strategy_arguments, empty_init
):
    results = rank_pools.get(pool_size).run(fit_body, strategy_arguments, empty_init, timeout=300)
    expected = expected_statistics(data_parallel_size=pool_size // strategy_arguments["pp_size"])
    for rank, result in enumerate(results):
        assert result["after_training"], f"rank {rank} holds no norm layer"
        assert set(result["after_training"]) < set(expected[0]), "each rank holds only its own stage's norm layers"
        replica = result["replica"]
        _assert_statistics(
            result["after_training"], expected[replica], f"rank {rank} (replica {replica}) after training"
        )
        # Fitting validation copies the first replica's statistics once more: every replica ends holding them.
        _assert_statistics(result["after_fit"], expected[0], f"rank {rank} (replica {replica}) after fit")
    if pool_size // strategy_arguments["pp_size"] > 1:
        running_means = [name for name in expected[0] if name.endswith("running_mean")]
        assert all(not torch.equal(expected[0][name], expected[1][name]) for name in running_means), (
            "the replicas' own statistics must differ, or the test shows nothing"
        )
