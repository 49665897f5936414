"""The disk tier (``lightning_colossal/disk``) under Gemini (static and automatic placement) and ZeRO offload.

Exactness: a run with optimizer state on disk equals the same run with it in memory bit for bit (the streamed step
narrows the optimizer to a few parameters at a time: [Note: streaming the optimizer step]), with AdamW and with SGD
momentum, fp32 and bf16-true, and matches the single-process oracle. Crash safety: the tier's directory exists only
while its engine does, is never mistaken for a checkpoint, and a full disk is an error before training (free space
checked against the planned bytes) or, mid-run, an error naming the directory with the last checkpoint intact.
Checkpoints: a checkpoint saved with the disk tier resumes under another strategy exactly like one saved without it.
Masters on disk (ZeRO's ``masters_on_disk``): the same exactness and checkpoints, with the masters' host bytes moved
into the tier's file.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_colossal import AutoPlacement, GeminiStrategy, HybridParallelStrategy, StaticPlacement, ZeroStrategy
from lightning_colossal.config import ZeroConfig
from lightning_colossal.disk.files import TIER_PREFIX, DiskTierFull
from lightning_colossal.disk.optimizer_state import DiskOptimizerState, is_placeholder
from lightning_colossal.engine_parts import stand_ins
from tests.distributed.oracle import (
    RegressionModule,
    assert_matches_oracle,
    float_state,
    new_module,
    oracle_train,
    quiet_trainer,
)

STEPS = 4
SMALL_CHUNKS = 1100  # two chunks of RegressionModule (test_gemini_oracle.py)


def _strategy(kind: str, offload_dir: str | None, **extra: Any) -> Any:
    if kind == "gemini-static":
        placement = StaticPlacement(offload_optim_frac=1.0, disk_fraction=1.0 if offload_dir else 0.0)
        return GeminiStrategy(placement=placement, chunk_numel=SMALL_CHUNKS, offload_dir=offload_dir, **extra)
    if kind == "gemini-static-masters":  # with bf16 weights the masters are separate, and go to disk too
        placement = StaticPlacement(offload_optim_frac=1.0, disk_fraction=1.0 if offload_dir else 0.0)
        return GeminiStrategy(
            placement=placement,
            chunk_numel=SMALL_CHUNKS,
            offload_dir=offload_dir,
            masters_on_disk=offload_dir is not None,
            **extra,
        )
    if kind == "gemini-half-on-disk":
        # Only the first chunk's state on disk: the second steps in memory in the same optimizer step.
        placement = StaticPlacement(offload_optim_frac=1.0, disk_fraction=0.5 if offload_dir else 0.0)
        return GeminiStrategy(placement=placement, chunk_numel=SMALL_CHUNKS, offload_dir=offload_dir, **extra)
    if kind == "zero2-offload":
        # A tiny bucket size: several records, so reads, steps and writes overlap.
        return ZeroStrategy(
            stage=2,
            cpu_offload=True,
            bucket_size_mb=0.001,
            offload_dir=offload_dir,
            disk_fraction=1.0 if offload_dir else 0.0,
            **extra,
        )
    if kind == "zero2-offload-masters":
        return _zero_masters(offload_dir, 1.0, offload_dir is not None)
    if kind in ("hybrid-zero1-offload", "hybrid-zero1-offload-masters"):
        zero = ZeroConfig(
            stage=1,
            cpu_offload=True,
            bucket_size_mb=0.001,
            offload_dir=offload_dir,
            disk_fraction=1.0 if offload_dir else 0.0,
            masters_on_disk=kind.endswith("masters") and offload_dir is not None,
        )
        return HybridParallelStrategy(zero=zero, **extra)
    raise AssertionError(kind)


def _disk_state(engine: Any) -> Any:
    """The engine's disk tier (the hybrid engine's is its ZeRO part's)."""
    return engine.data_parallel.disk_state if hasattr(engine, "data_parallel") else engine.disk_state


def _train_body(
    kind: str, offload_dir: str | None, precision: str, optimizer: str, steps: int = STEPS
) -> dict[str, Any]:
    module = training_module(wide=False, optimizer=optimizer)
    trainer = quiet_trainer(
        strategy=_strategy(kind, offload_dir),
        devices=torch.distributed.get_world_size(),
        max_steps=steps,
        precision=precision,
    )
    tier_directories: list[str] = []
    trainer.fit(module)
    disk_state = _disk_state(trainer.strategy.engine)
    if disk_state is not None:
        tier_directories.append(str(disk_state.file.directory.path))
        assert Path(tier_directories[0]).is_dir()
        assert (Path(tier_directories[0]) / "NOT_A_CHECKPOINT.txt").exists()
    return {
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
        "disk_bytes": 0 if disk_state is None else disk_state.planned_bytes,
        "tier_directories": tier_directories,
    }


@pytest.mark.parametrize(
    "kind",
    [
        "gemini-static",
        "gemini-half-on-disk",
        "zero2-offload",
        "zero2-offload-masters",
        "hybrid-zero1-offload",
        "hybrid-zero1-offload-masters",
    ],
)
def test_disk_tier_equals_memory_bit_for_bit(rank_pool_2, tmp_path, kind):
    on_disk = rank_pool_2.run(_train_body, kind, str(tmp_path), "32-true", "adamw")
    in_memory = rank_pool_2.run(_train_body, kind, None, "32-true", "adamw")
    for disk_rank, memory_rank in zip(on_disk, in_memory, strict=True):
        assert disk_rank["disk_bytes"] > 0, "nothing went to disk: the test would not test the tier"
        assert memory_rank["disk_bytes"] == 0
        assert disk_rank["losses"] == memory_rank["losses"]
        for name, value in memory_rank["parameters"].items():
            assert torch.equal(disk_rank["parameters"][name], value), name
    assert_matches_oracle(on_disk, oracle_train(world_size=2, steps=STEPS), accumulate=1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kind", "precision", "optimizer"),
    [("gemini-static", "bf16-true", "adamw"), ("zero2-offload", "32-true", "sgd"), ("gemini-static", "32-true", "sgd")],
)
def test_disk_tier_exact_for_other_precisions_and_optimizers(rank_pool_2, tmp_path, kind, precision, optimizer):
    on_disk = rank_pool_2.run(_train_body, kind, str(tmp_path), precision, optimizer)
    in_memory = rank_pool_2.run(_train_body, kind, None, precision, optimizer)
    for disk_rank, memory_rank in zip(on_disk, in_memory, strict=True):
        assert disk_rank["disk_bytes"] > 0
        for name, value in memory_rank["parameters"].items():
            assert torch.equal(disk_rank["parameters"][name], value), name


class WithUnusedLayer(RegressionModule):
    """RegressionModule with a layer its forward never uses: no gradient ever reaches it (a pooler a fine-tuning head
    skips, say), so the optimizer never creates state for it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)


def _unused_layer_body(
    kind: str, offload_dir: str | None, precision: str, save_to: str | None, resume_from: str | None
) -> dict[str, Any]:
    torch.manual_seed(0)
    module = WithUnusedLayer()
    trainer = quiet_trainer(
        strategy=_strategy(kind, offload_dir),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS if resume_from is None else STEPS + 2,
        precision=precision,
    )
    trainer.fit(module, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    disk_state = _disk_state(trainer.strategy.engine)
    stateless = sum(len(record.stateless) for record in disk_state.records) if disk_state is not None else 0
    return {"losses": module.micro_batch_losses, "parameters": float_state(module), "stateless": stateless}


@pytest.mark.parametrize(
    ("kind", "precision"),
    [
        ("gemini-static", "32-true"),
        ("gemini-static-masters", "bf16-true"),
        ("zero2-offload", "32-true"),
        ("zero2-offload-masters", "bf16-true"),
        ("hybrid-zero1-offload", "32-true"),
    ],
)
def test_a_parameter_without_gradients_trains_and_resumes_like_in_memory(rank_pool_2, tmp_path, kind, precision):
    # The optimizer keeps no state for it: the tier must not demand any (it refused the first step), nor invent any
    # (in a checkpoint, or after a resume).
    tier = str(tmp_path / "tier")
    with_tier, without = str(tmp_path / "tier.ckpt"), str(tmp_path / "memory.ckpt")
    runs = {
        "trained": (
            rank_pool_2.run(_unused_layer_body, kind, tier, precision, with_tier, None),
            rank_pool_2.run(_unused_layer_body, kind, None, precision, without, None),
        ),
        "resumed": (
            rank_pool_2.run(_unused_layer_body, kind, tier, precision, None, with_tier),
            rank_pool_2.run(_unused_layer_body, kind, None, precision, None, without),
        ),
    }
    for stage, (on_disk, in_memory) in runs.items():
        assert all(rank["stateless"] > 0 for rank in on_disk), (stage, on_disk)
        for disk_rank, memory_rank in zip(on_disk, in_memory, strict=True):
            assert disk_rank["losses"] == memory_rank["losses"], stage
            for name, value in memory_rank["parameters"].items():
                assert torch.equal(disk_rank["parameters"][name], value), (stage, name)


WIDE_CHUNKS = 8192  # elements per chunk of WideRegression: 9 chunks, 4,096 elements of each per rank


class WideRegression(RegressionModule):
    """RegressionModule's data and loss with a 64-wide hidden stack of 8 layers (33.9k parameters): enough state
    per rank (271 kB with AdamW) for records larger than the tier's 4 KiB alignment, so moving state to disk saves
    more host memory than its staging buffers cost (not so for RegressionModule's 1.4k parameters)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = [torch.nn.Linear(8, 64), torch.nn.Tanh()]
        for _ in range(8):
            layers += [torch.nn.Linear(64, 64), torch.nn.Tanh()]
        self.model = torch.nn.Sequential(*layers, torch.nn.Linear(64, 1))


def training_module(wide: bool, optimizer: str) -> RegressionModule:
    """RegressionModule (``WideRegression`` when ``wide``) stepped by AdamW, by SGD with momentum (``"sgd"``), or by
    plain SGD, which keeps no state: only the masters can go to disk (``"plain-sgd"``)."""
    if wide:
        torch.manual_seed(0)
        module: RegressionModule = WideRegression()
    else:
        module = new_module()
    if optimizer in ("sgd", "plain-sgd"):
        momentum = 0.9 if optimizer == "sgd" else 0.0

        def configure_optimizers() -> Any:
            return torch.optim.SGD(module.parameters(), lr=0.05, momentum=momentum, weight_decay=0.01)

        module.configure_optimizers = configure_optimizers  # type: ignore[method-assign]
    return module


def _host_budget_body(offload_dir: str | None, budget: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = WideRegression()
    placement = AutoPlacement(host_memory_budget=budget if offload_dir else None)
    strategy = GeminiStrategy(placement=placement, chunk_numel=WIDE_CHUNKS, offload_dir=offload_dir)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=STEPS)
    trainer.fit(module)
    report = trainer.strategy.engine.memory_report()
    return {
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
        "disk_bytes": report.disk_bytes,
        # Everything automatic placement may keep on the host (every shard counted there: it may park any) plus the
        # tier's staging buffers: what host_memory_budget bounds.
        "host_bytes": report.chunks.shard
        + report.chunks.master
        + report.chunks.gradient
        + report.chunks.optimizer_state
        + report.disk_staging_bytes,
        "staging_bytes": report.disk_staging_bytes,
    }


def test_host_budget_counts_the_staging_buffers_and_stays_exact(rank_pool_2, tmp_path):
    in_memory = rank_pool_2.run(_host_budget_body, None, 0)
    whole = max(rank["host_bytes"] for rank in in_memory)
    # Three quarters of what the run holds in memory: met with some chunks' state on disk, but with more of it once
    # the staging buffers are counted (without them this rank's host bytes exceed the budget: planted, it fails).
    budget = whole * 3 // 4
    on_disk = rank_pool_2.run(_host_budget_body, str(tmp_path), budget)
    for disk_rank, memory_rank in zip(on_disk, in_memory, strict=True):
        assert disk_rank["disk_bytes"] > 0 and disk_rank["staging_bytes"] > 0
        assert disk_rank["host_bytes"] <= budget, (disk_rank["host_bytes"], budget)
        assert disk_rank["losses"] == memory_rank["losses"]
        for name, value in memory_rank["parameters"].items():
            assert torch.equal(disk_rank["parameters"][name], value), name


def _one_rank_over_budget_body(offload_dir: str) -> str:
    """Only rank 0 gets a budget too small for its share (as when the ranks' shares differ by a few rows)."""
    from lightning_colossal.gemini.placement import HostBudgetTooSmall

    budget = 1 if torch.distributed.get_rank() == 0 else 2**40
    try:
        _host_budget_body(offload_dir, budget)
    except HostBudgetTooSmall as error:
        return str(error)
    return "trained"


def test_a_rank_over_the_host_budget_stops_every_rank_with_the_budget_error(rank_pool_2, tmp_path):
    # Without the agreement rank 1 would train into its first gather and wait there for rank 0 until the timeout.
    first, second = rank_pool_2.run(_one_rank_over_budget_body, str(tmp_path), timeout=120)
    assert "more than host_memory_budget=1" in first, first
    assert second.startswith("Another rank's model state does not fit host_memory_budget"), second


def _tier_lifetime_body(offload_dir: str) -> dict[str, Any]:
    import gc

    module = new_module()
    trainer = quiet_trainer(
        strategy=_strategy("gemini-static", offload_dir), devices=torch.distributed.get_world_size(), max_steps=2
    )
    trainer.fit(module)
    during = sorted(path.name for path in Path(offload_dir).glob(f"{TIER_PREFIX}*"))
    trainer.strategy.engine.close_disk_tier()
    after_close = sorted(path.name for path in Path(offload_dir).glob(f"{TIER_PREFIX}*"))
    del trainer, module
    gc.collect()
    return {"during": during, "after": after_close}


def test_tier_directory_per_rank_and_removed_when_closed(rank_pool_2, tmp_path):
    results = rank_pool_2.run(_tier_lifetime_body, str(tmp_path))
    names = {name for result in results for name in result["during"]}
    assert len(names) == 2, names  # one per rank, never shared
    assert all(result["after"] == [] or set(result["after"]) < names for result in results)
    assert not list(tmp_path.glob(f"{TIER_PREFIX}*")), "a closed tier left its directory behind"


def _disk_full_before_training_body(offload_dir: str) -> str:
    import shutil

    real = shutil.disk_usage

    def tiny(path: Any) -> Any:
        usage = real(path)
        return usage._replace(free=100)

    shutil.disk_usage = tiny  # type: ignore[assignment]
    module = new_module()
    trainer = quiet_trainer(
        strategy=_strategy("zero2-offload", offload_dir), devices=torch.distributed.get_world_size(), max_steps=2
    )
    try:
        trainer.fit(module)
    except DiskTierFull as error:
        return f"{trainer.global_step}|{error}"
    finally:
        shutil.disk_usage = real  # type: ignore[assignment]
    return "trained"


def test_full_disk_is_refused_before_training(rank_pool_2, tmp_path):
    results = rank_pool_2.run(_disk_full_before_training_body, str(tmp_path))
    for result in results:
        step, message = result.split("|", 1)
        assert step == "0"
        assert str(tmp_path.resolve()) in message and "Nothing was written" in message
    assert not list(tmp_path.glob(f"{TIER_PREFIX}*")), "the refused tier left its directory"


def _disk_fills_mid_run_body(offload_dir: str, checkpoint_dir: str) -> dict[str, Any]:
    from lightning_colossal.disk import files

    real_pwritev = os.pwritev
    calls = {"count": 0}

    def failing_after_a_while(descriptor: int, buffers: Any, offset: int) -> int:
        calls["count"] += 1
        if calls["count"] > 12:  # a few steps in (each step writes a few records)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwritev(descriptor, buffers, offset)

    files.os.pwritev = failing_after_a_while  # type: ignore[attr-defined]
    module = new_module()
    trainer = quiet_trainer(
        strategy=_strategy("zero2-offload", offload_dir),
        devices=torch.distributed.get_world_size(),
        max_steps=50,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoint_dir, every_n_train_steps=1, save_top_k=1)],
    )
    message = ""
    try:
        trainer.fit(module)
    except DiskTierFull as error:
        message = str(error)
    finally:
        files.os.pwritev = real_pwritev  # type: ignore[attr-defined]
    return {"message": message, "step": trainer.global_step}


def _resume_body(checkpoint: str) -> dict[str, Any]:
    module = new_module()
    trainer = quiet_trainer(strategy=ZeroStrategy(stage=2), devices=torch.distributed.get_world_size(), max_steps=1)
    trainer.fit(module, ckpt_path=checkpoint)
    return {"step": trainer.global_step}


@pytest.mark.slow
def test_disk_filling_mid_run_names_the_directory_and_keeps_the_last_checkpoint(rank_pool_2, tmp_path):
    tier = tmp_path / "tier"
    checkpoints = tmp_path / "checkpoints"
    results = rank_pool_2.run(_disk_fills_mid_run_body, str(tier), str(checkpoints))
    assert all(result["message"] for result in results), results  # every rank stopped with the tier's error
    assert all(str(tier.resolve()) in result["message"] for result in results)
    assert any("ran out of space" in result["message"] for result in results)
    saved = sorted(checkpoints.glob("*.ckpt"))
    assert len(saved) == 1, saved
    resumed = rank_pool_2.run(_resume_body, str(saved[0]))
    assert all(result["step"] >= 1 for result in resumed)


@contextlib.contextmanager
def _entry_by_entry() -> Iterator[dict[str, int]]:
    """Within: reading the whole on-disk state into host memory fails, and the checkpoint's reads and writes of
    single entries through the tier's stand-ins are counted ([Note: deferred tensors])."""
    counts = {"reads": 0, "writes": 0, "most_values_held": 0}
    read, write = DiskOptimizerState._read_entry, DiskOptimizerState._write_entry
    values: list[torch.Tensor] = []

    def counted_read(self: Any, *args: Any) -> Any:
        counts["reads"] += 1
        # Entries read before and still holding memory (DCP's writer keeps a reference to each until its file is
        # closed): the save must have let them go.
        held = sum(1 for value in values if value.untyped_storage().nbytes() > 0)
        counts["most_values_held"] = max(counts["most_values_held"], held)
        value = read(self, *args)
        values.append(value)
        return value

    def counted_write(self: Any, *args: Any) -> Any:
        counts["writes"] += 1
        return write(self, *args)

    def refused(self: Any) -> None:
        raise AssertionError("the checkpoint read the whole on-disk optimizer state into host memory")

    patches = {"_read_entry": counted_read, "_write_entry": counted_write, "materialise": refused}
    saved = {name: getattr(DiskOptimizerState, name) for name in patches}
    for name, replacement in patches.items():
        setattr(DiskOptimizerState, name, replacement)
    try:
        yield counts
    finally:
        for name, original in saved.items():
            setattr(DiskOptimizerState, name, original)


def _save_body(kind: str, offload_dir: str | None, checkpoint: str) -> dict[str, Any]:
    module = new_module()
    strategy = "ddp" if kind == "lightning-ddp" else _strategy(kind, offload_dir)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=3)
    trainer.fit(module)
    with _entry_by_entry() as counts:
        trainer.save_checkpoint(checkpoint)
    engine = getattr(trainer.strategy, "engine", None)
    disk_state = engine and _disk_state(engine)
    if disk_state is not None:
        # The checkpoint read the state entry by entry; once written, host memory holds none of it again.
        entries = [e for record in disk_state.records for e in record.entries]
        assert counts["reads"] == len(entries) and counts["writes"] == 0, counts
        assert counts["most_values_held"] == 0, counts
        state = disk_state.optimizer.state
        assert all(is_placeholder(state[e.master][e.key]) for e in entries)
        assert not stand_ins._REGISTRY, "stand-ins outlived the save"
    return {}


def _resume_and_train_body(
    kind: str, offload_dir: str | None, checkpoint: str, whole_file: bool = False
) -> dict[str, Any]:
    module = new_module()
    strategy = _strategy(kind, offload_dir) if kind != "ddp" else "colossal_ddp"
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=6)
    if whole_file:  # a checkpoint without shards is read whole: so is the state it is copied into
        trainer.fit(module, ckpt_path=checkpoint)
        return {"parameters": float_state(module)}
    with _entry_by_entry() as counts:
        trainer.fit(module, ckpt_path=checkpoint)
    if offload_dir is not None and kind != "ddp":
        # The load filled the state entry by entry, writing each record as it completed.
        assert counts["writes"] > 0, counts
    return {"parameters": float_state(module)}


@pytest.mark.parametrize(
    "kind", ["gemini-static", "zero2-offload", "zero2-offload-masters", "hybrid-zero1-offload-masters"]
)
def test_checkpoint_with_disk_tier_resumes_anywhere_like_one_without(rank_pool_2, tmp_path, kind):
    with_disk = str(tmp_path / "with_disk.ckpt")
    without = str(tmp_path / "without.ckpt")
    rank_pool_2.run(_save_body, kind, str(tmp_path / "tier"), with_disk)
    rank_pool_2.run(_save_body, kind, None, without)
    # Resume the disk tier's checkpoint with the disk tier, in memory, and under colossal_ddp: each equals resuming
    # the checkpoint saved without the tier the same way.
    resumed = {}
    for resume_kind, resume_dir in [(kind, str(tmp_path / "tier2")), (kind, None), ("ddp", None)]:
        from_disk = rank_pool_2.run(_resume_and_train_body, resume_kind, resume_dir, with_disk)
        from_memory = rank_pool_2.run(_resume_and_train_body, resume_kind, resume_dir, without)
        for a, b in zip(from_disk, from_memory, strict=True):
            for name, value in b["parameters"].items():
                assert torch.equal(a["parameters"][name], value), (resume_kind, resume_dir, name)
        resumed[resume_dir is not None] = from_memory
    # Loading into the tier (entry by entry) equals loading into memory, bit for bit.
    for a, b in zip(resumed[True], resumed[False], strict=True):
        for name, value in b["parameters"].items():
            assert torch.equal(a["parameters"][name], value), ("loaded into the tier", name)


@pytest.mark.parametrize("kind", ["gemini-static", "zero2-offload-masters"])
def test_plain_lightning_checkpoint_resumes_into_the_tier_like_into_memory(rank_pool_2, tmp_path, kind):
    # Lightning's own ddp writes one whole file: its optimizer state arrives as whole tensors, which are copied into
    # the live state (read from the tier first, then written back; with masters on disk the records keep the masters
    # loaded from the file's weights).
    plain = str(tmp_path / "plain.ckpt")
    rank_pool_2.run(_save_body, "lightning-ddp", None, plain)
    into_tier = rank_pool_2.run(_resume_and_train_body, kind, str(tmp_path / "tier"), plain, True)
    into_memory = rank_pool_2.run(_resume_and_train_body, kind, None, plain, True)
    for a, b in zip(into_tier, into_memory, strict=True):
        for name, value in b["parameters"].items():
            assert torch.equal(a["parameters"][name], value), name


def _interrupted_body(offload_dir: str, checkpoint_dir: str, where: str) -> None:
    """Train with a checkpoint every step; in the third step (``where="step"``: while the disk tier streams the
    optimizer state) or during the third checkpoint save (``where="save"``) every rank SIGKILLs itself."""
    import signal

    from lightning_colossal.checkpoint import sharded
    from lightning_colossal.disk.optimizer_state import DiskOptimizerState

    module = new_module()
    trainer = quiet_trainer(
        strategy=_strategy("zero2-offload", offload_dir),
        devices=torch.distributed.get_world_size(),
        max_steps=6,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoint_dir, filename="last", every_n_train_steps=1, save_top_k=1)],
    )
    if where == "step":
        real_bind = DiskOptimizerState._bind

        def bind_then_die(self: DiskOptimizerState, record: Any, slot: Any) -> None:
            real_bind(self, record, slot)
            if trainer.global_step == 2:  # the third step, first record read back from disk
                os.kill(os.getpid(), signal.SIGKILL)

        DiskOptimizerState._bind = bind_then_die  # type: ignore[method-assign]
    else:
        real_save = sharded.dcp.save
        saves = {"count": 0}

        def save_then_die(*args: Any, **kwargs: Any) -> Any:
            saves["count"] += 1
            result = real_save(*args, **kwargs)
            if saves["count"] == 3:  # shards of the third checkpoint written, not yet committed
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        sharded.dcp.save = save_then_die  # type: ignore[assignment]
    trainer.fit(module)


def _checkpointed_body(offload_dir: str, checkpoint_dir: str, steps: int) -> None:
    module = new_module()
    trainer = quiet_trainer(
        strategy=_strategy("zero2-offload", offload_dir),
        devices=torch.distributed.get_world_size(),
        max_steps=steps,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoint_dir, filename="last", every_n_train_steps=1, save_top_k=1)],
    )
    trainer.fit(module)


def _resume_with_tier_body(offload_dir: str, checkpoint: str) -> dict[str, Any]:
    before = sorted(path.name for path in Path(offload_dir).glob(f"{TIER_PREFIX}*"))
    torch.distributed.barrier()  # every rank looked before any rank's tier removed the killed run's directories
    module = new_module()
    trainer = quiet_trainer(
        strategy=_strategy("zero2-offload", offload_dir), devices=torch.distributed.get_world_size(), max_steps=6
    )
    trainer.fit(module, ckpt_path=checkpoint)
    after = sorted(path.name for path in Path(offload_dir).glob(f"{TIER_PREFIX}*"))
    return {"parameters": float_state(module), "before": before, "after": after, "resumed_at": trainer.global_step}


@pytest.mark.slow
@pytest.mark.parametrize("where", ["step", "save"])
def test_ranks_killed_mid_step_or_mid_save_resume_exactly_and_leave_nothing_behind(rank_pool_2, tmp_path, where):
    from tests.harness.rank_pool import RankFailure

    tier, checkpoints = tmp_path / "tier", tmp_path / "checkpoints"
    with pytest.raises(RankFailure):
        rank_pool_2.run(_interrupted_body, str(tier), str(checkpoints), where)
    left = {path.name for path in tier.glob(f"{TIER_PREFIX}*")}
    assert left, "the killed ranks left no directory: the test would not test the cleanup"
    saved = sorted(checkpoints.glob("*.ckpt"))
    assert [path.name for path in saved] == ["last.ckpt"], sorted(checkpoints.iterdir())
    resumed = rank_pool_2.run(_resume_with_tier_body, str(tier), str(saved[0]))
    # The same run not interrupted: checkpointed after step 2 (what the killed run's last checkpoint holds) and resumed
    # the same way (a resume restarts the epoch's batches).
    reference_checkpoints = tmp_path / "reference"
    rank_pool_2.run(_checkpointed_body, str(tmp_path / "reference_tier"), str(reference_checkpoints), 2)
    straight = rank_pool_2.run(
        _resume_with_tier_body, str(tmp_path / "reference_tier"), str(reference_checkpoints / "last.ckpt")
    )
    for rank_result, reference in zip(resumed, straight, strict=True):
        assert left <= set(rank_result["before"])
        assert not left & set(rank_result["after"]), "the killed run's tier directories survived the next run"
        for name, value in reference["parameters"].items():
            assert torch.equal(rank_result["parameters"][name], value), name


# ---------------------------------------------------------------------------------------------- masters on disk
# ZeRO's fp32 masters of the shards whose optimizer state is on disk live in the same records (``masters_on_disk``;
# disk/optimizer_state.py [Note: masters on disk]). RegressionModule's shards per rank at disk_fraction=0.5: the
# input layer and the norm on disk (one record), the hidden and output layers in memory.


def _zero_masters(
    offload_dir: str | None, disk_fraction: float, masters_on_disk: bool, bucket_size_mb: float = 0.001, **extra: Any
) -> ZeroStrategy:
    """ZeRO-2 offload with a tiny bucket (several records at disk_fraction=1); no disk tier without ``offload_dir``."""
    return ZeroStrategy(
        **extra,
        stage=2,
        cpu_offload=True,
        bucket_size_mb=bucket_size_mb,
        offload_dir=offload_dir,
        disk_fraction=disk_fraction if offload_dir else 0.0,
        masters_on_disk=masters_on_disk,
    )


class _GradientRecorder(Callback):
    """This rank's reduced gradient rows before every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        self.steps.append([entry.gradient.clone() for entry in trainer.strategy.engine.reduced_gradients()])


def master_entries_between_steps(disk_state: DiskOptimizerState | None) -> list[Any]:
    """The tier's entries of masters on disk, checked to hold no values in host memory (between steps)."""
    on_disk = [entry for record in disk_state.records for entry in record.master_entries] if disk_state else []
    assert all(is_placeholder(entry.master) for entry in on_disk)
    return on_disk


def _masters_body(
    offload_dir: str | None,
    disk_fraction: float,
    masters_on_disk: bool,
    precision: str,
    optimizer: str,
    wide: bool = False,
) -> dict[str, Any]:
    # wide: records larger than the tier's 4 KiB alignment, so the masters visibly grow the file.
    module = training_module(wide, optimizer)
    recorder = _GradientRecorder()
    trainer = quiet_trainer(
        strategy=_zero_masters(offload_dir, disk_fraction, masters_on_disk, 0.01 if wide else 0.001),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        precision=precision,
        callbacks=[recorder],
    )
    trainer.fit(module)
    engine = trainer.strategy.engine
    disk_state = engine.disk_state
    report = engine.memory_report()
    on_disk = master_entries_between_steps(disk_state)
    return {
        "losses": module.micro_batch_losses,
        "gradients": recorder.steps,
        "parameters": float_state(module),
        "master_bytes": report.master_bytes,
        "masters_on_disk_bytes": sum(entry.nbytes for entry in on_disk),
        "masters_resident": sum(1 for master in engine.masters if not is_placeholder(master)),
        "disk_bytes": report.disk_bytes,
        "file_bytes": 0 if disk_state is None else os.stat(disk_state.file.path).st_size,
        "laid_out_bytes": 0 if disk_state is None else sum(record.nbytes for record in disk_state.records),
        "records": 0 if disk_state is None else len(disk_state.records),
    }


def _assert_same_run(first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    for one, other in zip(first, second, strict=True):
        assert one["losses"] == other["losses"]
        assert len(one["gradients"]) == len(other["gradients"]) == STEPS
        for step, (mine, theirs) in enumerate(zip(one["gradients"], other["gradients"], strict=True)):
            assert mine and len(mine) == len(theirs) and all(map(torch.equal, mine, theirs)), step
        for name, value in other["parameters"].items():
            assert torch.equal(one["parameters"][name], value), name


@pytest.mark.parametrize(
    ("precision", "optimizer", "disk_fraction"),
    [
        ("32-true", "adamw", 1.0),
        ("32-true", "sgd", 1.0),
        ("32-true", "adamw", 0.5),
        ("bf16-true", "adamw", 1.0),
        ("bf16-true", "sgd", 0.5),
        ("bf16-true", "plain-sgd", 1.0),  # no optimizer state: the records hold the masters alone
    ],
)
def test_masters_on_disk_equal_masters_in_memory_bit_for_bit(
    rank_pool_2, tmp_path, precision, optimizer, disk_fraction
):
    on_disk = rank_pool_2.run(_masters_body, str(tmp_path), disk_fraction, True, precision, optimizer)
    in_memory = rank_pool_2.run(_masters_body, None, 0.0, False, precision, optimizer)
    for rank in on_disk:
        assert rank["masters_on_disk_bytes"] > 0, "no master went to disk: the test would not test the tier"
        assert (rank["masters_resident"] > 0) == (disk_fraction < 1), rank["masters_resident"]
    _assert_same_run(on_disk, in_memory)
    if (precision, optimizer) == ("32-true", "adamw"):
        assert_matches_oracle(on_disk, oracle_train(world_size=2, steps=STEPS), accumulate=1, rtol=1e-5, atol=1e-6)


def test_masters_on_disk_leave_host_memory_for_the_tier_file(rank_pool_2, tmp_path):
    masters_in_memory = rank_pool_2.run(_masters_body, str(tmp_path / "state"), 0.5, False, "32-true", "adamw", True)
    masters_on_disk = rank_pool_2.run(_masters_body, str(tmp_path / "masters"), 0.5, True, "32-true", "adamw", True)
    _assert_same_run(masters_on_disk, masters_in_memory)
    for on_disk, in_memory in zip(masters_on_disk, masters_in_memory, strict=True):
        moved = on_disk["masters_on_disk_bytes"]
        assert moved > 0 and on_disk["masters_resident"] > 0 and on_disk["records"] == in_memory["records"] > 1
        assert in_memory["master_bytes"] - on_disk["master_bytes"] == moved
        # The records grow by the masters, up to each tensor's alignment inside them (64 bytes)...
        laid_out = on_disk["laid_out_bytes"] - in_memory["laid_out_bytes"]
        assert moved <= laid_out < moved + 64 * len(on_disk["parameters"]), (laid_out, moved)
        # ... and the file (as planned, checked against the free space, and claimed) by them up to each record's
        # 4 KiB alignment.
        for key in ("disk_bytes", "file_bytes"):
            growth = on_disk[key] - in_memory[key]
            assert abs(growth - moved) < on_disk["records"] * 4096 < moved, (key, growth, moved)


def _masters_fit_body(
    offload_dir: str | None,
    precision: str,
    epochs: int,
    ckpt_path: str | None = None,
    save_to: str | None = None,
) -> dict[str, Any]:
    """Train (optionally resuming, optionally saving after) with or without masters on disk; the save and the load go
    through the tier entry by entry, masters included."""
    module = new_module(dropout=0.1, with_scheduler=True)
    trainer = quiet_trainer(
        strategy=_zero_masters(offload_dir, 0.5, offload_dir is not None),
        devices=torch.distributed.get_world_size(),
        max_epochs=epochs,
        precision=precision,
    )
    with _entry_by_entry() as loads:
        trainer.fit(module, ckpt_path=ckpt_path)
    engine = trainer.strategy.engine
    disk_state = engine.disk_state
    masters = [entry for record in disk_state.records for entry in record.master_entries] if disk_state else []
    if ckpt_path is not None and masters:
        assert loads["writes"] > 0, loads
    if save_to is not None:
        with _entry_by_entry() as saves:
            trainer.save_checkpoint(save_to)
        if masters:
            # Checkpoints hold the masters when the parameters are bf16: those on disk are read entry by entry too.
            state = [entry for record in disk_state.records for entry in record.entries]
            expected = len(state) + (len(masters) if engine.checkpoints_hold_masters else 0)
            assert saves["reads"] == expected and saves["most_values_held"] == 0, (saves, expected)
            assert all(is_placeholder(entry.master) for entry in masters)
            assert not stand_ins._REGISTRY, "stand-ins outlived the save"
    return float_state(module)


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_checkpoint_with_masters_on_disk_resumes_exactly_and_across_tiers(
    rank_pool_1, rank_pool_2, tmp_path, precision
):
    tier = str(tmp_path / "tier")
    straight = rank_pool_2.run(_masters_fit_body, tier, precision, 2)
    with_masters = str(tmp_path / "masters_on_disk.ckpt")
    plain = str(tmp_path / "plain.ckpt")
    rank_pool_2.run(_masters_fit_body, tier, precision, 1, None, with_masters)
    rank_pool_2.run(_masters_fit_body, None, precision, 1, None, plain)
    # Resumed with masters on disk, into a plain ZeRO run, and a plain checkpoint into masters on disk: each equals
    # the uninterrupted run (saved after the first epoch, so the resume sees the same batches).
    for resume_dir, checkpoint in [(tier, with_masters), (None, with_masters), (tier, plain)]:
        resumed = rank_pool_2.run(_masters_fit_body, resume_dir, precision, 2, checkpoint)
        for rank_result, reference in zip(resumed, straight, strict=True):
            for name, value in reference.items():
                assert torch.equal(rank_result[name], value), (resume_dir, checkpoint, name)
    # At another world size (the masters resharded into this rank's records) as into a plain run.
    one_rank_on_disk = rank_pool_1.run(_masters_fit_body, tier, precision, 2, with_masters)
    one_rank_plain = rank_pool_1.run(_masters_fit_body, None, precision, 2, with_masters)
    for name, value in one_rank_plain[0].items():
        assert torch.equal(one_rank_on_disk[0][name], value), ("world size 1", name)


def _masters_background_save_body(offload_dir: str, checkpoint_dir: str) -> None:
    """One epoch with masters on disk, checkpointed at its end by a background save (which stages every stand-in)."""
    module = new_module(dropout=0.1, with_scheduler=True)
    trainer = quiet_trainer(
        strategy=_zero_masters(offload_dir, 0.5, True, async_checkpoint=True),
        devices=torch.distributed.get_world_size(),
        max_epochs=1,
        precision="bf16-true",
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoint_dir, filename="last", every_n_epochs=1, save_top_k=1)],
    )
    trainer.fit(module)
    assert not stand_ins._REGISTRY, "stand-ins outlived the background save"


def test_background_save_with_masters_on_disk_resumes_exactly(rank_pool_2, tmp_path):
    tier, checkpoints = str(tmp_path / "tier"), tmp_path / "checkpoints"
    straight = rank_pool_2.run(_masters_fit_body, tier, "bf16-true", 2)
    rank_pool_2.run(_masters_background_save_body, tier, str(checkpoints))
    resumed = rank_pool_2.run(_masters_fit_body, tier, "bf16-true", 2, str(checkpoints / "last.ckpt"))
    for rank_result, reference in zip(resumed, straight, strict=True):
        for name, value in reference.items():
            assert torch.equal(rank_result[name], value), name
