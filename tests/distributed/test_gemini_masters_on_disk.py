"""Gemini's fp32 masters in the disk tier (``GeminiConfig(masters_on_disk=True)``; gemini/masters_on_disk.py [Note:
Gemini's masters on disk]).

Exactness: a run with the masters (and optimizer state) on disk equals the same run with both in memory bit for bit:
losses, the reduced gradient rows before every step, and the parameters after it, under static placement (all or half
of the chunks on disk, AdamW and SGD momentum) and automatic placement under a host budget. Memory: the masters' host
bytes move into the tier's file, and automatic placement counts them when it fits the budget. Checkpoints: saves read
the masters through the tier one entry at a time; a checkpoint saved with masters on disk resumes exactly into masters
on disk, into memory and at another world size, and a checkpoint of whole tensors (Lightning's ddp) loads into the
records like into memory.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_colossal import AutoPlacement, GeminiStrategy, StaticPlacement
from lightning_colossal.disk.optimizer_state import is_placeholder
from lightning_colossal.engine_parts import stand_ins
from lightning_colossal.gemini.placement import HostBudgetTooSmall
from tests.distributed.oracle import float_state, new_module, quiet_trainer
from tests.distributed.test_disk_tier import (
    SMALL_CHUNKS,
    STEPS,
    _assert_same_run,
    _entry_by_entry,
    master_entries_between_steps,
    training_module,
)

# One 64x64 layer and its bias per chunk: WideRegression in 9 chunks, so that the three staging buffers (of the
# largest record) weigh less than what the masters free.
AUTO_CHUNKS = 64 * 64 + 64


def _strategy(placement: str, offload_dir: str | None, masters_on_disk: bool, budget: int | None = None) -> Any:
    """Gemini with the optimizer on the host; with ``offload_dir`` its state (and with ``masters_on_disk`` the
    masters) on disk: all chunks (``static``), the first of RegressionModule's two (``static-half``), or what does not
    fit ``budget`` (``auto``)."""
    if placement == "auto":
        auto = AutoPlacement(host_memory_budget=budget if offload_dir else None)
        return GeminiStrategy(
            placement=auto, chunk_numel=AUTO_CHUNKS, offload_dir=offload_dir, masters_on_disk=masters_on_disk
        )
    fraction = {"static": 1.0, "static-half": 0.5}[placement] if offload_dir else 0.0
    return GeminiStrategy(
        placement=StaticPlacement(offload_optim_frac=1.0, disk_fraction=fraction),
        chunk_numel=SMALL_CHUNKS,
        offload_dir=offload_dir,
        masters_on_disk=masters_on_disk,
    )


class _GradientRecorder(Callback):
    """This rank's reduced gradient rows (the masters' ``.grad``) before every optimizer step."""

    def __init__(self) -> None:
        self.steps: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        masters = trainer.strategy.engine.sharded_masters
        self.steps.append([entry.master.grad.clone() for entry in masters if entry.master.grad is not None])


def _train_body(
    placement: str, offload_dir: str | None, masters_on_disk: bool, precision: str, optimizer: str, budget: int = 0
) -> dict[str, Any]:
    module = training_module(wide=placement == "auto", optimizer=optimizer)
    recorder = _GradientRecorder()
    trainer = quiet_trainer(
        strategy=_strategy(placement, offload_dir, masters_on_disk, budget),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        precision=precision,
        callbacks=[recorder],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    engine = trainer.strategy.engine
    disk_state = engine.disk_state
    report = engine.memory_report()
    on_disk = master_entries_between_steps(disk_state)
    # Their chunks hold no master storage either.
    assert all(is_placeholder(chunk.master) for chunk in engine.manager.chunks if chunk.masters_on_disk)
    return {
        "losses": module.micro_batch_losses,
        "gradients": recorder.steps,
        "parameters": float_state(module),
        "master_bytes": report.chunks.master,
        "masters_on_disk_bytes": sum(entry.nbytes for entry in on_disk),
        "chunks_with_masters_on_disk": sum(1 for chunk in engine.manager.chunks if chunk.masters_on_disk),
        "laid_out_bytes": 0 if disk_state is None else sum(record.nbytes for record in disk_state.records),
        "host_bytes": report.chunks.shard
        + report.chunks.master
        + report.chunks.gradient
        + report.chunks.optimizer_state
        + report.disk_staging_bytes,
        "warnings": [str(warning.message) for warning in caught if "masters_on_disk" in str(warning.message)],
    }


@pytest.mark.parametrize(
    ("placement", "precision", "optimizer"),
    [("static", "bf16-true", "adamw"), ("static-half", "bf16-true", "sgd"), ("static", "bf16-true", "plain-sgd")],
)
def test_masters_on_disk_equal_masters_in_memory_bit_for_bit(rank_pool_2, tmp_path, placement, precision, optimizer):
    on_disk = rank_pool_2.run(_train_body, placement, str(tmp_path / "tier"), True, precision, optimizer)
    state_only = rank_pool_2.run(_train_body, placement, str(tmp_path / "state"), False, precision, optimizer)
    in_memory = rank_pool_2.run(_train_body, placement, None, False, precision, optimizer)
    _assert_same_run(on_disk, in_memory)
    _assert_same_run(state_only, in_memory)
    for masters, state in zip(on_disk, state_only, strict=True):
        moved = masters["masters_on_disk_bytes"]
        assert moved > 0, "no master went to disk: the test would not test the tier"
        assert masters["chunks_with_masters_on_disk"] == (2 if placement == "static" else 1)
        # The masters' host bytes are what moved (a half-on-disk run keeps the other chunk's master).
        assert state["master_bytes"] - masters["master_bytes"] == moved
        assert (masters["master_bytes"] > 0) == (placement == "static-half")
        # The records grow by the masters, up to each tensor's 64-byte alignment inside them.
        grown = masters["laid_out_bytes"] - state["laid_out_bytes"]
        assert moved <= grown < moved + 64 * len(masters["parameters"]), (grown, moved)


def test_fp32_shards_in_host_memory_keep_their_masters_and_say_so(rank_pool_2, tmp_path):
    # An fp32 shard in host memory is its own master (the working weights): nothing moves, and rank 0 warns.
    on_disk = rank_pool_2.run(_train_body, "static", str(tmp_path / "tier"), True, "32-true", "adamw")
    in_memory = rank_pool_2.run(_train_body, "static", None, False, "32-true", "adamw")
    _assert_same_run(on_disk, in_memory)
    assert [rank["chunks_with_masters_on_disk"] for rank in on_disk] == [0, 0]
    assert len(on_disk[0]["warnings"]) == 1 and "bf16-true" in on_disk[0]["warnings"][0]
    assert on_disk[1]["warnings"] == []


def _refused_body(offload_dir: str, budget: int) -> str:
    try:
        _train_body("auto", offload_dir, False, "bf16-true", "adamw", budget)
    except HostBudgetTooSmall as error:
        return str(error)
    return ""


def test_automatic_placement_counts_the_masters_against_the_host_budget(rank_pool_2, tmp_path):
    in_memory = rank_pool_2.run(_train_body, "auto", None, False, "bf16-true", "adamw")
    whole = max(rank["host_bytes"] for rank in in_memory)
    # Per element of a rank's shards in memory: 2 (bf16 shard) + 4 (master) + 4 (gradient) + 8 (AdamW) = 18 bytes.
    # With every chunk's state on disk 10 remain, plus three staging buffers of 8 bytes per element of a chunk's
    # shard: over 2/3 of the whole. With the masters too, 6 plus buffers of 12 bytes per element: under it.
    budget = whole * 2 // 3
    on_disk = rank_pool_2.run(_train_body, "auto", str(tmp_path / "tier"), True, "bf16-true", "adamw", budget)
    _assert_same_run(on_disk, in_memory)
    for rank in on_disk:
        assert rank["chunks_with_masters_on_disk"] > 0 and rank["masters_on_disk_bytes"] > 0
        assert rank["host_bytes"] <= budget, (rank["host_bytes"], budget)
    refusals = rank_pool_2.run(_refused_body, str(tmp_path / "state"), budget)
    assert all("masters_on_disk=True" in message for message in refusals), refusals


# ---------------------------------------------------------------------------------------------- checkpoints
def _fit_body(
    offload_dir: str | None,
    epochs: int,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    strategy: str | None = None,
) -> dict[str, Any]:
    """bf16-true training (optionally resuming, optionally saving after) with half the chunks' masters on disk, in
    memory (``offload_dir`` None), or under ``strategy``."""
    module = new_module(dropout=0.1, with_scheduler=True)
    trainer = quiet_trainer(
        strategy=strategy or _strategy("static-half", offload_dir, offload_dir is not None),
        devices=torch.distributed.get_world_size(),
        max_epochs=epochs,
        precision="bf16-true",
    )
    whole_file = ckpt_path is not None and ckpt_path.endswith("whole.ckpt")
    # A file of whole tensors is read whole, and so is the optimizer state it is copied into (engine_tier.py); the
    # weights still go into the records one at a time.
    with contextlib.nullcontext({}) if whole_file else _entry_by_entry() as loads:
        trainer.fit(module, ckpt_path=ckpt_path)
    engine = getattr(trainer.strategy, "engine", None)
    disk_state = engine.disk_state if engine is not None else None
    masters = [entry for record in disk_state.records for entry in record.master_entries] if disk_state else []
    if ckpt_path is not None and masters and not whole_file:
        assert loads["writes"] > 0, loads  # the sharded load filled the records entry by entry
    if save_to is not None:
        with _entry_by_entry() as saves:
            trainer.save_checkpoint(save_to)
        if masters:
            state = [entry for record in disk_state.records for entry in record.entries]
            assert saves["reads"] == len(state) + len(masters), (saves, len(state), len(masters))
            assert saves["most_values_held"] == 0, saves
            assert all(is_placeholder(entry.master) for entry in masters)
    assert not stand_ins._REGISTRY, "stand-ins outlived the checkpoint"
    return float_state(module)


@pytest.mark.slow
def test_checkpoint_with_masters_on_disk_resumes_exactly_into_either_tier_and_world_size(
    rank_pool_1, rank_pool_2, tmp_path
):
    tier = str(tmp_path / "tier")
    straight = rank_pool_2.run(_fit_body, tier, 2)
    with_masters, plain = str(tmp_path / "masters.ckpt"), str(tmp_path / "plain.ckpt")
    rank_pool_2.run(_fit_body, tier, 1, None, with_masters)
    rank_pool_2.run(_fit_body, None, 1, None, plain)
    for resume_dir, checkpoint in [(tier, with_masters), (None, with_masters), (tier, plain)]:
        resumed = rank_pool_2.run(_fit_body, resume_dir, 2, checkpoint)
        for rank_result, reference in zip(resumed, straight, strict=True):
            for name, value in reference.items():
                assert torch.equal(rank_result[name], value), (resume_dir, checkpoint, name)
    one_rank_on_disk = rank_pool_1.run(_fit_body, tier, 2, with_masters)
    one_rank_plain = rank_pool_1.run(_fit_body, None, 2, with_masters)
    for name, value in one_rank_plain[0].items():
        assert torch.equal(one_rank_on_disk[0][name], value), ("world size 1", name)


def test_whole_tensor_checkpoint_loads_into_masters_on_disk_like_into_memory(rank_pool_2, tmp_path):
    # Lightning's ddp writes whole tensors: their rows go into the records (load_full_weights), one record at a time.
    whole = str(tmp_path / "whole.ckpt")
    rank_pool_2.run(_fit_body, None, 1, None, whole, "ddp")
    into_tier = rank_pool_2.run(_fit_body, str(tmp_path / "tier"), 2, whole)
    into_memory = rank_pool_2.run(_fit_body, None, 2, whole)
    for a, b in zip(into_tier, into_memory, strict=True):
        for name, value in b.items():
            assert torch.equal(a[name], value), name


def _meta_built_body(offload_dir: str | None) -> dict[str, Any]:
    """bf16 training of a model built on the meta device: static placement never allocates the masters it sends to
    disk, so their first values come straight from the shards the engine materialised."""
    trainer = quiet_trainer(
        strategy=_strategy("static", offload_dir, offload_dir is not None),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        precision="bf16-true",
    )
    with trainer.init_module(empty_init=True):
        module = new_module()
    assert all(parameter.is_meta for parameter in module.parameters())
    trainer.fit(module)
    engine = trainer.strategy.engine
    return {
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
        "chunks_with_masters_on_disk": sum(1 for chunk in engine.manager.chunks if chunk.masters_on_disk),
    }


def test_a_meta_built_model_with_masters_on_disk_trains_like_one_with_masters_in_memory(rank_pool_2, tmp_path):
    on_disk = rank_pool_2.run(_meta_built_body, str(tmp_path / "tier"))
    in_memory = rank_pool_2.run(_meta_built_body, None)
    for disk_rank, memory_rank in zip(on_disk, in_memory, strict=True):
        assert disk_rank["chunks_with_masters_on_disk"] == 2
        assert disk_rank["losses"] == memory_rank["losses"]
        for name, value in memory_rank["parameters"].items():
            assert torch.equal(disk_rank["parameters"][name], value), name


def _background_save_body(offload_dir: str, checkpoint_dir: str) -> None:
    """One epoch with half the chunks' masters on disk, checkpointed at its end by a background save (which stages
    every stand-in, masters included, before training goes on)."""
    placement = StaticPlacement(offload_optim_frac=1.0, disk_fraction=0.5)
    strategy = GeminiStrategy(
        placement=placement,
        chunk_numel=SMALL_CHUNKS,
        offload_dir=offload_dir,
        masters_on_disk=True,
        async_checkpoint=True,
    )
    trainer = quiet_trainer(
        strategy=strategy,
        devices=torch.distributed.get_world_size(),
        max_epochs=1,
        precision="bf16-true",
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=checkpoint_dir, filename="last", every_n_epochs=1, save_top_k=1)],
    )
    trainer.fit(new_module(dropout=0.1, with_scheduler=True))
    assert not stand_ins._REGISTRY, "stand-ins outlived the background save"


@pytest.mark.slow
def test_background_save_with_masters_on_disk_resumes_exactly(rank_pool_2, tmp_path):
    tier, checkpoints = str(tmp_path / "tier"), tmp_path / "checkpoints"
    straight = rank_pool_2.run(_fit_body, tier, 2)
    rank_pool_2.run(_background_save_body, tier, str(checkpoints))
    resumed = rank_pool_2.run(_fit_body, tier, 2, str(checkpoints / "last.ckpt"))
    for rank_result, reference in zip(resumed, straight, strict=True):
        for name, value in reference.items():
            assert torch.equal(rank_result[name], value), name
