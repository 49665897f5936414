"""How much training time a checkpoint save costs: synchronous saves against background ones (``async_checkpoint``).

``python -m benchmarks.checkpoint_stall`` trains the demo GPT under ``colossal_zero2`` on ``--world-size`` gloo ranks
(``benchmarks.checkpoint_stall.ranks``, launched as every study launches its ranks). After ``--warmup`` steps a run is
``--cycles`` cycles of four intervals of ``--interval`` steps, one per mode, in a seeded random order per cycle:
``none`` (no save), ``sync`` (a synchronous save at the interval's start), ``async`` (a background save at its
start, its shard files written by the writer process, waited for at its end, so a write that outlasts the interval
counts in full) and ``async_thread`` (the same, written on the background thread: the route before the writer
process, and the one taken where shared memory is short). Every save goes into one path.
An interval's time is the slowest rank's, from before the save call to the end of its last step: everything a save
costs the training thread counts, the time inside ``save_checkpoint``, the background thread's competition for the
cores and the wait for the write. Per cycle, a mode's stall is its interval's time less the ``none`` interval's of
the same cycle: the pairing within a cycle cancels the drift of a shared machine's load, which moves step times by
more than a save costs. The report gives the median and range over every cycle of every run, the per-run medians,
and the ratio of each async mode's median to the sync median; the time each ``save_checkpoint`` call blocked and each background
write's duration are reported beside them.

The load rule is the peers study's (``benchmarks/harness/machine.py`` [Note: measuring other processes' load]): a
run during whose measured steps other processes used more than ``--max-load`` cores is redone, at most
``--max-attempts`` times, and kept if none passes (its load is in the table); every attempt is in the JSON
(``benchmarks/out/checkpoint_stall.json`` by default).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, RunFailed, launch_ranks, wait_for_quiet, window_other_load
from benchmarks.harness.machine import cpu_description, git_revision, software_versions
from benchmarks.harness.measure import summarize

MODES = ("none", "sync", "async", "async_thread")
SAVING_MODES = MODES[1:]


# ---------------------------------------------------------------------------------------------------------- runs
def run_once(arguments: argparse.Namespace, orders: list[list[str]], directory: Path) -> dict[str, Any]:
    """One launch of ``--world-size`` ranks over the cycles ``orders``: the ranks' results and the other load."""
    directory.mkdir(parents=True)
    (directory / "checkpoints").mkdir()
    spec = {
        "orders": orders,
        "model_config": json.loads(arguments.model_config),
        "world_size": arguments.world_size,
        "batch_size_per_rank": arguments.batch_size_per_rank,
        "sequence_length": arguments.sequence_length,
        "warmup": arguments.warmup,
        "interval": arguments.interval,
        "seed": arguments.seed,
        "checkpoint": str(directory / "checkpoints" / "last.ckpt"),
    }
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    try:
        launch_ranks(
            "benchmarks.checkpoint_stall.ranks",
            ["--spec", str(spec_path)],
            arguments.world_size,
            directory,
            arguments.run_timeout,
        )
    except RunFailed as error:
        raise SystemExit(f"a run failed:\n{str(error)[-4000:]}") from error
    ranks = [json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))]
    return {"orders": orders, "ranks": ranks, "other_load": window_other_load(ranks)}


def run_repeat(arguments: argparse.Namespace, repeat: int, orders: list[list[str]], scratch: Path) -> dict[str, Any]:
    """One run of the cycles, redone while other load exceeds ``--max-load`` (every attempt kept; the least disturbed
    one is accepted if none passes)."""
    attempts = []
    for attempt in range(arguments.max_attempts):
        wait_for_quiet(arguments.max_load, arguments.quiet_wait)
        outcome = run_once(arguments, orders, scratch / f"repeat{repeat}_{attempt}")
        attempts.append(outcome)
        stalls = cycle_stalls(outcome)
        print(
            f"  repeat {repeat} attempt {attempt}: median stall sync {statistics.median(stalls['sync']):.3f} s,"
            f" async {statistics.median(stalls['async']):.3f} s, async on the thread"
            f" {statistics.median(stalls['async_thread']):.3f} s; other load {outcome['other_load']}",
            flush=True,
        )
        if outcome["other_load"] is None or outcome["other_load"] <= arguments.max_load:
            break
    accepted = min(attempts, key=lambda outcome: outcome["other_load"] or 0.0)
    return {"repeat": repeat, "accepted": accepted, "attempts": attempts}


# ---------------------------------------------------------------------------------------------------------- figures (pure)
def interval_seconds(outcome: dict[str, Any]) -> list[tuple[str, float]]:
    """Each interval's mode and the slowest rank's seconds, in order."""
    ranks = outcome["ranks"]
    return [
        (ranks[0]["intervals"][index]["mode"], max(rank["intervals"][index]["seconds"] for rank in ranks))
        for index in range(len(ranks[0]["intervals"]))
    ]


def cycle_stalls(outcome: dict[str, Any]) -> dict[str, list[float]]:
    """Per cycle, every saving mode: the mode's interval less the cycle's ``none`` interval, in seconds."""
    intervals = interval_seconds(outcome)
    stalls: dict[str, list[float]] = {mode: [] for mode in SAVING_MODES}
    for first in range(0, len(intervals), len(MODES)):
        cycle = dict(intervals[first : first + len(MODES)])
        for mode in stalls:
            stalls[mode].append(cycle[mode] - cycle["none"])
    return stalls


def pooled_stalls(repeats: list[dict[str, Any]], mode: str) -> list[float]:
    return [stall for repeat in repeats for stall in cycle_stalls(repeat["accepted"])[mode]]


def per_run_medians(repeats: list[dict[str, Any]], mode: str) -> list[float]:
    return [statistics.median(cycle_stalls(repeat["accepted"])[mode]) for repeat in repeats]


def interval_figures(repeats: list[dict[str, Any]], mode: str, key: str) -> list[float]:
    """Every rank's ``key`` of every interval in ``mode``."""
    return [
        record[key]
        for repeat in repeats
        for rank in repeat["accepted"]["ranks"]
        for record in rank["intervals"]
        if record["mode"] == mode and key in record
    ]


def _range(values: list[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    summary = summarize(values)
    return f"{summary.median:.{digits}f} [{summary.minimum:.{digits}f} to {summary.maximum:.{digits}f}] (n={summary.count})"


def markdown(results: dict[str, Any]) -> str:
    context, arguments, repeats = results["context"], results["arguments"], results["repeats"]
    first = repeats[0]["accepted"]["ranks"][0]
    background = [
        value
        for repeat in repeats
        for rank in repeat["accepted"]["ranks"]
        for value in rank["background_write_seconds"]
    ]
    loads = [repeat["accepted"]["other_load"] for repeat in repeats if repeat["accepted"]["other_load"] is not None]
    lines = [
        f"Command: `{context['command']}`",
        f"Date: {context['date']}; machine: {context['cpu']}; {context['software']}; git {context['git']}.",
        f"Workload: demo GPT `{arguments['model_config']}` ({first['parameter_count']:,} parameters) under"
        f" `colossal_zero2` on {arguments['world_size']} gloo ranks, {arguments['batch_size_per_rank']} x"
        f" {arguments['sequence_length']} tokens per rank, fp32 AdamW; {arguments['warmup']} warm-up steps, then"
        f" {arguments['cycles']} cycles of {len(MODES)} intervals of {arguments['interval']} steps per run; {len(repeats)} runs;"
        f" checkpoint on disk {first['checkpoint_bytes'] / 2**20:.0f} MiB. Other load during the runs:"
        f" {_range(loads, 2)} cores.",
        "",
        "| | sync | async (writer process) | async (thread) |",
        "| --- | --- | --- | --- |",
        "| stall per save s, every cycle: median [min to max] |"
        + " |".join(f" {_range(pooled_stalls(repeats, mode))}" for mode in SAVING_MODES)
        + " |",
        "| stall per save s, per-run medians |"
        + " |".join(f" {_range(per_run_medians(repeats, mode))}" for mode in SAVING_MODES)
        + " |",
        "| blocked in `save_checkpoint` s |"
        + " |".join(f" {_range(interval_figures(repeats, mode, 'save_call_seconds'))}" for mode in SAVING_MODES)
        + " |",
        f"| background write s (either async mode) | - | {_range(background)} | |",
        "| wait at the interval's end s | - |"
        + " |".join(f" {_range(interval_figures(repeats, mode, 'end_wait_seconds'))}" for mode in SAVING_MODES[1:])
        + " |",
        "",
        f"`none` interval s: {_range([seconds for repeat in repeats for mode, seconds in interval_seconds(repeat['accepted']) if mode == 'none'], 2)}.",
    ]
    sync = pooled_stalls(repeats, "sync")
    for mode, name in (("async", "Async (writer process)"), ("async_thread", "Async (thread)")):
        run_ratios = [
            ours / theirs
            for ours, theirs in zip(per_run_medians(repeats, mode), per_run_medians(repeats, "sync"), strict=True)
            if theirs > 0
        ]
        lines.append(
            f"{name} / sync median stall: {statistics.median(pooled_stalls(repeats, mode)) / statistics.median(sync):.3f}"
            f" over every cycle; per run {_range(run_ratios)}."
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- entry
DEFAULT_MODEL = (
    '{"vocab_size": 8192, "block_size": 128, "num_layers": 6, "num_heads": 8, "embed_dim": 512, "tie_weights": false}'
)


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cycles", type=int, default=4, help="cycles of (none, sync, async, async_thread) intervals per run"
    )
    parser.add_argument("--interval", type=int, default=5, help="steps per interval")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps before the first interval")
    parser.add_argument("--model-config", default=DEFAULT_MODEL, help="GPTConfig fields as JSON")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch-size-per-rank", type=int, default=4)
    parser.add_argument("--sequence-length", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-load", type=float, default=0.3, help="redo a run whose window had more other load")
    parser.add_argument("--max-attempts", type=int, default=3)
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run is killed")
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "checkpoint_stall.json")
    arguments = parser.parse_args(argv)
    if min(arguments.cycles, arguments.interval, arguments.repeats, arguments.max_attempts) < 1:
        parser.error("--cycles, --interval, --repeats and --max-attempts must be positive")
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    start = time.perf_counter()
    order_source = random.Random(arguments.seed)
    repeats = []
    with tempfile.TemporaryDirectory(prefix="checkpoint_stall_") as scratch:
        for repeat in range(arguments.repeats):
            orders = [order_source.sample(MODES, len(MODES)) for _ in range(arguments.cycles)]
            # Each run in a directory of its own, removed after it: its checkpoints are not kept.
            with tempfile.TemporaryDirectory(dir=scratch) as run_directory:
                repeats.append(run_repeat(arguments, repeat, orders, Path(run_directory)))
    results = {
        "arguments": {key: str(value) if isinstance(value, Path) else value for key, value in vars(arguments).items()},
        "context": {
            "cpu": cpu_description(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": shlex.join(
                ["python", "-m", "benchmarks.checkpoint_stall", *(sys.argv[1:] if argv is None else argv)]
            ),
            "software": ", ".join(f"{name} {version}" for name, version in software_versions().items()),
            "git": git_revision(REPOSITORY_ROOT),
            "wall_seconds": time.perf_counter() - start,
        },
        "repeats": repeats,
    }
    results["summary"] = {mode: statistics.median(pooled_stalls(repeats, mode)) for mode in SAVING_MODES}
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"\nJSON: {arguments.output}")
    return 0
