"""The planner's disk tier (``python -m lightning_colossal.plan --offload-dir ...``): bytes per tier (device, host,
disk) of the disk settings, the least disk share that fits the host, the fp32 masters on disk too (``masters_on_disk``)
when no share of the state alone does, checked against a one-rank ``ZeroEngine`` and the tier's own record layout, the
recommendation taking a disk setting only when nothing without disk fits, the step's disk I/O lower bound, the table
and JSON, and the command-line options. The rest of the planner is ``tests/unit/test_plan.py``."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import replace
from typing import Any

import pytest

from lightning_colossal.plan import build_parser, disk_from_arguments, main, plan_from_arguments
from lightning_colossal.planning.activations import Workload
from lightning_colossal.planning.chunks import chunk_layout
from lightning_colossal.planning.disk_tier import (
    DISK_FRACTIONS,
    PLACEHOLDER_OFFLOAD_DIR,
    RECORD_ALIGNMENT,
    STAGING_SLOTS,
    TENSOR_ALIGNMENT,
    Disk,
    DiskRecords,
    disk_records,
    io_seconds,
)
from lightning_colossal.planning.model_state import (
    OPTIMIZERS,
    Placed,
    Training,
    disk_records_of,
    model_state,
    owned_numel,
)
from lightning_colossal.planning.planner import Hardware, disk_evaluations, evaluate, make_plan, recommend
from lightning_colossal.planning.settings import DISK_BASES, disk_setting, setting_named
from lightning_colossal.planning.sources import LayerShape, demo_model, parameter_count_model
from lightning_colossal.planning.units import format_bytes

GIB = 2**30
ADAMW = OPTIMIZERS["adamw"]
FP32_ADAMW = Training("32-true", ADAMW)
# Three parameters; 8 ranks own 8, 4 and 16 rows of them (Ψ/N each), and Adam keeps a 4-byte step per tensor.
SHAPES = [(64, 32), (32,), (128, 64)]
WORLD = 8
SEVEN_B = ("--parameters", "7e9", "--layers", "32", "--hidden", "4096", "--devices", "8", "--sequence-length", "1024")
GIVEN_DISK = ("--disk-read-gbps", "6", "--disk-write-gbps", "4")


def plan_of(*argv: str) -> Any:
    return plan_from_arguments(build_parser().parse_args(list(argv)))


def evaluation_of(plan: Any, label: str) -> Any:
    return next(evaluation for evaluation in plan.evaluations if evaluation.setting.label == label)


def disk_rows(plan: Any) -> list[Any]:
    return [evaluation for evaluation in plan.evaluations if evaluation.setting.uses_disk]


# ---------------------------------------------------------------------------------------------- bytes per tier
# Rank 0 of 8 owns 256, 4 and 1024 elements of SHAPES: one record (a ZeRO bucket, a Gemini chunk) holding AdamW's
# two fp32 moments of each, every tensor starting at a multiple of 64 bytes: 1024 + 1024 at 0 and 1024, 16 + 16 at
# 2048 and 2112, 4096 + 4096 at 2176 and 6272, ending at 10368; the record takes 4 KiB blocks: 12288 bytes on disk
# (8 x 1284 = 10272 of them state). SGD's one momentum: 1024 at 0, 16 at 1024, 4096 at 1088, ending at 5184: 8192.
ADAMW_RECORD, MOMENTUM_RECORD = 12288, 8192


def test_zero_offload_with_everything_on_disk_moves_only_the_moments():
    psi_r, steps = owned_numel(SHAPES, WORLD, 0), 4 * len(SHAPES)
    offload = model_state(SHAPES, setting_named("colossal_zero2_offload"), FP32_ADAMW, WORLD, 0)
    on_disk = model_state(SHAPES, disk_setting("colossal_zero2_offload", 1.0, "/nvme"), FP32_ADAMW, WORLD, 0)
    # Adam's two fp32 moments of the own rows go to disk; the step scalars stay in host memory.
    assert on_disk.optimizer_state == Placed(host=steps, disk=ADAMW_RECORD)
    assert offload.optimizer_state == Placed(host=8 * psi_r + steps)
    # fp32 masters and master gradients stay in host memory; parameters and the accumulator on the device.
    assert on_disk.parameters == offload.parameters == Placed(device=4 * sum(map(math.prod, SHAPES)), host=4 * psi_r)
    assert on_disk.gradients == offload.gradients == Placed(device=4 * psi_r, host=4 * psi_r)
    assert on_disk.placed.in_memory == offload.placed.total - 8 * psi_r


def test_gemini_offload_with_everything_on_disk_keeps_masters_and_gradients_in_host_memory():
    psi_r, steps = owned_numel(SHAPES, WORLD, 0), 4 * len(SHAPES)
    for base in ("colossal_gemini_offload", "colossal_gemini (all offloaded)"):
        offload = model_state(SHAPES, setting_named(base), FP32_ADAMW, WORLD, 0)
        on_disk = model_state(SHAPES, disk_setting(base, 1.0, "/nvme"), FP32_ADAMW, WORLD, 0)
        assert on_disk.optimizer_state == Placed(host=steps, disk=ADAMW_RECORD), base
        assert (on_disk.parameters, on_disk.gradients) == (offload.parameters, offload.gradients), base
        assert on_disk.gradients == Placed(host=4 * psi_r), base
        assert on_disk.placed.in_memory == offload.placed.total - 8 * psi_r, base
    # Bytes on disk follow the optimizer: SGD with momentum keeps one moment, plain SGD none; bf16 weights do not
    # change the fp32 moments.
    momentum = Training("32-true", OPTIMIZERS["sgd-momentum"])
    setting = disk_setting("colossal_gemini_offload", 1.0, "/nvme")
    assert model_state(SHAPES, setting, momentum, WORLD, 0).optimizer_state == Placed(disk=MOMENTUM_RECORD)
    assert model_state(SHAPES, setting, Training("32-true", OPTIMIZERS["sgd"]), WORLD, 0).placed.disk == 0
    assert model_state(SHAPES, setting, Training("bf16-true", ADAMW), WORLD, 0).placed.disk == ADAMW_RECORD


def test_records_are_laid_out_as_the_disk_tier_lays_them_out():
    from lightning_colossal.disk import files, optimizer_state

    assert (TENSOR_ALIGNMENT, RECORD_ALIGNMENT, STAGING_SLOTS) == (
        optimizer_state._TENSOR_ALIGNMENT,
        files.ALIGNMENT,
        optimizer_state.STAGING_SLOTS,
    )
    assert disk_records([[256, 4, 1024]], 2).record_bytes == (10368,)
    # Empty records are dropped; the staging buffers are up to 3 of the largest record, in 4 KiB blocks.
    records = disk_records([[1000], [0, 0], [10], [5000], [1]], 2)  # 4000 bytes, then the next at 4032, ...
    assert records.record_bytes == (8032, 104, 40032, 68)
    assert records.file_bytes == 8192 + 4096 + 40960 + 4096 and records.staging_bytes == 3 * 40960
    assert disk_records([[10]], 2).staging_bytes == 4096 and disk_records([], 2) == DiskRecords()


def test_a_one_element_master_on_disk_is_on_disk_only():
    # The engines recognise a placeholder of any size (one shared zero), so a one-element master's state is on disk,
    # not in memory. torch.chunk splits 9 elements over 8 ranks as 2, 2, 2, 2, 1: rank 4 owns one, and none of the
    # second.
    state = model_state([(9,), (1,)], disk_setting("colossal_zero2_offload", 1.0, "/nvme"), FP32_ADAMW, 8, 4)
    assert [owned_numel([shape], 8, 4) for shape in [(9,), (1,)]] == [1, 0]
    assert state.optimizer_state == Placed(host=2 * 4, disk=4096), "the steps in memory, the moments on disk"


def test_a_partial_disk_share_counts_chunk_bytes_from_the_first_chunk():
    # Six chunks of 32768000, 21116928 x 3, 21117952 and 32768000 elements: half of the bytes is 75002368 elements,
    # which the first three chunks (75001856) stay under and the fourth would pass.
    model = parameter_count_model(LayerShape(parameters=150_000_000, layers=4, hidden=1024, vocab=32000))
    shapes, world = model.shapes, 2
    half = disk_setting("colossal_gemini_offload", 0.5, "/nvme")
    chunks = chunk_layout(shapes, 4, half, world, 0)
    assert [chunk.numel for chunk in chunks] == [32768000, 21116928, 21116928, 21116928, 21117952, 32768000]
    assert [chunk.optimizer_on_disk for chunk in chunks] == [True, True, True, False, False, False]
    on_disk = sum(chunk.shard_numel for chunk in chunks[:3])
    offload = model_state(shapes, setting_named("colossal_gemini_offload"), FP32_ADAMW, world, 0)
    state = model_state(shapes, half, FP32_ADAMW, world, 0)
    # One record per chunk; these shards' tensors all end on 64-byte and 4 KiB boundaries, so no padding.
    assert state.optimizer_state.disk == 8 * on_disk
    assert state.optimizer_state.host == offload.optimizer_state.host - 8 * on_disk
    assert state.placed.device == offload.placed.device and state.placed.total == offload.placed.total


def test_a_partial_zero_share_counts_the_offloaded_rows_in_parameter_order():
    # One rank owns everything: 512, 512 and 256 elements. Half of them is the first parameter; 0.8 the first two.
    shapes = [(64, 8), (64, 8), (32, 8)]
    for fraction, elements in ((0.5, 512), (0.8, 1024), (0.25, 0), (1.0, 1280)):
        setting = disk_setting("colossal_zero1_offload", fraction, "/nvme")
        blocks = -(-8 * elements // 4096) * 4096  # one record (the bucket is larger), tensors on 64-byte boundaries
        assert model_state(shapes, setting, FP32_ADAMW, 1, 0).optimizer_state == Placed(
            host=8 * (1280 - elements) + 4 * 3, disk=blocks
        ), fraction
    with pytest.raises(ValueError, match="needs offload"):
        model_state(shapes, replace(setting_named("colossal_zero2"), disk_fraction=1.0), FP32_ADAMW, 1, 0)


def test_disk_settings_extend_the_offload_settings_and_say_how():
    zero = disk_setting("colossal_zero2_offload", 0.5, "/nvme")
    assert zero.label == "colossal_zero2_offload + disk 50%" and zero.offload and zero.zero_stage == 2
    assert zero.how == "ZeroStrategy(stage=2, cpu_offload=True, offload_dir='/nvme', disk_fraction=0.5)"
    gemini = disk_setting("colossal_gemini (all offloaded)", 1.0, "/nvme")
    assert gemini.how == (
        "GeminiStrategy(placement=StaticPlacement(shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0,"
        " disk_fraction=1.0), offload_dir='/nvme')"
    )
    masters = disk_setting("colossal_zero1_offload", 0.75, "/nvme", masters_on_disk=True)
    assert masters.label == "colossal_zero1_offload + disk 75% + masters" and masters.masters_on_disk
    assert masters.how == (
        "ZeroStrategy(stage=1, cpu_offload=True, offload_dir='/nvme', disk_fraction=0.75, masters_on_disk=True)"
    )
    assert disk_setting("colossal_gemini_offload", 1.0, "/nvme", masters_on_disk=True).how == (
        "GeminiStrategy(placement=StaticPlacement(offload_optim_frac=1.0, disk_fraction=1.0), offload_dir='/nvme',"
        " masters_on_disk=True)"
    )
    with pytest.raises(ValueError, match="has no disk tier"):
        disk_setting("colossal_fsdp_offload", 1.0, "/nvme")
    with pytest.raises(ValueError, match=r"masters_on_disk needs disk_fraction > 0 .* disk_setting\(base"):
        replace(setting_named("colossal_zero2_offload"), masters_on_disk=True)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        disk_setting("colossal_zero2_offload", 0.0, "/nvme")


def test_the_disk_settings_hows_build_the_strategies_they_name():
    # ``use:`` is pasted into a Trainer: each disk setting's ``how`` must construct, with the settings it names.
    from lightning_colossal import GeminiStrategy, StaticPlacement, ZeroStrategy

    names = {"GeminiStrategy": GeminiStrategy, "StaticPlacement": StaticPlacement, "ZeroStrategy": ZeroStrategy}
    for base in DISK_BASES:
        for masters_on_disk in (False, True):
            setting = disk_setting(base, 0.5, "/nvme", masters_on_disk)
            strategy = eval(setting.how, names)  # noqa: S307 - the planner's own output, the point of the test
            config = strategy.zero_config if setting.family == "zero" else strategy.gemini_config
            assert (config.masters_on_disk, config.offload_dir) == (masters_on_disk, "/nvme"), setting.how


# ---------------------------------------------------------------------------------------------- masters on disk
# With masters_on_disk the record of ADAMW_RECORD holds the fp32 masters first: 1024 + 16 + 4096 bytes at 0, 1024 and
# 1088, ending at 5184 (a multiple of 64); the moments follow, laid out as in ADAMW_RECORD (10368 bytes), ending at
# 15552: 16384 bytes on disk.
ADAMW_MASTERS_RECORD = 16384


def test_zero_masters_on_disk_leave_host_memory_for_the_records():
    psi_r, steps = owned_numel(SHAPES, WORLD, 0), 4 * len(SHAPES)
    state_only = model_state(SHAPES, disk_setting("colossal_zero2_offload", 1.0, "/nvme"), FP32_ADAMW, WORLD, 0)
    setting = disk_setting("colossal_zero2_offload", 1.0, "/nvme", masters_on_disk=True)
    masters = model_state(SHAPES, setting, FP32_ADAMW, WORLD, 0)
    assert disk_records([[256, 4, 1024]], 2, masters=True).record_bytes == (15552,)
    # The masters' own 4 bytes an element are parameters on disk; the rest of the records is the optimizer state's.
    assert masters.parameters == Placed(device=4 * sum(map(math.prod, SHAPES)), disk=4 * psi_r)
    assert masters.optimizer_state == Placed(host=steps, disk=ADAMW_MASTERS_RECORD - 4 * psi_r)
    assert masters.placed.disk == ADAMW_MASTERS_RECORD > state_only.placed.disk == ADAMW_RECORD
    assert masters.gradients == state_only.gradients == Placed(device=4 * psi_r, host=4 * psi_r)
    assert masters.placed.in_memory == state_only.placed.in_memory - 4 * psi_r
    # The step streams the larger record, and reads and writes every byte of it.
    assert disk_records_of(SHAPES, setting, FP32_ADAMW, WORLD, 0) == DiskRecords((15552,))
    # A partial share moves the masters of its shards only: one rank, 512 of 1280 elements on disk.
    shapes = [(64, 8), (64, 8), (32, 8)]
    half = model_state(shapes, disk_setting("colossal_zero1_offload", 0.5, "/nvme", True), FP32_ADAMW, 1, 0)
    assert half.parameters == Placed(device=4 * 1280, host=4 * (1280 - 512), disk=4 * 512)
    assert half.placed.disk == 8192, "2048 bytes of masters + 4096 of moments, in 4 KiB blocks"


# One rank's parameters with odd sizes, so that every tensor in the records needs padding to 64 bytes, and records
# of several 4 KiB blocks, so that the masters' bytes show in the file.
ENGINE_SHAPES = [(370, 5), (3,), (1290, 7), (11, 2), (1,)]


def zero_engine_body(offload_dir: str, disk_fraction: float, momentum_only: bool) -> dict[str, int]:
    """One ZeRO-2 offload step on this one rank with ``masters_on_disk``: the engine's memory report and the size of
    the tier's file."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_colossal.config import ZeroConfig
    from lightning_colossal.zero import ZeroEngine

    torch.manual_seed(0)
    module = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape)) for shape in ENGINE_SHAPES])
    if momentum_only:
        optimizer: torch.optim.Optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    config = ZeroConfig(
        stage=2, cpu_offload=True, offload_dir=offload_dir, disk_fraction=disk_fraction, masters_on_disk=True
    )
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    engine = ZeroEngine(module, optimizer, config, mesh, torch.device("cpu"))
    try:
        sum((parameter * parameter).sum() for parameter in module).backward()
        engine.step_optimizer(optimizer)
        engine.after_step(stepped=True)
        assert engine.disk_state is not None
        report = engine.memory_report()._asdict()
        report["file_bytes"] = os.stat(engine.disk_state.file.path).st_size
        report["masters_on_disk"] = sum(engine.disk_state.holds_master(master) for master in engine.masters)
    finally:
        engine.close_disk_tier()
        engine.remove()
    return report


@pytest.mark.parametrize(("disk_fraction", "optimizer"), [(1.0, "adamw"), (0.5, "adamw"), (1.0, "sgd-momentum")])
def test_zero_masters_on_disk_bytes_are_what_the_engine_lays_out(rank_pool_1, tmp_path, disk_fraction, optimizer):
    training = Training("32-true", OPTIMIZERS[optimizer], device_type="cpu")
    setting = disk_setting("colossal_zero2_offload", disk_fraction, str(tmp_path), masters_on_disk=True)
    planned = model_state(ENGINE_SHAPES, setting, training, 1, 0)
    records = disk_records_of(ENGINE_SHAPES, setting, training, 1, 0)
    (measured,) = rank_pool_1.run(zero_engine_body, str(tmp_path), disk_fraction, optimizer == "sgd-momentum")
    # Half of the 10906 elements: the first two parameters (1850 + 3); the third (9030) would pass it.
    assert measured["masters_on_disk"] == (len(ENGINE_SHAPES) if disk_fraction == 1.0 else 2)
    # Host memory: the masters left on the host (the engine's flat buffer), the gradients, the optimizer state.
    assert planned.parameters.host == measured["master_bytes"]
    assert (measured["master_bytes"] > 0) == (disk_fraction < 1), "only the masters not on disk stay in the buffer"
    assert planned.parameters.in_memory == measured["parameter_bytes"] + measured["master_bytes"]
    assert planned.gradients.in_memory == measured["gradient_bytes"]
    assert planned.optimizer_state.in_memory == measured["optimizer_state_bytes"]
    # Disk: the tier's file as planned and as claimed, masters and state together; the staging buffers of a step.
    assert planned.placed.disk == records.file_bytes == measured["disk_bytes"] == measured["file_bytes"]
    assert records.staging_bytes == measured["disk_staging_bytes"]


def test_gemini_moves_only_masters_apart_from_their_shards():
    # Six chunks (test_a_partial_disk_share_counts_chunk_bytes_from_the_first_chunk) on 2 ranks, all their state on
    # disk. The records are what the tier's own layout function makes of the chunks' master views.
    import torch

    from lightning_colossal.disk.optimizer_state import record_bytes

    model = parameter_count_model(LayerShape(parameters=150_000_000, layers=4, hidden=1024, vocab=32000))
    shapes, world = model.shapes, 2

    def expected(setting: Any, training: Training) -> tuple[int, int]:
        """(bytes of masters that move, the tier's file): a master moves when it is not its fp32 shard, that is
        when the parameters are not fp32, or when the shard is on the device and the master in host memory."""
        moved = file_bytes = 0
        for chunk in chunk_layout(shapes, training.parameter_bytes, setting, world, 0):
            if not chunk.optimizer_on_disk:
                continue
            apart = training.parameter_bytes != 4 or (training.device_type == "cuda" and not chunk.parameters_offloaded)
            masters = [torch.empty(numel, device="meta") for numel in chunk.member_numels]
            optimizer = torch.optim.AdamW(masters, lr=1e-3)
            (size,) = record_bytes(optimizer, [masters], masters_on_disk=setting.masters_on_disk and apart)
            moved += 4 * chunk.shard_numel if setting.masters_on_disk and apart else 0
            file_bytes += -(-size // 4096) * 4096
        return moved, file_bytes

    # Half the chunks keep their parameter shards in host memory (there the fp32 shard is its own master).
    half_offloaded = replace(
        disk_setting("colossal_gemini (all offloaded)", 1.0, "/nvme", True), offload_parameters=0.5
    )
    cases = [
        (disk_setting("colossal_gemini_offload", 1.0, "/nvme", True), FP32_ADAMW),
        (disk_setting("colossal_gemini (all offloaded)", 1.0, "/nvme", True), FP32_ADAMW),
        (disk_setting("colossal_gemini (all offloaded)", 1.0, "/nvme", True), Training("bf16-true", ADAMW)),
        (disk_setting("colossal_gemini_offload", 1.0, "/nvme", True), Training("32-true", ADAMW, "cpu")),
        (half_offloaded, FP32_ADAMW),
    ]
    moved_in = []
    for setting, training in cases:
        moved, file_bytes = expected(setting, training)
        masters = model_state(shapes, setting, training, world, 0)
        state_only = model_state(shapes, replace(setting, masters_on_disk=False), training, world, 0)
        assert masters.parameters.disk == moved, setting.label
        assert masters.placed.disk == file_bytes == disk_records_of(shapes, setting, training, world, 0).file_bytes
        assert masters.placed.in_memory == state_only.placed.in_memory - moved, setting.label
        assert masters.placed.device == state_only.placed.device, "the masters leave host memory only"
        moved_in.append(moved)
    # All of them, none (fp32 shards on the host), all (bf16 shards), none (CPU ranks), and some.
    every = 4 * owned_numel(shapes, world, 0)
    assert moved_in[:4] == [every, 0, every, 0] and 0 < moved_in[4] < every


def test_masters_on_disk_are_a_further_step_when_the_state_alone_does_not_fit_the_host():
    model = parameter_count_model(LayerShape(parameters=150_000_000, layers=4, hidden=1024, vocab=32000))
    training, workload = Training("bf16-mixed", ADAMW), Workload(1, 512)
    hardware = Hardware(devices_per_node=2, nodes=1, device_memory=80 * GIB, host_memory=GIB, disk=Disk(3e9, 2e9))

    def shares(masters_on_disk: bool) -> dict[float, Any]:
        return {
            fraction: evaluate(
                model,
                disk_setting("colossal_zero2_offload", fraction, "/nvme", masters_on_disk),
                hardware,
                training,
                workload,
            )
            for fraction in DISK_FRACTIONS
        }

    state_only, masters = shares(False), shares(True)
    for fraction in DISK_FRACTIONS:  # the same share moves more with the masters, every step
        assert masters[fraction].disk_io_seconds > state_only[fraction].disk_io_seconds
    # Large records (one parameter of 16384000 rows a rank) make the staging buffers weigh: 75% with the masters
    # needs less host memory than the state alone at 100%, and 100% with them less still.
    assert masters[1.0].host_bytes < masters[0.75].host_bytes < state_only[1.0].host_bytes

    def chosen(host_memory: int) -> Any:
        rows = disk_evaluations(model, replace(hardware, host_memory=host_memory), training, workload)
        (row,) = [row for row in rows if row.setting.label.startswith("colossal_zero2_offload + ")]
        return row

    assert not chosen(state_only[1.0].host_bytes).setting.masters_on_disk, "the state alone fits: no masters"
    # It does not: the least share with the masters that fits, 75% (less I/O than 100%, which fits too).
    further = chosen(state_only[1.0].host_bytes - 1)
    assert further.setting.label == "colossal_zero2_offload + disk 75% + masters" and further.fits
    assert further.how.endswith("disk_fraction=0.75, masters_on_disk=True)")
    assert chosen(masters[1.0].host_bytes).setting.label == "colossal_zero2_offload + disk 100% + masters"
    nothing = chosen(masters[1.0].host_bytes - 1)
    assert nothing.setting.label == "colossal_zero2_offload + disk 100% + masters" and not nothing.fits_host
    # Where the device is what is short, the masters cannot help: the state's largest share stays.
    small_device = replace(hardware, device_memory=GIB, host_memory=state_only[1.0].host_bytes - 1)
    rows = disk_evaluations(model, small_device, training, workload)
    assert not any(row.setting.masters_on_disk for row in rows) and not any(row.fits for row in rows)


def test_a_recommended_masters_setting_says_why_in_the_table_and_json(capsys):
    argv = [*SEVEN_B, "--activation-checkpointing", "--device-memory", "16GiB", "--host-memory", "40GiB", *GIVEN_DISK]
    plan = plan_of(*argv)
    label = "colossal_gemini_offload + disk 100% + masters"
    assert plan.recommendation.label == label
    assert plan.recommendation.how == (
        "GeminiStrategy(placement=StaticPlacement(offload_optim_frac=1.0, disk_fraction=1.0),"
        f" offload_dir={PLACEHOLDER_OFFLOAD_DIR!r}, masters_on_disk=True)"
    )
    assert (
        "its masters on disk too because the optimizer state alone on disk does not fit" in plan.recommendation.reason
    )
    # The fully offloaded Gemini keeps bf16-mixed's fp32 shards in host memory as their own masters: nothing to move.
    assert evaluation_of(plan, "colossal_gemini (all offloaded) + disk 100%").model_state.parameters.disk == 0
    row = evaluation_of(plan, label)
    every = 4 * owned_numel(plan.model.shapes, 8, 0)
    assert row.model_state.parameters.disk == every and row.model_state.parameters.host == 0
    assert row.disk_bytes == 8 * row.disk_bytes_per_rank and row.disk_bytes_per_rank >= 3 * every, "12 bytes an element"
    assert main(argv) == 0
    table = capsys.readouterr().out
    line = next(line for line in table.splitlines() if line.startswith(label))
    assert f"+{format_bytes(every)} D " in line and f"use: {plan.recommendation.how}" in table
    assert "'+ masters' (masters_on_disk=True)" in table
    assert main([*argv, "--json"]) == 0
    entry = next(entry for entry in json.loads(capsys.readouterr().out)["settings"] if entry["setting"] == label)
    assert entry["masters_on_disk"] is True and entry["model_state"]["parameters"]["disk"] == every
    assert entry["disk_io"]["read_bytes_per_step_per_node"] == 8 * entry["disk_bytes_per_rank"]


# ---------------------------------------------------------------------------------------------- step time
def test_the_disk_io_lower_bound_is_the_nodes_bytes_over_each_bandwidth():
    disk = Disk(read_bytes_per_second=2e9, write_bytes_per_second=1e9)
    assert io_seconds(disk, 4 * 10**9, 4 * 10**9) == pytest.approx(2.0 + 4.0)
    plan = plan_of(*SEVEN_B, "--device-memory", "40GiB", "--host-memory", "64GiB", *GIVEN_DISK)
    row = evaluation_of(plan, "colossal_gemini_offload + disk 100%")
    per_rank = row.model_state.placed.disk
    assert per_rank == 8 * owned_numel(plan.model.shapes, 8, 0), "AdamW's moments of the rank's rows"
    assert (row.disk_bytes_per_rank, row.disk_bytes) == (per_rank, 8 * per_rank), "8 ranks share the node's disk"
    # Each optimizer step reads every byte once and writes it once: (bytes / read) + (bytes / write).
    assert row.disk_io_seconds == pytest.approx(8 * per_rank / 6e9 + 8 * per_rank / 4e9, rel=1e-12)
    assert all(
        evaluation.disk_io_seconds is None for evaluation in plan.evaluations if not evaluation.setting.uses_disk
    )


def test_disk_space_per_node_is_checked(capsys):
    argv = [*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "64GiB", *GIVEN_DISK, "--disk-space", "40GiB"]
    plan = plan_of(*argv)
    row = evaluation_of(plan, "colossal_gemini (all offloaded) + disk 100%")
    assert row.fits_device and row.fits_host and row.disk_bytes > 40 * GIB
    assert not row.fits_disk and not row.fits and plan.recommendation.label is None
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert next(line for line in table.splitlines() if line.startswith(row.setting.label)).endswith("no: disk")


# ---------------------------------------------------------------------------------------------- recommendation
def test_disk_is_recommended_only_when_host_memory_is_too_small_for_everything_else():
    roomy = plan_of(*SEVEN_B, "--device-memory", "40GiB", "--host-memory", "512GiB", *GIVEN_DISK)
    assert disk_rows(roomy), "weighed whenever a disk is given"
    assert not roomy.recommendation.label.endswith("%")
    # 24 GiB GPUs: only the offload settings fit the device, and 64 GiB of host memory does not hold 8 ranks' 16Ψ/N.
    small = plan_of(*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "64GiB", *GIVEN_DISK)
    assert not any(evaluation.fits for evaluation in small.evaluations if not evaluation.setting.uses_disk)
    assert small.recommendation.label == "colossal_gemini (all offloaded) + disk 100%"
    reason = small.recommendation.reason
    assert "chosen because no setting without disk fits" in reason and "s of disk I/O per step" in reason
    assert "colossal_ddp does not fit" in reason
    assert small.recommendation.how.endswith(f"disk_fraction=1.0), offload_dir={PLACEHOLDER_OFFLOAD_DIR!r})")
    # A checkpoint streams the state on disk through host memory, two records per rank: within the node. A background
    # save stages all of it: more than the node has, and the note says so.
    chosen = evaluation_of(small, small.recommendation.label)
    assert 0 < chosen.checkpoint_extra_bytes < chosen.disk_bytes // 20
    assert any(
        note.startswith(f"checkpoints of {chosen.setting.label}: ")
        and f"about {format_bytes(chosen.host_bytes + chosen.checkpoint_extra_bytes)} per node" in note
        and "(host/node + 2 records per rank), within the node's" in note
        and f"about {format_bytes(chosen.host_bytes + chosen.disk_bytes)} per node" in note
        and "a background save would run out of host memory" in note
        for note in small.notes
    )
    # Without a disk the same machines fit nothing, and the planner says a disk would help.
    without = plan_of(*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "64GiB")
    assert without.recommendation.label is None and "--offload-dir" in without.recommendation.reason
    assert not disk_rows(without)


def test_a_tight_fit_without_disk_beats_a_comfortable_fit_with_disk():
    plan = plan_of(*SEVEN_B, "--device-memory", "40GiB", "--host-memory", "64GiB", *GIVEN_DISK)
    hardware = plan.hardware
    tight = replace(evaluation_of(plan, "colossal_gemini"), device_bytes=hardware.device_memory - GIB)
    comfortable = evaluation_of(plan, "colossal_gemini (all offloaded) + disk 100%")
    assert comfortable.fits and hardware.device_memory - comfortable.device_bytes > 0.1 * hardware.device_memory
    assert recommend([comfortable, tight], hardware).label == "colossal_gemini"
    assert "tight" in recommend([comfortable, tight], hardware).reason


def test_each_disk_setting_takes_the_least_share_that_fits_the_host():
    model = parameter_count_model(LayerShape(parameters=150_000_000, layers=4, hidden=1024, vocab=32000))
    training, workload = Training("bf16-mixed", ADAMW), Workload(1, 512)
    hardware = Hardware(devices_per_node=2, nodes=1, device_memory=80 * GIB, host_memory=GIB, disk=Disk(3e9, 2e9))
    shares = {
        fraction: evaluate(
            model, disk_setting("colossal_gemini_offload", fraction, "/nvme"), hardware, training, workload
        )
        for fraction in DISK_FRACTIONS
    }
    # A step streams the records (one per chunk: 16384000 elements x 8 bytes on each of the 2 ranks) through up to 3
    # host buffers: 1 at 25% (one chunk on disk), 3 from 50% on. So 50% holds more host memory than 25%.
    record = 16_384_000 * 8
    assert [shares[fraction].working.placed.host for fraction in DISK_FRACTIONS] == [record] + 3 * [3 * record]
    assert shares[0.5].host_bytes > shares[0.25].host_bytes > shares[1.0].host_bytes

    def chosen(host_memory: int) -> tuple[float, bool]:
        plan = make_plan(model, replace(hardware, host_memory=host_memory), training, workload)
        gemini = [row for row in disk_rows(plan) if row.setting.label.startswith("colossal_gemini_offload + ")]
        assert len(gemini) == 1
        return gemini[0].setting.disk_fraction, gemini[0].setting.masters_on_disk

    # The first share in 25/50/75/100% order that leaves 10% of host memory, else the first that fits at all.
    assert chosen(math.ceil(shares[0.25].host_bytes / 0.9)) == (0.25, False)
    assert chosen(math.ceil(shares[1.0].host_bytes / 0.9)) == (1.0, False)
    assert chosen(shares[1.0].host_bytes) == (1.0, False), "no share leaves 10%: the first that fits at all"
    # No share of the state alone fits: the masters go too (test_masters_on_disk_are_a_further_step_...).
    assert chosen(shares[1.0].host_bytes - 1) == (1.0, True)
    # Plain SGD keeps nothing shaped like the parameters: only the masters can go to disk, where they are separate
    # from the working weights (bf16-mixed keeps fp32 parameters: ZeRO's masters, Gemini's with its shards on the GPU;
    # fully offloaded Gemini's host shards are their own masters). One row each, masters on disk; a note says so.
    sgd = make_plan(model, hardware, Training("bf16-mixed", OPTIMIZERS["sgd"]), workload)
    rows = disk_rows(sgd)
    assert [row.setting.label.split(" + ")[0] for row in rows] == list(DISK_BASES[:3])
    assert all(row.setting.masters_on_disk and row.model_state.parameters.disk > 0 for row in rows)
    # No state on disk: the records' other bytes are the tier's alignment only (4 KiB a record, 64 bytes a tensor).
    assert all(row.model_state.optimizer_state.disk < 0.001 * row.model_state.parameters.disk for row in rows)
    assert any("only disk settings are '+ masters' rows" in note for note in sgd.notes)
    # On CPU ranks in fp32 a Gemini shard is its own master: nothing to move, so no Gemini row; ZeRO's masters move.
    cpu = replace(hardware, device_type="cpu", device_memory=64 * GIB, host_memory=64 * GIB)
    cpu_rows = disk_rows(make_plan(model, cpu, Training("32-true", OPTIMIZERS["sgd"], "cpu"), workload))
    assert [row.setting.label.split(" + ")[0] for row in cpu_rows] == [
        "colossal_zero1_offload",
        "colossal_zero2_offload",
    ]


def test_cpu_ranks_weigh_the_disk_settings_too():
    hardware = Hardware(2, 1, GIB, 64 * GIB, device_type="cpu", disk=Disk(1e9, 1e9, "/nvme", 10 * GIB))
    plan = make_plan(demo_model(), hardware, Training("32-true", ADAMW, "cpu"), Workload(1, 128))
    labels = [evaluation.setting.label for evaluation in plan.evaluations]
    assert "colossal_gemini_offload" not in labels and "colossal_gemini_offload + disk 25%" in labels
    # The host-budget row (tests/unit/test_plan_auto_disk.py) fits with nothing on disk here: ahead of the static one.
    bases = [evaluation.setting.label.split(" + ")[0] for evaluation in disk_rows(plan)]
    assert bases == [*DISK_BASES[:3], "colossal_gemini_auto", DISK_BASES[3]]


# ---------------------------------------------------------------------------------------------- output
def test_table_and_json_show_bytes_per_tier(capsys):
    argv = [*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "64GiB", *GIVEN_DISK]
    assert main(argv) == 0
    table = capsys.readouterr().out
    header = next(line for line in table.splitlines() if line.startswith("setting"))
    assert header.split() == [
        "setting", "parameters", "gradients", "optimizer", "working", "activations", "GPU", "total", "host/rank",
        "disk/rank", "min", "disk", "I/O", "fits",
    ]  # fmt: skip
    row = next(line for line in table.splitlines() if line.startswith("colossal_zero2_offload + disk 100%"))
    assert " 6.5 GiB D " in row and re.search(r" \d+\.\d\d s ", row), "optimizer state marked D, the I/O bound in s"
    assert "Disk      6.00 GB/s read, 4.00 GB/s write per node (as given)" in table
    assert main(argv + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["hardware"]["disk"]["read_bytes_per_second"] == 6e9
    entry = next(entry for entry in data["settings"] if entry["setting"] == "colossal_zero2_offload + disk 100%")
    disk_bytes = entry["model_state"]["optimizer_state"]["disk"]
    assert entry["disk_bytes_per_rank"] == disk_bytes > 0 and entry["disk_bytes_per_node"] == 8 * disk_bytes
    assert entry["disk_io"]["read_bytes_per_step_per_node"] == entry["disk_io"]["written_bytes_per_step_per_node"]
    assert entry["disk_io"]["seconds_per_step_lower_bound"] == pytest.approx(8 * disk_bytes * (1 / 6e9 + 1 / 4e9))
    assert entry["host_bytes_per_node"] == 8 * entry["host_bytes_per_rank"] and entry["disk_fraction"] == 1.0
    assert (
        entry["disk_io"]["background_checkpoint_host_bytes_per_node"] == entry["host_bytes_per_node"] + 8 * disk_bytes
    )
    assert (
        entry["host_bytes_per_node"]
        < entry["disk_io"]["checkpoint_host_bytes_per_node"]
        < (entry["host_bytes_per_node"] + 8 * disk_bytes)
    )
    plain = next(entry for entry in data["settings"] if entry["setting"] == "colossal_zero2")
    assert plain["disk_io"] is None and plain["disk_bytes_per_rank"] == 0
    # Without a disk the table has no disk columns.
    assert main([*SEVEN_B]) == 0
    assert "disk/rank" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- options
def arguments_of(*argv: str) -> Any:
    return build_parser().parse_args(["--model", "demo", *argv])


@pytest.fixture
def no_measuring(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the bandwidth measurements asked for, answering with fixed figures instead of measuring."""
    calls: list[str] = []

    def measure(offload_dir: str, *args: Any, **kwargs: Any) -> Any:
        from lightning_colossal.disk.bandwidth import DiskBandwidth

        calls.append(offload_dir)
        return DiskBandwidth(5e9, 2.5e9, direct_io=False, measured_bytes=512 * 2**20)

    monkeypatch.setattr("lightning_colossal.disk.bandwidth.measure_bandwidth", measure)
    return calls


def test_disk_options(tmp_path, no_measuring):
    assert disk_from_arguments(arguments_of()) is None
    given = disk_from_arguments(arguments_of("--disk-read-gbps", "3.5", "--disk-write-gbps", "2"))
    assert given == Disk(3.5e9, 2e9) and given.path == PLACEHOLDER_OFFLOAD_DIR
    # A directory with both bandwidths and a space is not measured, and need not exist here.
    absent = str(tmp_path / "on-the-cluster")
    described = disk_from_arguments(
        arguments_of("--offload-dir", absent, "--disk-read-gbps", "7", "--disk-write-gbps", "5", "--disk-space", "2TiB")
    )
    assert described == Disk(7e9, 5e9, absent, 2 * 2**40) and not no_measuring
    # A directory alone: its bandwidth is measured and its free space read.
    measured = disk_from_arguments(arguments_of("--offload-dir", str(tmp_path)))
    assert no_measuring == [str(tmp_path)]
    assert (measured.read_bytes_per_second, measured.write_bytes_per_second) == (5e9, 2.5e9)
    assert (
        measured.measured
        and measured.direct_io is False
        and measured.space == pytest.approx(shutil.disk_usage(tmp_path).free, rel=0.01)
    )
    overridden = disk_from_arguments(arguments_of("--offload-dir", str(tmp_path), "--disk-read-gbps", "1"))
    assert (overridden.read_bytes_per_second, overridden.write_bytes_per_second) == (1e9, 2.5e9)
    plan = plan_of("--model", "demo", "--offload-dir", str(tmp_path), "--host-memory", "64GiB")
    assert any("through the page cache" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("argv", "fix"),
    [
        (["--disk-read-gbps", "3"], "add --disk-write-gbps"),
        (["--disk-write-gbps", "3"], "add --disk-read-gbps"),
        (["--disk-space", "1TiB"], "add --offload-dir PATH"),
        (["--disk-read-gbps", "-1", "--disk-write-gbps", "3"], "positive bandwidth"),
        (["--offload-dir", "/does/not/exist"], "create it on the local disk first"),
        (
            ["--disk-read-gbps", "3", "--disk-write-gbps", "3", "--disk-space", "lots"],
            "--disk-space='lots' is not a size",
        ),
    ],
)
def test_bad_disk_options_exit_with_a_message_naming_the_fix(capsys, argv, fix):
    with pytest.raises(SystemExit) as raised:
        main(["--model", "demo", *argv])
    assert raised.value.code == 2
    assert fix in capsys.readouterr().err


def test_the_real_measurement_runs_and_leaves_nothing_behind(tmp_path, monkeypatch):
    from lightning_colossal.disk import bandwidth

    real = bandwidth.measure_bandwidth
    monkeypatch.setattr(bandwidth, "measure_bandwidth", lambda path: real(path, total_bytes=8 * 2**20))
    disk = disk_from_arguments(arguments_of("--offload-dir", str(tmp_path)))
    assert disk is not None and disk.measured and disk.read_bytes_per_second > 0 and disk.write_bytes_per_second > 0
    assert disk.space is not None and os.listdir(tmp_path) == [], "the tier's directory and file are removed"
