"""The planner against the live engines on 2 CPU ranks.

- Model state: for each strategy, the planner's per-rank parameter, gradient and optimizer-state bytes equal, to the
  byte and on every rank, what ``MemoryMonitor`` measures from the engines (``memory_report()`` for ZeRO and Gemini,
  the real tensors for DDP and FSDP). The test model has odd row counts everywhere it can (vocabulary 65, width 21,
  qkv 63 rows, position table 17), so the two ranks own different numbers of rows and any mistake in the row
  split, the masters, the dtypes or Adam's ``step`` scalars shows.
- Activations: the planner's estimate against the bytes of the tensors autograd saves for backward in one training
  step under ``colossal_ddp`` (``saved_tensors_hooks``, shared storage counted once, parameters left out).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_colossal.callbacks import MemoryMonitor
from lightning_colossal.callbacks.memory_accounting import covered_bytes
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.module import GPTLightningModule
from lightning_colossal.planning.activations import Workload, activation_estimate
from lightning_colossal.planning.model_state import OPTIMIZERS, Training, model_state, owned_numel
from lightning_colossal.planning.settings import setting_named
from lightning_colossal.planning.sources import DemoOverrides, demo_model
from tests.distributed.oracle import quiet_trainer

# Odd row counts: the ranks own different numbers of rows of most parameters.
SHAPE = {"vocab_size": 65, "block_size": 17, "num_layers": 2, "num_heads": 3, "embed_dim": 21}
OVERRIDES = DemoOverrides(layers=2, hidden=21, heads=3, vocab=65, block_size=17)
SEQUENCE, MICRO_BATCH, STEPS = 16, 2, 2
WORLD_SIZE = 2
# The activation estimate must be within this factor of the measured saved bytes; docs/planner.md reports the error.
ACTIVATION_TOLERANCE = 0.03


def _loader(vocab_size: int, sequence: int, micro_batch: int) -> DataLoader:
    dataset = RandomTokenDataset(vocab_size=vocab_size, block_size=sequence, num_samples=8 * micro_batch, seed=5)
    return DataLoader(dataset, batch_size=micro_batch)


def _strategy(label: str) -> Any:
    """A registered name, or the fully offloaded Gemini placement the planner weighs (not a registered name)."""
    if label == "colossal_gemini (all offloaded)":
        from lightning_colossal import GeminiStrategy, StaticPlacement

        return GeminiStrategy(placement=StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0))
    return label


def monitored_body(strategy: str, precision: str) -> list[dict[str, int]]:
    """Train the test GPT under ``strategy``; this rank's model-state records, one per step."""
    rank = torch.distributed.get_rank()
    torch.manual_seed(3)
    module = GPTLightningModule(**SHAPE, warmup_steps=1)
    monitor = MemoryMonitor(log_every_n_steps=1)
    trainer = quiet_trainer(
        strategy=_strategy(strategy), devices=WORLD_SIZE, max_steps=STEPS, precision=precision, callbacks=[monitor]
    )
    trainer.fit(module, train_dataloaders=_loader(SHAPE["vocab_size"], SEQUENCE, MICRO_BATCH))
    keys = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "gemini_compute_bytes")
    return [
        {key: entry["ranks"][rank][key] for key in (*keys, "gemini_offload_bytes") if key in entry["ranks"][rank]}
        for entry in monitor.history
    ]


CASES = [
    ("colossal_ddp", "32-true"),
    ("colossal_zero1", "32-true"),
    ("colossal_zero2", "32-true"),
    ("colossal_zero2_offload", "32-true"),
    ("colossal_gemini", "32-true"),
    ("colossal_gemini_offload", "32-true"),
    ("colossal_fsdp", "32-true"),
    ("colossal_zero1_offload", "32-true"),
    ("colossal_fsdp_offload", "32-true"),
    ("colossal_gemini (all offloaded)", "32-true"),
    ("colossal_zero2", "bf16-mixed"),  # autocast: the same fp32 model state as 32-true
    # bf16 weights: ZeRO and Gemini add fp32 masters (and master gradients); DDP keeps bf16 Adam moments.
    ("colossal_zero1", "bf16-true"),
    ("colossal_gemini", "bf16-true"),
    ("colossal_ddp", "bf16-true"),
    ("colossal_zero2_offload", "bf16-true"),
    ("colossal_fsdp", "bf16-true"),
]


@pytest.mark.parametrize(("strategy", "precision"), CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_model_state_bytes_equal_the_engines_exactly(rank_pool_2, strategy, precision):
    model = demo_model(OVERRIDES)
    assert owned_numel(model.shapes, WORLD_SIZE, 0) != owned_numel(model.shapes, WORLD_SIZE, 1), "uneven shards"
    setting = setting_named(strategy)
    training = Training(precision, OPTIMIZERS["adamw"], device_type="cpu")
    results = rank_pool_2.run(monitored_body, strategy, precision, timeout=300)
    for rank, records in enumerate(results):
        planned = model_state(model.shapes, setting, training, WORLD_SIZE, rank)
        expected = (planned.parameters.total, planned.gradients.total, planned.optimizer_state.total)
        assert len(records) == STEPS
        for record in records:
            measured = (record["parameters_bytes"], record["gradients_bytes"], record["optimizer_state_bytes"])
            assert measured == expected, (strategy, precision, rank, record, planned)
        if setting.family == "gemini":
            _assert_gemini_placement(records[-1], planned, setting.offload, len(model.shapes))


def _assert_gemini_placement(record: dict[str, int], planned: Any, offloaded: bool, tensors: int) -> None:
    """Device vs host agree with Gemini's chunk accounting, which files Adam's 4-byte ``step`` scalars with the
    masters' location while the planner puts them where torch keeps them, on the CPU."""
    steps = 4 * tensors
    placed = planned.placed
    if offloaded:
        assert (record["gemini_compute_bytes"], record["gemini_offload_bytes"]) == (placed.device, placed.host)
    else:
        assert (record["gemini_compute_bytes"], record["gemini_offload_bytes"]) == (placed.device + steps, 0)
        assert placed.host == steps


class SavedTensorModule(GPTLightningModule):
    """Records the bytes autograd saves for backward in the first training step's forward (and loss)."""

    saved_bytes: int | None = None

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx > 0:
            return super().training_step(batch, batch_idx)
        parameters = {parameter.untyped_storage().data_ptr() for parameter in self.parameters()}
        saved: list[torch.Tensor] = []

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            saved.append(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = super().training_step(batch, batch_idx)
        activations = [tensor for tensor in saved if tensor.untyped_storage().data_ptr() not in parameters]
        self.saved_bytes = covered_bytes(activations)
        return loss


ACTIVATION_SHAPE = {"vocab_size": 256, "block_size": 64, "num_layers": 2, "num_heads": 4, "embed_dim": 64}


def saved_bytes_body(precision: str) -> int | None:
    torch.manual_seed(3)
    module = SavedTensorModule(**ACTIVATION_SHAPE, warmup_steps=1)
    trainer = quiet_trainer(strategy="colossal_ddp", devices=WORLD_SIZE, max_steps=1, precision=precision)
    trainer.fit(module, train_dataloaders=_loader(256, 64, 4))
    return module.saved_bytes


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_activation_estimate_matches_saved_tensors_of_a_training_step(rank_pool_2, precision):
    model = demo_model(DemoOverrides(layers=2, hidden=64, heads=4, vocab=256, block_size=64))
    training = Training(precision, OPTIMIZERS["adamw"], device_type="cpu")
    estimate = activation_estimate(model, training, Workload(micro_batch_size=4, sequence_length=64)).total
    for measured in rank_pool_2.run(saved_bytes_body, precision, timeout=300):
        assert measured is not None and measured > 0
        error = estimate / measured - 1
        print(f"{precision}: estimated {estimate} B, measured {measured} B, error {error:+.2%}")
        assert abs(error) <= ACTIVATION_TOLERANCE, (precision, estimate, measured, error)


def disk_body(
    base: str,
    fraction: float,
    precision: str,
    offload_dir: str,
    masters_on_disk: bool = False,
    optimizer: str = "adamw",
) -> list[dict[str, int]]:
    """Train the test GPT with ``fraction`` of ``base``'s offloaded optimizer state (and with ``masters_on_disk`` its
    masters) on disk, stepped by AdamW or plain SGD (``"sgd"``: no state, only masters to move); per step, this rank's
    model-state records and the disk tier's bytes, as ``MemoryMonitor`` logs them."""
    from lightning_colossal import GeminiStrategy, StaticPlacement, ZeroStrategy

    rank = torch.distributed.get_rank()
    torch.manual_seed(3)
    module = GPTLightningModule(**SHAPE, warmup_steps=1)
    if optimizer == "sgd":
        module.configure_optimizers = lambda: torch.optim.SGD(module.parameters(), lr=0.01)  # type: ignore[method-assign]
    monitor = MemoryMonitor(log_every_n_steps=1)
    if base == "colossal_gemini_offload":
        placement = StaticPlacement(offload_optim_frac=1.0, disk_fraction=fraction)
        strategy: Any = GeminiStrategy(placement=placement, offload_dir=offload_dir, masters_on_disk=masters_on_disk)
    else:
        strategy = ZeroStrategy(
            stage=2,
            cpu_offload=True,
            offload_dir=offload_dir,
            disk_fraction=fraction,
            masters_on_disk=masters_on_disk,
        )
    trainer = quiet_trainer(
        strategy=strategy, devices=WORLD_SIZE, max_steps=STEPS, precision=precision, callbacks=[monitor]
    )
    trainer.fit(module, train_dataloaders=_loader(SHAPE["vocab_size"], SEQUENCE, MICRO_BATCH))
    keys = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "disk_bytes", "disk_staging_bytes")
    return [{key: entry["ranks"][rank][key] for key in keys} for entry in monitor.history]


# The last field: masters_on_disk. Gemini's fp32 shards on CPU ranks are their own masters (nothing moves: the
# planner must say so too); its bf16 chunks and ZeRO's offloaded shards have separate masters, which move.
# Plain SGD keeps no state: only its masters go to disk, in records of masters alone.
DISK_CASES = [
    ("colossal_zero2_offload", 1.0, "32-true", False, "adamw"),
    ("colossal_zero2_offload", 0.5, "bf16-true", False, "adamw"),
    ("colossal_gemini_offload", 1.0, "32-true", False, "adamw"),
    ("colossal_gemini_offload", 1.0, "bf16-true", False, "adamw"),
    ("colossal_zero2_offload", 0.5, "32-true", True, "adamw"),
    ("colossal_gemini_offload", 1.0, "bf16-true", True, "adamw"),
    ("colossal_gemini_offload", 1.0, "32-true", True, "adamw"),
    ("colossal_zero2_offload", 1.0, "bf16-true", True, "sgd"),
    ("colossal_gemini_offload", 1.0, "bf16-true", True, "sgd"),
]


@pytest.mark.parametrize(
    ("base", "fraction", "precision", "masters_on_disk", "optimizer"),
    DISK_CASES,
    ids=[f"{b}-{f}-{p}{'-masters' if m else ''}{'-sgd' if o == 'sgd' else ''}" for b, f, p, m, o in DISK_CASES],
)
def test_disk_tier_bytes_equal_the_engines_exactly(
    rank_pool_2, tmp_path, base, fraction, precision, masters_on_disk, optimizer
):
    from lightning_colossal.planning.model_state import disk_records_of
    from lightning_colossal.planning.settings import disk_setting

    model = demo_model(OVERRIDES)
    setting = disk_setting(base, fraction, str(tmp_path), masters_on_disk)
    training = Training(precision, OPTIMIZERS[optimizer], device_type="cpu")
    results = rank_pool_2.run(
        disk_body, base, fraction, precision, str(tmp_path), masters_on_disk, optimizer, timeout=300
    )
    for rank, records in enumerate(results):
        planned = model_state(model.shapes, setting, training, WORLD_SIZE, rank)
        staging = disk_records_of(model.shapes, setting, training, WORLD_SIZE, rank).staging_bytes
        assert planned.placed.disk > 0
        expected = (
            planned.parameters.in_memory,
            planned.gradients.in_memory,
            planned.optimizer_state.in_memory,
            planned.placed.disk,
            staging,
        )
        for record in records:
            measured = (
                record["parameters_bytes"],
                record["gradients_bytes"],
                record["optimizer_state_bytes"],
                record["disk_bytes"],
                record["disk_staging_bytes"],
            )
            assert measured == expected, (base, fraction, precision, rank, record, planned)
