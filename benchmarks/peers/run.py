"""Side-by-side benchmark of training strategies on the same model, data and settings, in one invocation.

Example (the setting of ``benchmarks/RESULTS.md``: 2 CPU ranks, 27.4M GPT, global batch 8, fp32 AdamW)::

    python -m benchmarks.peers --strategies colossal_ddp,ddp --peer ddp --repeats 5 --steps 12 --warmup 3 \
        --max-load 0.3 --output benchmarks/out/ddp.json --markdown

Every (repeat, configuration) is a fresh run of ``--world-size`` rank processes (``benchmarks.peers.worker``) joined
through the environment. Each repeat runs the configurations in a fresh seeded random order; each run is paired
with the peer's run of the same repeat, and the report gives the median and range of those ratios. With
``--max-load``, a run during which other processes used more than that many cores is discarded and redone.
See ``benchmarks/README.md`` for the columns.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, RunFailed, launch_ranks, wait_for_quiet, window_other_load
from benchmarks.harness.machine import cpu_description, git_revision, read_cpu_times, software_versions
from benchmarks.harness.measure import STEP_TIME_STATISTICS, run_step_time
from benchmarks.peers.configuration import (
    BENCHMARK_MODEL,
    Configuration,
    RunSpec,
    check_deepspeed_installed,
    parse_configuration,
    parse_strategy_names,
)
from benchmarks.peers.report import ACCEPTED_STATUSES, format_markdown, format_text, summarize_configurations

__all__ = ["RunFailed", "launch_ranks", "launch_run", "main", "parse_arguments", "wait_for_quiet"]


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.peers",
        description="Benchmark training strategies side by side (see benchmarks/README.md).",
    )
    what = parser.add_argument_group("what to compare")
    what.add_argument(
        "--strategies",
        help="comma-separated registered names or module:Class, each its own label, e.g. colossal_ddp,ddp",
    )
    what.add_argument(
        "--configuration",
        action="append",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="one more configuration: label=L strategy=NAME|module:Class [args=JSON] [mode=ddp|zero1|zero2|zero3]; "
        "repeatable",
    )
    what.add_argument("--peer", help="label every other configuration is divided by, run for run (e.g. ddp)")
    workload = parser.add_argument_group("workload")
    workload.add_argument("--world-size", type=_positive_int, default=2, help="rank processes per run (default 2)")
    workload.add_argument("--batch-size-per-rank", type=_positive_int, default=4, help="sequences per rank (4)")
    workload.add_argument("--sequence-length", type=_positive_int, default=128, help="tokens per sequence (128)")
    workload.add_argument("--learning-rate", type=_positive_float, default=3e-4, help="AdamW learning rate (3e-4)")
    workload.add_argument(
        "--model-config",
        default="{}",
        help="JSON object overriding GPTConfig fields of the 27.4M benchmark model, e.g. '{\"num_layers\": 2}'",
    )
    method = parser.add_argument_group("method")
    method.add_argument("--repeats", type=_positive_int, default=5, help="runs of every configuration (5)")
    method.add_argument("--steps", type=_positive_int, default=12, help="measured steps per run (12)")
    method.add_argument("--warmup", type=_non_negative_int, default=3, help="unmeasured steps before them (3)")
    method.add_argument(
        "--statistic", choices=sorted(STEP_TIME_STATISTICS), default="p20", help="per-run step statistic (p20)"
    )
    method.add_argument("--seed", type=int, default=0, help="seed of the run order, weights and data (0)")
    method.add_argument(
        "--max-load",
        type=_non_negative_float,
        help="discard and redo a run during which other processes used more than this many cores",
    )
    method.add_argument("--max-attempts", type=_positive_int, default=3, help="tries per run under --max-load (3)")
    method.add_argument(
        "--quiet-wait",
        type=_non_negative_float,
        default=120.0,
        help="seconds to wait for the load to drop under --max-load before starting a run (120)",
    )
    method.add_argument("--run-timeout", type=_positive_float, default=600.0, help="seconds before a run is killed")
    output = parser.add_argument_group("output")
    output.add_argument("--output", type=Path, help="JSON file for every raw measurement, e.g. benchmarks/out/x.json")
    output.add_argument("--markdown", action="store_true", help="also print a markdown block for RESULTS.md")
    return parser


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the command line; ``configurations`` and ``model_config`` are added to the namespace.

    Errors exit with status 2 and a message that names the fix (argparse's ``parser.error``).
    """
    parser = _build_parser()
    arguments = parser.parse_args(argv)
    configurations: list[Configuration] = []
    try:
        if arguments.strategies is not None:
            configurations.extend(parse_strategy_names(arguments.strategies))
        configurations.extend(parse_configuration(tokens) for tokens in arguments.configuration)
        check_deepspeed_installed(configurations)
    except ValueError as error:
        parser.error(str(error))
    if not configurations:
        parser.error("nothing to run: give --strategies a,b and/or --configuration label=... strategy=...")
    labels = [configuration.label for configuration in configurations]
    duplicates = sorted({label for label in labels if labels.count(label) > 1})
    if duplicates:
        parser.error(f"configuration labels must be unique; {duplicates} given more than once")
    if arguments.peer is not None and arguments.peer not in labels:
        parser.error(f"--peer {arguments.peer!r} is not one of the configurations {labels}")
    try:
        overrides = json.loads(arguments.model_config)
    except json.JSONDecodeError as error:
        parser.error(f"--model-config is not valid JSON: {error}")
    if not isinstance(overrides, dict):
        parser.error("--model-config must be a JSON object, e.g. '{\"num_layers\": 2}'")
    model_config = {**BENCHMARK_MODEL, **overrides}
    if arguments.sequence_length > model_config["block_size"]:
        parser.error(
            f"--sequence-length {arguments.sequence_length} exceeds the model's block_size {model_config['block_size']}; "
            "lower it or raise block_size in --model-config"
        )
    arguments.configurations = configurations
    arguments.model_config = model_config
    return arguments


# ---------------------------------------------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------------------------------------------


def launch_run(spec: RunSpec, timeout: float) -> dict[str, Any]:
    """Start the ranks of one run, wait for them and return their results and the run's whole-run CPU figures.

    Raises:
        RunFailed: a rank failed or the run passed ``timeout`` seconds; the message holds every rank's log tail.
    """
    directory = Path(spec.result_directory)
    spec_path = directory / "spec.json"
    spec.write(spec_path)
    cpu_before = read_cpu_times()
    children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    try:
        port = launch_ranks("benchmarks.peers.worker", ["--spec", str(spec_path)], spec.world_size, directory, timeout)
    except RunFailed as error:
        raise RunFailed(f"Run of {spec.strategy}: {error}") from None
    wall = time.perf_counter() - start
    children_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_after = read_cpu_times()
    own_cpu = (children_after.ru_utime + children_after.ru_stime) - (
        children_before.ru_utime + children_before.ru_stime
    )
    whole_run_load = None
    if cpu_before is not None and cpu_after is not None:
        whole_run_load = max(0.0, cpu_after.busy_seconds - cpu_before.busy_seconds - own_cpu) / wall
    ranks = [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(spec.world_size)]
    return {"wall_seconds": wall, "whole_run_other_load": whole_run_load, "port": port, "ranks": ranks}


# ---------------------------------------------------------------------------------------------------------------
# The benchmark
# ---------------------------------------------------------------------------------------------------------------


def _spec(arguments: argparse.Namespace, configuration: Configuration, result_directory: Path) -> RunSpec:
    return RunSpec(
        strategy=configuration.strategy,
        init_args=configuration.init_args,
        model_config=arguments.model_config,
        world_size=arguments.world_size,
        batch_size_per_rank=arguments.batch_size_per_rank,
        sequence_length=arguments.sequence_length,
        warmup_steps=arguments.warmup,
        measured_steps=arguments.steps,
        learning_rate=arguments.learning_rate,
        seed=arguments.seed,
        result_directory=str(result_directory),
    )


def _measure_configuration(
    arguments: argparse.Namespace, configuration: Configuration, repeat: int, scratch: Path
) -> list[dict[str, Any]]:
    """All attempts at one (repeat, configuration): the first under the load limit is accepted, the others are
    discarded. When every attempt was over it, the repeat has no run of this configuration: a disturbed run
    would pass noise off as a difference, so it is left out of the figures (and kept in the raw JSON)."""
    attempts: list[dict[str, Any]] = []
    for attempt in range(1, arguments.max_attempts + 1):
        load_before = (
            wait_for_quiet(arguments.max_load, arguments.quiet_wait) if arguments.max_load is not None else None
        )
        result_directory = scratch / f"repeat{repeat}-{configuration.label}-attempt{attempt}"
        result_directory.mkdir(parents=True)
        outcome = launch_run(_spec(arguments, configuration, result_directory), arguments.run_timeout)
        other_load = window_other_load(outcome["ranks"])
        step_time = run_step_time([rank["step_times"] for rank in outcome["ranks"]], arguments.statistic)
        disturbed = arguments.max_load is not None and other_load is not None and other_load > arguments.max_load
        record = {
            "label": configuration.label,
            "repeat": repeat,
            "attempt": attempt,
            "status": "discarded" if disturbed else "accepted",
            "step_time": step_time,
            "other_load": other_load,
            "other_load_before": load_before,
            **outcome,
        }
        attempts.append(record)
        load_text = "unknown" if other_load is None else f"{other_load:.2f}"
        print(
            f"    {configuration.label:<24} attempt {attempt}: {arguments.statistic} step {step_time:.3f} s, "
            f"other load {load_text} cores, wall {outcome['wall_seconds']:.1f} s -> {record['status']}",
            flush=True,
        )
        if not disturbed:
            return attempts
    print(f"    {configuration.label}: every attempt over the load limit; repeat {repeat + 1} has no run of it")
    return attempts


def _header_lines(arguments: argparse.Namespace, context: dict[str, Any], runs: Sequence[dict[str, Any]]) -> list[str]:
    versions = context["software"]
    accepted = sum(run["status"] in ACCEPTED_STATUSES for run in runs)
    discarded = sum(run["status"] == "discarded" for run in runs)
    missing = len(arguments.repeats * arguments.configurations) - accepted
    parameter_count = runs[0]["ranks"][0]["parameter_count"] if runs else 0
    load_rule = (
        f"a run was discarded and redone when other processes used more than {arguments.max_load} cores during its "
        f"measured steps (at most {arguments.max_attempts} attempts)"
        if arguments.max_load is not None
        else "no load limit (--max-load not given); other processes' load is recorded per run"
    )
    model = ", ".join(f"{key}={value}" for key, value in arguments.model_config.items())
    global_batch = arguments.batch_size_per_rank * arguments.world_size
    # Tensor- and sequence-parallel ranks read one batch together: their global batch is smaller.
    shared = {
        run["label"]: run["ranks"][0]["data_parallel_size"]
        for run in runs
        if run["ranks"][0].get("data_parallel_size", arguments.world_size) < arguments.world_size
    }
    batch_note = (
        "; ranks share batches in "
        + ", ".join(
            f"{label} (data-parallel size {size}: global batch {arguments.batch_size_per_rank * size})"
            for label, size in sorted(shared.items())
        )
        if shared
        else ""
    )
    return [
        f"Machine: {context['machine']}",
        f"Date: {context['started_at']}",
        f"Command: `{context['command']}`",
        f"Model: GPT {parameter_count / 1e6:.2f}M parameters ({model})",
        f"Workload: {arguments.world_size} CPU ranks (gloo, OMP_NUM_THREADS=1), global batch {global_batch} "
        f"({arguments.batch_size_per_rank} per rank) x {arguments.sequence_length} tokens, fp32, "
        f"AdamW lr {arguments.learning_rate:g}{batch_note}",
        f"Method: {arguments.repeats} repeats, configurations in a fresh random order per repeat (seed "
        f"{arguments.seed}); per run {arguments.warmup} warm-up + {arguments.steps} measured steps, step time = "
        f"{arguments.statistic} over steps of the slowest rank per step; ratios paired within a repeat",
        f"Runs: {accepted} accepted, {discarded} discarded, {missing} (repeat, configuration) left without an "
        f"accepted run; {load_rule}",
        f"Software: torch {versions['torch']}, lightning {versions['lightning']}, python {versions['python']}, "
        f"lightning_colossal {versions['lightning_colossal']} (git {context['git']})",
        f"Wall time of the benchmark: {context['wall_seconds']:.0f} s",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    command_arguments = list(sys.argv[1:] if argv is None else argv)
    context: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "benchmarks.peers", *command_arguments]),
        "machine": cpu_description(),
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git_revision(REPOSITORY_ROOT),
        "software": software_versions(),
    }
    random_order = random.Random(arguments.seed)
    runs: list[dict[str, Any]] = []
    orders: list[list[str]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_colossal_benchmark_") as scratch:
        for repeat in range(arguments.repeats):
            order = list(arguments.configurations)
            random_order.shuffle(order)
            orders.append([configuration.label for configuration in order])
            print(f"repeat {repeat + 1}/{arguments.repeats}, order: {', '.join(orders[-1])}", flush=True)
            for configuration in order:
                try:
                    runs.extend(_measure_configuration(arguments, configuration, repeat, Path(scratch)))
                except RunFailed as error:
                    # A broken configuration is a bug to fix, not a measurement: stop with its ranks' logs.
                    print(f"benchmark stopped: {error}", file=sys.stderr)
                    return 1
    context["wall_seconds"] = time.perf_counter() - start
    configurations = [asdict(configuration) for configuration in arguments.configurations]
    tokens_per_step = arguments.batch_size_per_rank * arguments.world_size * arguments.sequence_length
    summaries = summarize_configurations(runs, configurations, arguments.peer, arguments.statistic, tokens_per_step)
    header_lines = _header_lines(arguments, context, runs)
    print()
    print(format_text(summaries, arguments.peer, header_lines))
    if arguments.markdown:
        print("----- markdown -----")
        print(format_markdown(summaries, arguments.peer, header_lines))
    if arguments.output is not None:
        arguments.output.parent.mkdir(parents=True, exist_ok=True)
        settings = {key: value for key, value in vars(arguments).items() if key not in ("configurations", "output")}
        document = {
            **context,
            "settings": settings,
            "configurations": configurations,
            "orders": orders,
            "summary": [summary.to_json() for summary in summaries],
            "runs": runs,
        }
        arguments.output.write_text(json.dumps(document, indent=2, default=str))
        print(f"raw measurements written to {arguments.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
