"""Manual optimization and several optimizers under ZeRO (issue 43): one engine per optimizer.

A GAN-style LightningModule trains a generator and a discriminator, each with its own optimizer (SGD with momentum)
and its own LR scheduler, by hand: ``toggle_optimizer``, ``manual_backward``, ``clip_gradients`` per optimizer (the
generator's never triggers, the discriminator's always does), a step every two backward passes, ``zero_grad``,
``untoggle_optimizer``; the generator toggles through ``toggle_model(sync_grad=...)``, which also skips the
reduction of a backward pass that does not step. It trains through the real Trainer at 2 gloo ranks and is compared with the same module
trained by plain Lightning (``strategy="auto"``) in one process on the same global batches (the oracle): every
micro-batch's losses, each optimizer's gradient norm and the norm over all gradients before clipping
(``strategy.gradient_norm()``), and the weights at the end. SGD makes a wrong gradient scale show in the weights; the
generator's loss runs through the discriminator, so a discriminator that receives the generator's gradients (toggling
that does not reach the parameters) or the wrong engine stepping shows too. Checkpoints hold both optimizers and
resume at another world size (2 ranks -> 1 and 1 -> 2) as an uninterrupted run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from lightning.pytorch.utilities import grad_norm
from torch import nn
from torch.nn import functional
from torch.utils.data import DataLoader, Sampler, TensorDataset

from tests.distributed.checkpoint_bodies import ZERO1, ZERO2, StrategySpec, build_strategy
from tests.distributed.oracle import RegressionModule, float_state, quiet_trainer

FEATURES = 4
NOISE = 3
GLOBAL_BATCH = 4  # samples per micro-batch over all ranks
BATCHES_PER_EPOCH = 8
ACCUMULATE = 2  # backward passes per optimizer step
GENERATOR_CLIP = 100.0  # above every generator gradient norm: never clips
DISCRIMINATOR_CLIP = 0.05  # below every discriminator gradient norm: always clips
SEED = 11
# Several buckets per engine: each optimizer's step overlaps its engine's parameter exchange (zero/exchange.py).
SMALL_BUCKETS = {"bucket_size_mb": 0.0001}
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def make_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    real = torch.randn(GLOBAL_BATCH * BATCHES_PER_EPOCH, FEATURES, generator=generator) * 0.5 + 1.0
    noise = torch.randn(GLOBAL_BATCH * BATCHES_PER_EPOCH, NOISE, generator=generator)
    return TensorDataset(real, noise)


class RankBatches(Sampler[list[int]]):
    """Global micro-batch ``k`` is samples ``[k * GLOBAL_BATCH, (k + 1) * GLOBAL_BATCH)``; each rank reads its
    contiguous share, so one process reading whole global batches sees what all ranks see together, at any world
    size (no shuffling, no sampler Lightning injects)."""

    def __init__(self, world_size: int, rank: int) -> None:
        self.share = GLOBAL_BATCH // world_size
        self.rank = rank

    def __iter__(self) -> Any:
        for start in range(0, GLOBAL_BATCH * BATCHES_PER_EPOCH, GLOBAL_BATCH):
            first = start + self.rank * self.share
            yield list(range(first, first + self.share))

    def __len__(self) -> int:
        return BATCHES_PER_EPOCH


class GanModule(LightningModule):
    """Two models, two optimizers, manual optimization (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(NOISE, 16), nn.Tanh(), nn.Linear(16, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
        self.losses: list[tuple[float, float]] = []  # (generator, discriminator) per micro-batch
        # Per step, before clipping: the norm of the optimizer's gradients, of all gradients, and grad_norm's total.
        self.norms: list[tuple[float, float, float]] = []

    def training_step(self, batch: Any, batch_index: int) -> None:
        real, noise = batch
        generator_optimizer, discriminator_optimizer = self.optimizers()
        generator_scheduler, discriminator_scheduler = self.lr_schedulers()
        stepping = (batch_index + 1) % ACCUMULATE == 0

        # Lightning's other way to toggle, which also skips the gradient reduction of a backward pass that does not
        # step (only the generator's: the norm over all gradients at its step then reads the discriminator's half).
        with generator_optimizer.toggle_model(sync_grad=stepping):
            fake = self.generator(noise)
            generator_loss = functional.softplus(-self.discriminator(fake)).mean()
            self.manual_backward(generator_loss / ACCUMULATE)
        if stepping:
            self._step(generator_optimizer, generator_scheduler, GENERATOR_CLIP)

        self.toggle_optimizer(discriminator_optimizer)
        discriminator_loss = (
            functional.softplus(-self.discriminator(real)).mean()
            + functional.softplus(self.discriminator(fake.detach())).mean()
        )
        self.manual_backward(discriminator_loss / ACCUMULATE)
        if stepping:
            self._step(discriminator_optimizer, discriminator_scheduler, DISCRIMINATOR_CLIP)
        self.untoggle_optimizer(discriminator_optimizer)
        self.losses.append((generator_loss.item(), discriminator_loss.item()))

    def _step(self, optimizer: Any, scheduler: Any, clip: float) -> None:
        self.norms.append(self._gradient_norms(optimizer))
        self.clip_gradients(optimizer, gradient_clip_val=clip, gradient_clip_algorithm="norm")
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    def _gradient_norms(self, optimizer: Any) -> tuple[float, float, float]:
        strategy = self.trainer.strategy
        if hasattr(strategy, "engine_of"):  # a lightning_colossal engine strategy: norms over every rank's shards
            own = strategy.engine_of(optimizer).gradient_norm(optimizer.optimizer, 2.0)
            total = strategy.gradient_norms(self)["grad_2.0_norm_total"]
            return own.item(), strategy.gradient_norm().item(), total.item()
        stepped = [parameter for group in optimizer.param_groups for parameter in group["params"]]
        own = torch.nn.utils.get_total_norm([parameter.grad for parameter in stepped if parameter.grad is not None])
        every = [parameter.grad for parameter in self.parameters() if parameter.grad is not None]
        total = grad_norm(self, 2.0)["grad_2.0_norm_total"]
        return own.item(), torch.nn.utils.get_total_norm(every).item(), total.item()

    def configure_optimizers(self) -> Any:
        generator = torch.optim.SGD(self.generator.parameters(), lr=0.5, momentum=0.9)
        discriminator = torch.optim.SGD(self.discriminator.parameters(), lr=0.2, momentum=0.5)
        schedulers = [
            torch.optim.lr_scheduler.StepLR(generator, step_size=2, gamma=0.5),
            torch.optim.lr_scheduler.ExponentialLR(discriminator, gamma=0.8),
        ]
        return [generator, discriminator], schedulers

    def train_dataloader(self) -> DataLoader:
        sampler = RankBatches(self.trainer.world_size, self.trainer.global_rank)
        return DataLoader(make_dataset(), batch_sampler=sampler)


def fit_body(
    spec: StrategySpec | None, epochs: int, ckpt_path: str | None = None, save_to: str | None = None
) -> dict[str, Any]:
    """Train ``GanModule`` for ``epochs`` (resuming from ``ckpt_path``, saving to ``save_to`` after fit); ``spec=None``
    is the oracle: plain Lightning in one process."""
    seed_everything(SEED, verbose=False)
    module = GanModule()
    world_size = 1 if spec is None else torch.distributed.get_world_size()
    trainer = quiet_trainer(
        strategy="auto" if spec is None else build_strategy(spec),
        devices=world_size,
        max_epochs=epochs,
        use_distributed_sampler=False,  # RankBatches hands each rank its share
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    result = {"losses": module.losses, "norms": module.norms, "state": float_state(module)}
    if spec is not None:
        result["memory"] = engine_facts(trainer, module)
    return result


def engine_facts(trainer: Any, module: GanModule) -> dict[str, Any]:
    """The engines the strategy runs, what ``strategy.engine`` says then, and what MemoryMonitor counts with them
    against what it should count."""
    from lightning_colossal.callbacks.memory import measure_memory

    engines = trainer.strategy.engines
    try:
        single = f"strategy.engine is {trainer.strategy.engine!r}"
    except RuntimeError as error:  # several engines: no single one to hand out
        single = str(error)
    return {
        "engines": len(engines),
        "single": single,
        "measured": measure_memory(trainer, module),
        # The model's parameters once, and each engine's separate masters (offload).
        "parameters_bytes": sum(parameter.numel() * 4 for parameter in module.parameters())
        + sum(engine.memory_report().master_bytes for engine in engines),
        "optimizer_state_bytes": sum(engine.memory_report().optimizer_state_bytes for engine in engines),
        "disk_bytes": sum(engine.memory_report().disk_bytes for engine in engines),
    }


def initial_state_body() -> dict[str, torch.Tensor]:
    seed_everything(SEED, verbose=False)
    return float_state(GanModule())


ORACLES: dict[int, dict[str, Any]] = {}


def oracle(rank_pools: Any, epochs: int) -> dict[str, Any]:
    if epochs not in ORACLES:
        ORACLES[epochs] = rank_pools.get(1).run(fit_body, None, epochs, timeout=120)[0]
    return ORACLES[epochs]


def assert_same_weights(results: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    for result in results:
        torch.testing.assert_close(result["state"], expected["state"], **TOLERANCE)
    for result in results[1:]:
        torch.testing.assert_close(result["state"], results[0]["state"], rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize(
    "spec",
    [
        ("zero", {"stage": 1, **SMALL_BUCKETS}),
        ZERO2,
        ("zero", {"stage": 2, "cpu_offload": True, "stage2_accumulation": "local", **SMALL_BUCKETS}),
        # Each engine's optimizer state in a disk tier of its own (a directory per engine under offload_dir).
        ("zero", {"stage": 2, "cpu_offload": True, "offload_dir": "disk_tier", "disk_fraction": 1.0}),
    ],
    ids=["zero1-small-buckets", "zero2", "zero2-offload-local-small-buckets", "zero2-disk"],
)
def test_two_optimizers_by_hand_train_like_plain_lightning(rank_pool_2, rank_pools, spec):
    results = rank_pool_2.run(fit_body, spec, 1, timeout=120)
    expected = oracle(rank_pools, 1)
    assert len(expected["losses"]) == BATCHES_PER_EPOCH
    # Each rank's loss is the mean over its share of the global batch, the oracle's the mean over all of it.
    losses = torch.tensor([result["losses"] for result in results]).mean(dim=0)
    torch.testing.assert_close(losses, torch.tensor(expected["losses"]), **TOLERANCE)
    norms = torch.tensor(expected["norms"])
    generator_norms, discriminator_norms = norms[0::2, 0], norms[1::2, 0]
    assert (generator_norms < GENERATOR_CLIP).all() and (discriminator_norms > DISCRIMINATOR_CLIP).all(), norms
    for result in results:
        torch.testing.assert_close(torch.tensor(result["norms"]), norms, **TOLERANCE)
    for result in results:
        memory = result["memory"]
        assert memory["engines"] == 2
        assert "runs 2 engines here, one per optimizer: use `strategy.engines`" in memory["single"], memory["single"]
        assert memory["measured"]["parameters_bytes"] == memory["parameters_bytes"]
        assert memory["measured"]["optimizer_state_bytes"] == memory["optimizer_state_bytes"]
        assert memory["measured"].get("disk_bytes", 0) == memory["disk_bytes"]
        assert memory["optimizer_state_bytes"] + memory["disk_bytes"] > 0
    initial = rank_pool_2.run(initial_state_body, timeout=60)[0]
    assert all(not torch.equal(expected["state"][name], initial[name]) for name in initial), "everything trains"
    assert_same_weights(results, expected)


def test_checkpoint_holds_both_optimizers_and_resumes_at_another_world_size(rank_pool_2, rank_pools, tmp_path):
    expected = oracle(rank_pools, 2)
    one_rank = rank_pools.get(1)
    # Saved at 2 ranks after the first epoch, resumed at 1 rank for the second.
    path = str(tmp_path / "two_ranks.ckpt")
    rank_pool_2.run(fit_body, ZERO2, 1, None, path, timeout=120)
    resumed = one_rank.run(fit_body, ZERO2, 2, path, timeout=120)
    assert_same_weights(resumed, expected)
    # Saved at 1 rank, resumed at 2, across the stages.
    path = str(tmp_path / "one_rank.ckpt")
    one_rank.run(fit_body, ZERO2, 1, None, path, timeout=120)
    resumed = rank_pool_2.run(fit_body, ZERO1, 2, path, timeout=120)
    assert_same_weights(resumed, expected)
    assert Path(path).exists()


class ClearsGradientsBetweenBackwards(RegressionModule):
    """``zero_grad()`` between two backward passes of one step: ZeRO cannot drop what the first one reduced."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_index: int) -> None:
        optimizer = self.optimizers()
        inputs, targets = batch
        self.manual_backward(functional.mse_loss(self.model(inputs), targets))
        optimizer.zero_grad()
        self.manual_backward(functional.mse_loss(self.model(inputs), targets))
        optimizer.step()


class SharesAParameter(RegressionModule):
    """Two optimizers holding the same parameter: two engines would each shard it."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.model.output.parameters(), lr=0.1)]


def refusals_body() -> list[str]:
    messages = []
    for module in (ClearsGradientsBetweenBackwards(), SharesAParameter()):
        trainer = quiet_trainer(strategy=build_strategy(ZERO1), devices=torch.distributed.get_world_size(), max_steps=1)
        try:
            trainer.fit(module)
            messages.append("")
        except Exception as error:  # noqa: BLE001 - the message is the result
            messages.append(f"{type(error).__name__}: {error}")
    return messages


def test_what_the_engines_cannot_do_is_refused_with_the_fix(rank_pool_2):
    cleared, shared = rank_pool_2.run(refusals_body, timeout=120)[0]
    assert cleared.startswith("RuntimeError") and "zero_grad()` right after `optimizer.step()`" in cleared, cleared
    assert shared.startswith("ValueError") and "is in optimizer 0 and in optimizer 1" in shared, shared
    assert "belong to one optimizer only" in shared, shared
