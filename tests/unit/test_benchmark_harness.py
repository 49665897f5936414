"""The pure parts of the benchmark harness: statistics, formulas, byte accounting, argument checks, summaries.

No process group and no Lightning import: the whole module runs in well under five seconds.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import benchmarks.peers.configuration
from benchmarks.harness.launch import window_other_load
from benchmarks.harness.measure import (
    MODEL_STATE_FORMULAS,
    STRATEGY_MODES,
    covered_bytes,
    gemini_model_state_bytes,
    gradient_bytes,
    optimizer_state_bytes,
    paired_ratios,
    parameter_bytes,
    percentile,
    run_step_time,
    summarize,
)
from benchmarks.peers.configuration import (
    BENCHMARK_MODEL,
    DEEPSPEED_INSTALL_COMMAND,
    DEEPSPEED_STAGES,
    check_deepspeed_installed,
    parse_configuration,
    parse_strategy_names,
)
from benchmarks.peers.report import format_markdown, format_text, summarize_configurations
from benchmarks.peers.run import parse_arguments

# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


def test_percentile_interpolates_between_order_statistics() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 0.0) == 1.0
    assert percentile(values, 1.0) == 5.0
    assert percentile(values, 0.5) == 3.0
    assert percentile(values, 0.2) == pytest.approx(1.8)
    assert percentile([7.0], 0.2) == 7.0


@pytest.mark.parametrize("values, fraction", [([], 0.2), ([1.0], -0.1), ([1.0], 1.5)])
def test_percentile_rejects_bad_input(values: list[float], fraction: float) -> None:
    with pytest.raises(ValueError):
        percentile(values, fraction)


def test_run_step_time_takes_the_slowest_rank_per_step_then_the_statistic() -> None:
    rank0 = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    rank1 = [1.5, 1.0, 3.5, 1.0, 1.0, 1.0]
    # Per-step slowest: [1.5, 2.0, 3.5, 4.0, 5.0, 6.0].
    assert run_step_time([rank0, rank1], "min") == 1.5
    assert run_step_time([rank0, rank1], "median") == pytest.approx(3.75)
    assert run_step_time([rank0, rank1], "p20") == pytest.approx(2.0)


def test_run_step_time_rejects_unknown_statistic_and_ragged_ranks() -> None:
    with pytest.raises(ValueError, match="Unknown statistic"):
        run_step_time([[1.0]], "p99")
    with pytest.raises(ValueError, match="different numbers of steps"):
        run_step_time([[1.0, 2.0], [1.0]], "p20")
    with pytest.raises(ValueError):
        run_step_time([], "p20")


def test_paired_ratios_pair_by_repeat_and_skip_unpaired_repeats() -> None:
    ours = {0: 1.1, 1: 0.9, 2: 2.0, 4: 1.0}
    peer = {0: 1.0, 1: 1.0, 2: 1.6, 3: 5.0}
    assert paired_ratios(ours, peer) == pytest.approx([1.1, 0.9, 1.25])
    summary = summarize(paired_ratios(ours, peer))
    assert (summary.median, summary.minimum, summary.maximum, summary.count) == pytest.approx((1.1, 0.9, 1.25, 3))
    with pytest.raises(ValueError):
        summarize([])


# ---------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode, expression, total_per_parameter_at_4_ranks",
    [("ddp", "16Ψ", 16.0), ("zero1", "8Ψ + 8Ψ/N", 10.0), ("zero2", "4Ψ + 12Ψ/N", 7.0), ("zero3", "16Ψ/N", 4.0)],
)
def test_formula_table(mode: str, expression: str, total_per_parameter_at_4_ranks: float) -> None:
    formula = MODEL_STATE_FORMULAS[mode]
    assert formula.expression() == expression
    parameter_count = 1000
    assert formula.bytes(parameter_count, 4).total == pytest.approx(total_per_parameter_at_4_ranks * parameter_count)
    # At one rank every mode holds the full 16 bytes per parameter.
    assert formula.bytes(parameter_count, 1).total == pytest.approx(16 * parameter_count)


def test_formula_categories_of_zero2() -> None:
    bytes_per_rank = MODEL_STATE_FORMULAS["zero2"].bytes(parameter_count=100, world_size=2)
    assert (bytes_per_rank.parameters, bytes_per_rank.gradients, bytes_per_rank.optimizer_state) == (400, 200, 400)


def test_every_known_strategy_maps_to_a_formula() -> None:
    assert set(STRATEGY_MODES.values()) <= set(MODEL_STATE_FORMULAS)
    assert STRATEGY_MODES["colossal_ddp"] == STRATEGY_MODES["ddp"] == "ddp"
    for gemini in ("colossal_gemini", "colossal_gemini_auto", "colossal_gemini_offload"):
        assert STRATEGY_MODES[gemini] == STRATEGY_MODES["colossal_fsdp"] == "zero3"


def _memory_report(
    shard: int, master: int, gradient: int, optimizer_state: int, replicated: int = 0, gathered: int = 0
) -> dict[str, Any]:
    """A ``GeminiMemoryReport`` as the worker writes it: the NamedTuple and its ``ChunkBytes`` as dicts."""
    chunks = {
        "shard": shard,
        "gathered": gathered,
        "master": master,
        "gradient": gradient,
        "optimizer_state": optimizer_state,
        "compute": shard + gathered + master + gradient + optimizer_state,
        "offload": 0,
    }
    return {"chunks": chunks, "replicated_bytes": replicated, "num_parameters": 100, "chunk_numel": 64, "num_chunks": 2}


def test_gemini_bytes_from_its_memory_report_meet_zero3_in_fp32() -> None:
    # Ψ = 100 over N = 2 ranks in fp32: the shard is its own master (0 separate bytes), gradient shard 4Ψ/N, Adam
    # state 8Ψ/N plus two 4-byte step scalars; a gathered chunk does not count.
    report = _memory_report(shard=200, master=0, gradient=200, optimizer_state=400 + 8, gathered=256)
    measured = gemini_model_state_bytes(report)
    assert measured == {"parameters": 200, "gradients": 200, "optimizer_state": 408}
    formula = MODEL_STATE_FORMULAS[STRATEGY_MODES["colossal_gemini"]].bytes(parameter_count=100, world_size=2)
    assert (formula.parameters, formula.gradients, formula.optimizer_state) == (200, 200, 400)
    assert sum(measured.values()) - formula.total == 8


def test_gemini_parameters_count_separate_masters_and_parameters_outside_chunks() -> None:
    # bf16 shards with fp32 masters beside them, and a frozen parameter of 12 bytes whole on every rank.
    report = _memory_report(shard=100, master=200, gradient=200, optimizer_state=400, replicated=12)
    assert gemini_model_state_bytes(report)["parameters"] == 100 + 200 + 12


# ---------------------------------------------------------------------------------------------------------------
# Byte accounting
# ---------------------------------------------------------------------------------------------------------------


class TiedModel(nn.Module):
    """Embedding 10x4 tied to the output head, one hidden Linear 4x4 with bias: Ψ = 40 + 16 + 4 = 60."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.hidden(self.embedding(tokens))))


def test_model_state_bytes_after_one_adamw_step_match_16_bytes_per_parameter_plus_step_tensors() -> None:
    torch.manual_seed(0)
    model = TiedModel()
    parameters = list(model.parameters())  # de-duplicates the tied weight: 3 tensors
    parameter_count = sum(parameter.numel() for parameter in parameters)
    assert (len(parameters), parameter_count) == (3, 60)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    logits = model(torch.tensor([[1, 2, 3]]))
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.tensor([2, 3, 4])).backward()
    optimizer.step()

    # The tied weight appears twice when listed by module; it still counts once.
    assert parameter_bytes([model.embedding.weight, model.head.weight, *parameters]) == 4 * parameter_count
    assert gradient_bytes(model.parameters()) == 4 * parameter_count
    total, by_key = optimizer_state_bytes([optimizer])
    step_bytes = sum(state["step"].numel() * state["step"].element_size() for state in optimizer.state.values())
    assert step_bytes == 3 * 4  # one float32 scalar per parameter tensor
    assert by_key == {"exp_avg": 4 * parameter_count, "exp_avg_sq": 4 * parameter_count, "step": step_bytes}
    assert total == 8 * parameter_count + step_bytes


def test_gradient_bytes_skip_parameters_without_gradient() -> None:
    model = nn.Linear(3, 2)
    assert gradient_bytes(model.parameters()) == 0
    model.weight.grad = torch.zeros_like(model.weight)
    assert gradient_bytes(model.parameters()) == 6 * 4


def test_covered_bytes_count_views_of_one_flat_buffer_by_their_union() -> None:
    flat = torch.zeros(100)
    first, second, overlapping = flat[0:30], flat[30:50], flat[40:60]
    assert covered_bytes([first, second]) == 50 * 4
    assert covered_bytes([first, second, overlapping]) == 60 * 4
    assert covered_bytes([first, flat[80:90]]) == 40 * 4  # a gap between views is not counted
    assert covered_bytes([flat.view(10, 10).t()]) == 100 * 4  # a transposed view spans the whole buffer
    assert covered_bytes([torch.zeros(5, dtype=torch.float64), torch.zeros(0)]) == 5 * 8


def test_covered_bytes_rejects_meta_tensors() -> None:
    with pytest.raises(ValueError, match="meta"):
        covered_bytes([torch.empty(3, device="meta")])


# ---------------------------------------------------------------------------------------------------------------
# Arguments and configurations
# ---------------------------------------------------------------------------------------------------------------


def test_arguments_of_the_documented_command() -> None:
    arguments = parse_arguments(
        ["--strategies", "colossal_ddp,ddp", "--peer", "ddp", "--repeats", "5", "--steps", "12", "--warmup", "3"]
    )
    assert [configuration.label for configuration in arguments.configurations] == ["colossal_ddp", "ddp"]
    assert [configuration.mode for configuration in arguments.configurations] == ["ddp", "ddp"]
    assert (arguments.repeats, arguments.steps, arguments.warmup, arguments.statistic) == (5, 12, 3, "p20")
    assert arguments.model_config == BENCHMARK_MODEL
    assert (arguments.world_size, arguments.batch_size_per_rank, arguments.sequence_length) == (2, 4, 128)


def test_arguments_of_the_documented_gemini_command() -> None:
    arguments = parse_arguments(
        [
            "--strategies",
            "colossal_gemini,colossal_gemini_offload",
            "--configuration",
            "label=lightning_fsdp2",
            "strategy=lightning.pytorch.strategies:ModelParallelStrategy",
            'args={"data_parallel_size":2,"tensor_parallel_size":1}',
            "mode=zero3",
            "--peer",
            "lightning_fsdp2",
        ]
    )
    labels = [configuration.label for configuration in arguments.configurations]
    assert labels == ["colossal_gemini", "colossal_gemini_offload", "lightning_fsdp2"]
    assert [configuration.mode for configuration in arguments.configurations] == ["zero3"] * 3
    assert arguments.peer == "lightning_fsdp2"


def test_configuration_tokens_carry_class_arguments_and_mode() -> None:
    arguments = parse_arguments(
        [
            "--strategies",
            "ddp",
            "--configuration",
            "label=fsdp2",
            "strategy=lightning.pytorch.strategies:ModelParallelStrategy",
            'args={"data_parallel_size": 2, "tensor_parallel_size": 1}',
            "mode=zero3",
        ]
    )
    configuration = arguments.configurations[1]
    assert configuration.label == "fsdp2"
    assert configuration.strategy == "lightning.pytorch.strategies:ModelParallelStrategy"
    assert configuration.init_args == {"data_parallel_size": 2, "tensor_parallel_size": 1}
    assert configuration.mode == "zero3"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "nothing to run"),
        (["--strategies", "colossal_ddp,ddp", "--peer", "fsdp"], "--peer 'fsdp' is not one of"),
        (["--strategies", "ddp,ddp"], "unique"),
        (["--strategies", "ddp", "--repeats", "0"], "must be a positive integer"),
        (["--strategies", "ddp", "--warmup", "-1"], "must be >= 0"),
        (["--strategies", "ddp", "--statistic", "p99"], "invalid choice"),
        (["--strategies", "ddp", "--max-load", "-0.5"], "must be >= 0"),
        (["--strategies", "ddp,:Class"], "module:Class"),
        (["--strategies", "ddp", "--model-config", "[1]"], "JSON object"),
        (["--strategies", "ddp", "--model-config", "{bad"], "not valid JSON"),
        (["--strategies", "ddp", "--sequence-length", "256"], "exceeds the model's block_size"),
        (["--configuration", "label=x"], "strategy=..."),
        (["--configuration", "label=x", "strategy=ddp", "mode=zero9"], "Unknown mode"),
        (["--configuration", "label=x", "strategy=ddp", "args=[1]"], "JSON object"),
        (["--configuration", "label=x", "strategy=ddp", "colour=red"], "Unknown --configuration key"),
        (["--configuration", "label=x", "strategy=ddp", "ddp"], "not key=value"),
    ],
)
def test_argument_errors_exit_with_a_message(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_arguments(argv)
    assert raised.value.code == 2
    assert message in capsys.readouterr().err


def test_parse_helpers_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="at least one name"):
        parse_strategy_names(" , ")
    with pytest.raises(ValueError, match="given twice"):
        parse_configuration(["label=a", "label=b", "strategy=ddp"])
    assert parse_configuration(["label=a", "strategy=my.module:Strategy"]).mode is None


# ---------------------------------------------------------------------------------------------------------------
# DeepSpeed configurations (no DeepSpeed needed: whether it is installed is patched either way)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def deepspeed_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks.peers.configuration, "deepspeed_installed", lambda: True)


@pytest.fixture
def deepspeed_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchmarks.peers.configuration, "deepspeed_installed", lambda: False)


@pytest.mark.usefixtures("deepspeed_present")
def test_deepspeed_stages_parse_with_their_zero_formulas() -> None:
    arguments = parse_arguments(
        ["--strategies", "deepspeed_zero1,deepspeed_zero2,deepspeed_zero3,ddp", "--peer", "ddp"]
    )
    assert [configuration.mode for configuration in arguments.configurations] == ["zero1", "zero2", "zero3", "ddp"]
    assert DEEPSPEED_STAGES == {"deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}
    # args of a DeepSpeed configuration are zero_optimization settings; the mode follows the stage's name.
    configuration = parse_configuration(
        ["label=ds3_small_buckets", "strategy=deepspeed_zero3", 'args={"reduce_bucket_size": 6553600}']
    )
    assert (configuration.mode, configuration.init_args) == ("zero3", {"reduce_bucket_size": 6553600})


@pytest.mark.usefixtures("deepspeed_absent")
def test_a_missing_deepspeed_is_named_with_its_install_command(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_arguments(["--strategies", "colossal_zero2,deepspeed_zero2", "--peer", "colossal_zero2"])
    assert raised.value.code == 2
    error = capsys.readouterr().err
    assert "deepspeed_zero2 need DeepSpeed, which is not installed" in error
    assert "pip install --no-build-isolation" in error and "benchmark-deepspeed" in DEEPSPEED_INSTALL_COMMAND
    # Without a DeepSpeed configuration nothing asks for it.
    check_deepspeed_installed(parse_strategy_names("colossal_zero2,ddp"))
    assert parse_arguments(["--strategies", "colossal_zero2,ddp"]).peer is None


def test_deepspeed_installed_answers_without_importing_it() -> None:
    assert isinstance(benchmarks.peers.configuration.deepspeed_installed(), bool)


# ---------------------------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------------------------


def _rank(rank: int, step_time: float, parameter_count: int = 100) -> dict[str, Any]:
    return {
        "rank": rank,
        "step_times": [step_time, step_time * 1.5, step_time * 2.0],
        "losses": [3.0, 2.0],
        "peak_rss_bytes": 400 * 1024 * 1024,
        "parameter_count": parameter_count,
        "bytes": {
            "parameters": 4 * parameter_count,
            "gradients": 4 * parameter_count,
            "optimizer_state": 8 * parameter_count + 8,
            "optimizer_state_by_key": {"exp_avg": 400, "exp_avg_sq": 400, "step": 8},
        },
        "window": {"wall_seconds": 10.0, "process_cpu_seconds": 9.0, "system_busy_seconds": 20.0},
    }


def _run(label: str, repeat: int, step_time: float, status: str = "accepted") -> dict[str, Any]:
    return {
        "label": label,
        "repeat": repeat,
        "status": status,
        "other_load": 0.1,
        "ranks": [_rank(0, step_time), _rank(1, step_time)],
    }


def test_summaries_pair_runs_within_a_repeat_and_ignore_discarded_runs() -> None:
    runs = [
        _run("ours", 0, 1.1),
        _run("peer", 0, 1.0),
        _run("ours", 1, 5.0, status="discarded"),  # a disturbed run must not enter any figure
        _run("ours", 1, 2.2),
        _run("peer", 1, 2.0),
        _run("peer", 2, 1.0),
        _run("ours", 2, 0.9),
        _run("peer", 3, 1.0),
        _run("ours", 3, 9.0, status="discarded"),  # every attempt disturbed: repeat 3 has no pair
    ]
    configurations: list[dict[str, Any]] = [
        {"label": "ours", "strategy": "x", "mode": "ddp"},
        {"label": "peer", "strategy": "y", "mode": None},
    ]
    ours, peer = summarize_configurations(runs, configurations, "peer", "min", tokens_per_step=1024)
    assert ours.ratios_to_peer == pytest.approx([1.1, 1.1, 0.9])
    assert ours.ratio_to_peer is not None
    assert (ours.ratio_to_peer.median, ours.ratio_to_peer.minimum) == pytest.approx((1.1, 0.9))
    assert ours.step_time.median == pytest.approx(1.1)
    assert ours.tokens_per_second == pytest.approx(1024 / 1.1)
    assert peer.ratio_to_peer is None
    formula_total = ours.model_state[0].formula_total
    assert formula_total == pytest.approx(1600)
    assert formula_total is not None and ours.model_state[0].total - formula_total == pytest.approx(8)
    assert peer.model_state[0].formula_total is None
    text = format_text([ours, peer], "peer", ["Machine: test"])
    markdown = format_markdown([ours, peer], "peer", ["Machine: test"])
    assert "1.100 [0.900–1.100] (n=3)" in text and "16Ψ" in text
    assert markdown.startswith("- Machine: test") and "| ours | 0 |" in markdown


def _gemini_run(gathered_peak: int | None, walked_optimizer_state: int = 408) -> dict[str, Any]:
    run = _run("gemini", 0, 1.0)
    for rank in run["ranks"]:
        report = _memory_report(shard=200, master=0, gradient=200, optimizer_state=408)
        rank["bytes"] = {
            **gemini_model_state_bytes(report),
            "optimizer_state_by_key": {"exp_avg": 200, "exp_avg_sq": 200, "step": 8},
            "memory_report": report,
            "gathered_peak": gathered_peak,
            "gathered_peak_source": None if gathered_peak is None else "engine",
            "tensor_walk": {"parameters": 0, "gradients": 200, "optimizer_state": walked_optimizer_state},
        }
    return run


def test_gemini_summary_is_compared_with_zero3_and_notes_its_report_and_working_set() -> None:
    configurations: list[dict[str, Any]] = [{"label": "gemini", "strategy": "colossal_gemini", "mode": "zero3"}]
    (gemini,) = summarize_configurations([_gemini_run(3 * 1024 * 1024)], configurations, None, "min", 1024)
    assert gemini.formula_expression == "16Ψ/N"
    assert [rank_bytes.total for rank_bytes in gemini.model_state] == [808, 808]
    assert gemini.model_state[0].formula_total == pytest.approx(800)
    assert gemini.model_state[0].gathered_peak == 3 * 1024 * 1024
    text = format_text([gemini], None, ["Machine: test"])
    assert "| gemini | 0 |" in format_markdown([gemini], None, ["Machine: test"])
    assert "memory_report()" in text and "chunks: 2 × 64 elements" in text
    assert "rank 1: shards 200 B + separate masters 0 B + whole parameters outside chunks 0 B" in text
    assert "(engine), MiB per rank: 3.00 / 3.00" in text
    assert "tensor walk differ" not in text
    assert gemini.to_json()["model_state"][0]["memory_report"]["chunks"]["shard"] == 200


def test_gemini_notes_say_when_the_peak_is_missing_and_when_the_counts_disagree() -> None:
    configurations: list[dict[str, Any]] = [{"label": "gemini", "strategy": "colossal_gemini", "mode": "zero3"}]
    run = _gemini_run(None, walked_optimizer_state=400)
    text = format_text(summarize_configurations([run], configurations, None, "min", 1024), None, [])
    assert "no peak of gathered chunks" in text
    assert "rank 0: the report and the tensor walk differ: optimizer_state 408 B by the report, 400 B" in text


def test_window_other_load_subtracts_every_rank_s_own_cpu_time() -> None:
    ranks = [_rank(0, 1.0), _rank(1, 1.0)]
    # 20 busy seconds in a 10 s window, 18 of them ours: others used 0.2 cores on average.
    assert window_other_load(ranks) == pytest.approx(0.2)
    ranks[0]["window"]["system_busy_seconds"] = float("nan")
    assert window_other_load(ranks) is None


def test_deepspeed_notes_split_its_parameters_and_name_its_other_buffers() -> None:
    run = _run("deepspeed_zero2", 0, 1.0)
    for rank in run["ranks"]:
        rank["bytes"] = {
            # Ψ = 100, N = 2: whole parameters 400 B, a separate fp32 master partition 200 B.
            "parameters": 600,
            "gradients": 200,
            "optimizer_state": 408,
            "optimizer_state_by_key": {"exp_avg": 200, "exp_avg_sq": 200, "step": 8},
            "parameter_split": {"model_storage": 400, "separate_partitions_and_masters": 200},
            "engine_other_bytes": 2 * 1024 * 1024,
            "engine_bytes_by_attribute": {"ipg_buckets": 2 * 1024 * 1024},
        }
    configurations: list[dict[str, Any]] = [
        {"label": "deepspeed_zero2", "strategy": "deepspeed_zero2", "mode": "zero2"}
    ]
    (summary,) = summarize_configurations([run], configurations, None, "min", 1024)
    assert summary.model_state[0].total - (summary.model_state[0].formula_total or 0) == pytest.approx(208)
    text = format_text([summary], None, [])
    assert "model parameter storage 400 B + DeepSpeed's separate partitions and fp32 masters 200 B" in text
    assert "MiB per rank: 2.00 / 2.00" in text and "ipg_buckets 2.00" in text


def test_deepspeed_config_is_fp32_with_lightning_s_zero_defaults_under_the_configuration_s_args() -> None:
    from benchmarks.peers.configuration import RunSpec
    from benchmarks.peers.deepspeed_worker import deepspeed_config  # imports no DeepSpeed

    spec = RunSpec(
        strategy="deepspeed_zero3",
        init_args={"reduce_bucket_size": 1000},
        model_config=BENCHMARK_MODEL,
        world_size=2,
        batch_size_per_rank=4,
        sequence_length=128,
        warmup_steps=1,
        measured_steps=2,
        learning_rate=3e-4,
        seed=0,
        result_directory="/unused",
    )
    config = deepspeed_config(spec)
    assert config["zero_optimization"]["stage"] == 3
    assert config["zero_optimization"]["reduce_bucket_size"] == 1000
    assert config["zero_optimization"]["allgather_bucket_size"] == 200_000_000
    assert config["train_micro_batch_size_per_gpu"] == 4 and config["zero_allow_untested_optimizer"]
    assert not {"fp16", "bf16", "optimizer", "scheduler"} & config.keys()  # fp32; torch's AdamW is the client optimizer


def test_compute_floor_deals_every_parameter_to_exactly_one_rank_and_balances_the_elements() -> None:
    from benchmarks.peers.compute_floor import rank_share

    sizes = [4_194_304, 512, 262_144, 786_432, 512, 1_048_576, 262_144, 4_194_304]
    shares = [rank_share(sizes, 2, rank) for rank in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(len(sizes)))
    loads = [sum(sizes[index] for index in share) for share in shares]
    assert abs(loads[0] - loads[1]) <= max(sizes[index] for index in range(len(sizes)) if sizes[index] < 4_194_304)
    assert rank_share(sizes, 1, 0) == list(range(len(sizes)))


def _with_moments(run: dict[str, Any], start: float, setup: float, steps: float, teardown: float) -> dict[str, Any]:
    """``run`` with its ranks' moments: rank 1 reaches the Trainer 2 s later (a slower import) than rank 0."""
    for lateness, rank in zip((0.0, 2.0), run["ranks"], strict=True):
        first_batch = start + 2.0 + setup
        rank["moments"] = {
            "before_trainer": start + lateness,
            "first_batch": first_batch,
            "last_batch_end": first_batch + steps,
            "fit_returned": first_batch + steps + teardown + lateness / 10,
        }
    return run


def test_setup_teardown_and_whole_fit_are_timed_from_the_last_rank_and_paired_with_the_peer() -> None:
    runs = [
        _with_moments(_run("ours", 0, 1.0), 100.0, setup=1.0, steps=10.0, teardown=1.0),
        _with_moments(_run("peer", 0, 1.0), 200.0, setup=0.5, steps=10.0, teardown=0.0),
        _run("ours", 1, 1.0),  # recorded no moments (another harness's worker): in no fit figure
        _run("peer", 1, 1.0),
    ]
    configurations: list[dict[str, Any]] = [
        {"label": "ours", "strategy": "x", "mode": "ddp"},
        {"label": "peer", "strategy": "y", "mode": None},
    ]
    ours, peer = summarize_configurations(runs, configurations, "peer", "min", tokens_per_step=1024)
    assert ours.setup_seconds is not None and ours.teardown_seconds is not None
    # From the last rank's arrival (rank 1, 2 s late), not rank 0's: the wait for a slower import is not setup.
    assert ours.setup_seconds.median == pytest.approx(1.0) and ours.setup_seconds.count == 1
    assert ours.teardown_seconds.median == pytest.approx(1.2)
    assert ours.fit_ratio_to_peer is not None and ours.fit_ratio_to_peer.count == 1
    assert ours.fit_ratio_to_peer.median == pytest.approx((1.0 + 10.0 + 1.2) / (0.5 + 10.0 + 0.2))
    assert peer.fit_ratio_to_peer is None
    text = format_text([ours, peer], "peer", [])
    assert "1.00 / 1.20" in text and "0.50 / 0.20" in text and "1.140 [1.140–1.140]" in text
    (alone,) = summarize_configurations(runs[2:3], configurations[:1], None, "min", 1024)
    assert alone.setup_seconds is None and "n/a" in format_text([alone], None, [])
