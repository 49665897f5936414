"""The planner's row for Gemini's automatic placement with a host budget and the disk tier
(``GeminiStrategy(placement=AutoPlacement(host_memory_budget=H), offload_dir=...)``, ``planning/host_budget.py``):
the chunks it puts on disk are the last ones and exactly those the engine's ``disk_by_host_budget`` picks, its host
bytes stay within the budget it names, a host too small for it gives a row that does not fit, where it ranks against
the static disk rows, its JSON, and a cross-check against a real one-rank fit under the budgets the planner names.
The static disk rows are ``tests/unit/test_plan_disk.py``."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

import pytest
import torch
from lightning import LightningModule
from torch.utils.data import DataLoader, TensorDataset

from lightning_colossal.plan import build_parser, main, plan_from_arguments
from lightning_colossal.planning.activations import Workload
from lightning_colossal.planning.chunks import chunk_layout
from lightning_colossal.planning.disk_tier import Disk
from lightning_colossal.planning.host_budget import disk_chunks_for_budget, engine_host_bytes
from lightning_colossal.planning.model_state import OPTIMIZERS, Training, disk_records_of, model_state
from lightning_colossal.planning.planner import Hardware, make_plan
from lightning_colossal.planning.settings import HOST_BUDGET_LABEL, host_budget_setting
from lightning_colossal.planning.sources import LayerShape, parameter_count_model
from lightning_colossal.planning.units import MIB

GIB = 2**30
ADAMW = OPTIMIZERS["adamw"]
# Six chunks of 32768000, 21116928 x 3, 21117952 and 32768000 elements (test_plan_disk.py); 2 ranks.
MODEL = parameter_count_model(LayerShape(parameters=150_000_000, layers=4, hidden=1024, vocab=32000))
WORKLOAD = Workload(1, 512)
SEVEN_B = ("--parameters", "7e9", "--layers", "32", "--hidden", "4096", "--devices", "8", "--sequence-length", "1024")
GIVEN_DISK = ("--disk-read-gbps", "6", "--disk-write-gbps", "4")
# A 7B-sized model with a 256000-token vocabulary in bf16-true on 10 GiB GPUs: FSDP's offload keeps the embedding and
# head gathered on the GPU and does not fit, Gemini's shards on the GPU do not either, and 96 or 104 GiB of host memory
# hold no Gemini placement without disk (docs/planner.md, the disk tier, shows the 104 GiB plan).
LARGE_VOCABULARY = (
    *("--parameters", "7e9", "--layers", "24", "--hidden", "3072", "--vocab", "256000", "--devices", "8"),
    *("--sequence-length", "1024", "--precision", "bf16-true", "--activation-checkpointing"),
    *("--device-memory", "10GiB", *GIVEN_DISK),
)


def plan_of(*argv: str) -> Any:
    return plan_from_arguments(build_parser().parse_args(list(argv)))


def row_of(plan: Any, label: str = HOST_BUDGET_LABEL) -> Any:
    return next(evaluation for evaluation in plan.evaluations if evaluation.setting.label == label)


def disk_labels(plan: Any) -> list[str]:
    return [evaluation.setting.label for evaluation in plan.evaluations if evaluation.setting.uses_disk]


def host_budget_row(host_memory: int, training: Training, **hardware: Any) -> Any:
    settings = {"devices_per_node": 2, "nodes": 1, "device_memory": 80 * GIB, "disk": Disk(3e9, 2e9, "/nvme")}
    plan = make_plan(MODEL, Hardware(host_memory=host_memory, **{**settings, **hardware}), training, WORKLOAD)
    return row_of(plan)


def engine_counted_host_bytes(row: Any, training: Training, world_size: int) -> int:
    """What the engine counts against the row's budget: each chunk's host bytes, less the state of the chunks on
    disk, plus the tier's staging buffers."""
    from lightning_colossal.disk.optimizer_state import staging_bytes_for

    chunks = chunk_layout(MODEL.shapes, training.parameter_bytes, row.setting, world_size, 0)
    host, state = engine_host_bytes(chunks, training)
    on_disk = [state[index] for index in sorted(row.setting.disk_chunks)]
    return sum(host) - sum(on_disk) + staging_bytes_for(on_disk)


# ---------------------------------------------------------------------------------------------- the chunks on disk
def test_the_rows_disk_chunks_are_the_last_ones_and_those_disk_by_host_budget_picks():
    from lightning_colossal.disk.optimizer_state import record_bytes, staging_bytes_for
    from lightning_colossal.gemini.placement import disk_by_host_budget

    training = Training("bf16-mixed", ADAMW)
    row = host_budget_row(3 * GIB, training)
    budget, on_disk = row.setting.host_memory_budget, row.setting.disk_chunks
    chunks = chunk_layout(MODEL.shapes, 4, row.setting, 2, 0)
    assert 0 < len(on_disk) < len(chunks), "some chunks on disk, not all: the test would not tell first from last"
    assert sorted(on_disk) == list(range(len(chunks) - len(on_disk), len(chunks))), "the last chunks"
    # The engine's count, built here from the tier's own record layout: on a GPU every fp32 shard starts in host
    # memory and moves to the device when used, so its master is a copy apart (4 + 4 + 4 bytes an element).
    host, state = [], []
    for chunk in chunks:
        masters = [torch.empty(numel, device="meta") for numel in chunk.member_numels]
        (record,) = record_bytes(torch.optim.AdamW(masters), [masters])
        host.append(12 * chunk.shard_numel + record)
        state.append(record)
    assert on_disk == disk_by_host_budget(host, state, budget, has_disk=True, staging_bytes=staging_bytes_for)
    # The row's bytes: those chunks' moments on disk, one record each; their masters and gradients in host memory.
    assert row.model_state.placed.disk == sum(-(-state[index] // 4096) * 4096 for index in on_disk)
    assert row.model_state.placed.device == 0 and row.disk_io_seconds > 0
    assert row.setting.how == (
        f"GeminiStrategy(placement=AutoPlacement(host_memory_budget={budget // MIB} * 2**20), offload_dir='/nvme')"
    )


@pytest.mark.parametrize(
    ("precision", "device_type"), [("bf16-mixed", "cuda"), ("bf16-true", "cuda"), ("32-true", "cpu")]
)
def test_host_bytes_per_rank_stay_within_the_budget_it_names(precision, device_type):
    from lightning_colossal import AutoPlacement, GeminiStrategy

    training = Training(precision, ADAMW, device_type)
    fitted = 0
    for host_memory in (2 * GIB, 5 * GIB // 2, 3 * GIB, 4 * GIB, 8 * GIB):
        row = host_budget_row(host_memory, training, device_type=device_type)
        budget, share = row.setting.host_memory_budget, host_memory // 2
        assert budget % MIB == 0 and budget <= share
        if not row.fits:
            continue
        fitted += 1
        # The engine's own count fits the budget; the planner's host bytes (Adam's step scalars, on CPU ranks the
        # activations too) fit the rank's share of the node, and 90% of it when that budget was enough.
        assert engine_counted_host_bytes(row, training, 2) <= budget
        assert row.host_bytes_per_rank <= share and row.host_bytes == 2 * row.host_bytes_per_rank
        if "is 90% of" in row.notes[-1]:
            assert row.host_bytes <= 0.9 * host_memory
        strategy = eval(row.how, {"GeminiStrategy": GeminiStrategy, "AutoPlacement": AutoPlacement})  # noqa: S307
        config = strategy.gemini_config
        assert config.placement == AutoPlacement(host_memory_budget=budget) and config.offload_dir == "/nvme"
    assert fitted >= 2, "the hosts tried should fit the row at least twice"


def test_a_host_too_small_even_with_everything_on_disk_gives_a_row_that_does_not_fit(capsys):
    from lightning_colossal.disk.optimizer_state import staging_bytes_for
    from lightning_colossal.gemini.placement import HostBudgetTooSmall, disk_by_host_budget

    training = Training("bf16-mixed", ADAMW)
    row = host_budget_row(2 * GIB, training)
    chunks = chunk_layout(MODEL.shapes, 4, row.setting, 2, 0)
    assert not row.fits_host and not row.fits and row.fits_device
    assert row.setting.disk_chunks == frozenset(range(len(chunks))), "shown with every chunk's state on disk"
    assert row.notes[-1].startswith(f"{HOST_BUDGET_LABEL} does not fit: the engine refuses host_memory_budget=")
    host, state = engine_host_bytes(chunks, training)
    with pytest.raises(HostBudgetTooSmall):
        disk_by_host_budget(host, state, row.setting.host_memory_budget, True, staging_bytes_for)
    # On the command line: the row says why, and something else is recommended.
    argv = [*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "64GiB", *GIVEN_DISK]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert next(line for line in table.splitlines() if line.startswith(HOST_BUDGET_LABEL)).endswith("no: host")
    assert f"{HOST_BUDGET_LABEL} does not fit: the engine refuses" in table
    assert "Recommendation: colossal_gemini (all offloaded) + disk 100%" in table


# ---------------------------------------------------------------------------------------------- recommendation
def test_the_row_goes_ahead_of_the_fully_offloaded_static_row_only_when_it_moves_no_more():
    # bf16-mixed on a GPU: its fp32 masters are copies apart from the shards (4 bytes an element the static row does
    # not hold), so it needs more on disk than the static row's least share: it goes after that row, which is chosen.
    mixed = plan_of(*SEVEN_B, "--device-memory", "24GiB", "--host-memory", "96GiB", *GIVEN_DISK)
    static = row_of(mixed, "colossal_gemini (all offloaded) + disk 50%")
    assert disk_labels(mixed)[-2:] == [static.setting.label, HOST_BUDGET_LABEL]
    assert row_of(mixed).fits and row_of(mixed).disk_bytes > static.disk_bytes
    assert mixed.recommendation.label == static.setting.label
    # bf16-true: the masters are apart in both, and the row's disk bytes are the least that fit (whole chunks, not 25%
    # steps): with 104 GiB, 86 of 98 chunks where the static row needs all of them; with 96 GiB all of them, a tie.
    # Either way it goes ahead and, nothing without disk fitting, is chosen.
    for host_memory, fewer in (("104GiB", True), ("96GiB", False)):
        true = plan_of(*LARGE_VOCABULARY, "--host-memory", host_memory)
        automatic, static = row_of(true), row_of(true, "colossal_gemini (all offloaded) + disk 100%")
        assert disk_labels(true)[-2:] == [HOST_BUDGET_LABEL, static.setting.label]
        assert automatic.fits and (automatic.disk_bytes < static.disk_bytes) == fewer
        assert automatic.disk_bytes <= static.disk_bytes
        assert not any(evaluation.fits for evaluation in true.evaluations if not evaluation.setting.uses_disk)
        assert true.recommendation.label == HOST_BUDGET_LABEL and true.recommendation.how == automatic.how
        assert "chosen because no setting without disk fits" in true.recommendation.reason
        assert any(note.startswith(f"checkpoints of {HOST_BUDGET_LABEL}: ") for note in true.notes)


def test_plain_sgd_gets_no_host_budget_row():
    # Nothing shaped like the parameters to send to disk: the static rows move masters instead (test_plan_disk.py).
    hardware = Hardware(2, 1, 80 * GIB, GIB, disk=Disk(3e9, 2e9))
    plan = make_plan(MODEL, hardware, Training("bf16-mixed", OPTIMIZERS["sgd"]), WORKLOAD)
    assert HOST_BUDGET_LABEL not in disk_labels(plan) and disk_labels(plan)


def test_the_json_carries_the_row(capsys):
    assert main([*LARGE_VOCABULARY, "--host-memory", "104GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    entry = next(entry for entry in data["settings"] if entry["setting"] == HOST_BUDGET_LABEL)
    assert entry["how"] == data["recommendation"]["how"]
    assert f"AutoPlacement(host_memory_budget={entry['host_memory_budget'] // MIB} * 2**20)" in entry["how"]
    assert entry["disk_fraction"] is None and entry["masters_on_disk"] is False
    assert entry["disk_bytes_per_rank"] == entry["model_state"]["optimizer_state"]["disk"] > 0
    assert entry["disk_bytes_per_node"] == 8 * entry["disk_bytes_per_rank"]
    assert entry["disk_io"]["read_bytes_per_step_per_node"] == entry["disk_bytes_per_node"]
    others = [other for other in data["settings"] if other["setting"] != HOST_BUDGET_LABEL]
    assert all(other["host_memory_budget"] is None and other["disk_fraction"] is not None for other in others)


# ---------------------------------------------------------------------------------------------- the real engine
# Bias-free layers whose weights fill chunks of the searched size (2**20 elements) exactly: six chunks, one of two
# members. Each record is 8 MiB of AdamW moments, and the tier streams up to 3 of them through staging buffers as
# large, so sending n <= 3 chunks' state to disk saves nothing; a budget is met from 4 chunks on.
WIDTHS = (1024, 1024, 512, 1024, 1024, 1024, 1024, 1024)
ENGINE_SHAPES = [(outputs, inputs) for inputs, outputs in zip(WIDTHS, WIDTHS[1:], strict=False)]


class ChunkedNetwork(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for inputs, outputs in zip(WIDTHS, WIDTHS[1:], strict=False):
            layers += [torch.nn.Linear(inputs, outputs, bias=False), torch.nn.Tanh()]
        self.layers = torch.nn.Sequential(*layers)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        (inputs,) = batch
        return self.layers(inputs).float().square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.randn(4, WIDTHS[0])), batch_size=2)


def engine_body(hows: list[str], precision: str) -> list[dict[str, Any] | str]:
    """One step of ``ChunkedNetwork`` on this one rank under each strategy of ``hows`` (the planner's ``use:``): the
    chunks whose optimizer state the engine put on disk and its memory report, or its refusal's message."""
    from lightning_colossal import AutoPlacement, GeminiStrategy
    from lightning_colossal.gemini.placement import HostBudgetTooSmall
    from tests.distributed.oracle import quiet_trainer

    results: list[dict[str, Any] | str] = []
    for how in hows:
        strategy = eval(how, {"GeminiStrategy": GeminiStrategy, "AutoPlacement": AutoPlacement})  # noqa: S307
        trainer = quiet_trainer(strategy=strategy, devices=1, max_steps=1, precision=precision)
        try:
            trainer.fit(ChunkedNetwork())
        except HostBudgetTooSmall as error:
            results.append(str(error))
            continue
        engine = trainer.strategy.engine
        tier = engine.disk_state
        assert tier is not None
        report = engine.memory_report()
        results.append(
            {
                "on_disk": [
                    chunk.index
                    for chunk in engine.manager.chunks
                    if any(id(view) in tier.on_disk for view in chunk.master_views)
                ],
                "chunks": report.num_chunks,
                "parameters": report.chunks.shard + report.chunks.master,
                "gradients": report.chunks.gradient,
                "optimizer_state": report.chunks.optimizer_state,
                "disk_bytes": report.disk_bytes,
                "file_bytes": os.stat(tier.file.path).st_size,
                "staging_bytes": report.disk_staging_bytes,
            }
        )
        engine.close_disk_tier()
    return results


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_the_engine_puts_on_disk_exactly_the_chunks_and_bytes_the_planner_said(rank_pool_1, tmp_path, precision):
    from lightning_colossal.disk.optimizer_state import staging_bytes_for

    training = Training(precision, ADAMW, device_type="cpu")
    layout = chunk_layout(ENGINE_SHAPES, training.parameter_bytes, host_budget_setting(1, "/unused"), 1, 0)
    host, state = engine_host_bytes(layout, training)
    assert len(layout) == 6 and [len(chunk.member_numels) for chunk in layout] == [1, 2, 1, 1, 1, 1]

    def least_with(count: int) -> int:  # the host bytes with the last ``count`` chunks' state on disk
        return sum(host) - sum(state[-count:]) + staging_bytes_for(state[-count:])

    # Exactly what four chunks on disk need, a byte less (five), and a byte less than everything on disk (refused).
    budgets = [least_with(4), least_with(4) - 1, least_with(6) - 1]
    settings = [host_budget_setting(budget, str(tmp_path)) for budget in budgets]
    planned = [disk_chunks_for_budget(ENGINE_SHAPES, training, setting, 1, 0) for setting in settings]
    (measured,) = rank_pool_1.run(engine_body, [setting.how for setting in settings], precision, timeout=300)
    assert [engine["on_disk"] if isinstance(engine, dict) else None for engine in measured] == [
        None if chunks is None else sorted(chunks) for chunks in planned
    ], "the engine chose other chunks than the planner"
    assert planned == [frozenset({2, 3, 4, 5}), frozenset({1, 2, 3, 4, 5}), None], "the budgets test what they say"
    for setting, chunks, engine in zip(settings[:2], planned[:2], measured[:2], strict=True):
        assert chunks is not None and isinstance(engine, dict) and engine["chunks"] == len(layout)
        row = replace(setting, disk_chunks=chunks)
        state_of_row = model_state(ENGINE_SHAPES, row, training, 1, 0)
        records = disk_records_of(ENGINE_SHAPES, row, training, 1, 0)
        assert state_of_row.parameters.in_memory == engine["parameters"]
        assert state_of_row.gradients.in_memory == engine["gradients"]
        assert state_of_row.optimizer_state.in_memory == engine["optimizer_state"], "Adam's steps stay in memory"
        assert state_of_row.placed.disk == records.file_bytes == engine["disk_bytes"] == engine["file_bytes"]
        assert records.staging_bytes == engine["staging_bytes"]
        # Within the budget, but for Adam's step scalars, which the budget does not count.
        steps = 4 * len(ENGINE_SHAPES)
        assert state_of_row.placed.host + records.staging_bytes - steps <= setting.host_memory_budget
    refusal = measured[2]
    assert isinstance(refusal, str) and f"more than host_memory_budget={budgets[2]:,}" in refusal
