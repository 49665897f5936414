"""Measurements of ``colossal_hybrid`` on 2 gloo CPU ranks against the theory of each parallelism.

    python -m benchmarks.hybrid --row bubble      # pipeline bubble per schedule vs (p-1)/(m+p-1), (p-1)/(v*m+p-1), 0
    python -m benchmarks.hybrid --row tp-bytes    # tensor-parallel bytes per step vs Megatron's 4 b*s*h per layer
    python -m benchmarks.hybrid --row sp-memory   # saved activation bytes per rank with sequence parallelism vs without

Every launch starts 2 rank processes of ``benchmarks.hybrid.ranks`` (gloo, ``OMP_NUM_THREADS=1``) the way
``benchmarks.peers`` starts its workers, waits for them with a timeout and writes every raw figure as JSON (default
``benchmarks/out/hybrid_<row>.json``) and a markdown block for ``RESULTS.md`` to stdout. The bubble row is a timing:
it waits for a quiet machine before every launch and discards a case whose measured steps ran while other processes
used more than ``--max-load`` cores. The other two rows count bytes and are deterministic.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, RunFailed, launch_ranks, wait_for_quiet, window_other_load
from benchmarks.harness.machine import cpu_description, git_revision, software_versions
from benchmarks.hybrid.report import bubble_markdown, memory_markdown, theory_bubble, traffic_markdown
from benchmarks.peers.configuration import BENCHMARK_MODEL

# The pipeline's model: wide layers, so one layer's compute (~20 ms forward for a micro-batch of 128 tokens on one
# core) dwarfs a point-to-point transfer of its 0.5 MiB activation; a small vocabulary, so the first and last stages
# (embedding, head and loss) cost little more than the middle ones, as the bubble formulas assume.
PIPELINE_MODEL: dict[str, Any] = {
    "vocab_size": 512,
    "block_size": 128,
    "num_layers": 4,
    "num_heads": 16,
    "embed_dim": 1024,
    "tie_weights": False,
}

# Configurations of the byte rows: (label, colossal_hybrid arguments). dp2 is the same 2 ranks without any model
# parallelism: the baseline whose ranks hold whole sequences, as the Ulysses ranks would without sequence parallelism.
PROBE_CONFIGURATIONS: dict[str, dict[str, Any]] = {
    "tp2": {"tp_size": 2},
    "tp2_split_gather": {"tp_size": 2, "sequence_parallel": "split_gather"},
    "sp2_ulysses": {"sp_size": 2},
    "dp2": {},
}
ROW_CONFIGURATIONS = {
    "tp-bytes": ["tp2", "tp2_split_gather"],
    "sp-memory": ["dp2", "sp2_ulysses", "tp2", "tp2_split_gather"],
}


def _integers(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hybrid", description=__doc__.splitlines()[0])
    parser.add_argument("--row", choices=["bubble", "tp-bytes", "sp-memory"], required=True)
    parser.add_argument("--model-config", default="{}", help="JSON overriding the row's GPTConfig fields")
    parser.add_argument("--batch-size-per-rank", type=int, default=4, help="byte rows: sequences per rank (4)")
    parser.add_argument("--sequence-length", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--schedules", default="1f1b,interleaved,zbv", help="bubble row: pipeline schedules")
    parser.add_argument("--microbatches", type=_integers, default=[2, 4, 8], help="bubble row: counts, e.g. 2,4,8")
    parser.add_argument("--microbatch-size", type=int, default=1, help="bubble row: sequences per micro-batch (1)")
    parser.add_argument("--repeats", type=int, default=3, help="bubble row: accepted launches per case (3)")
    parser.add_argument("--steps", type=int, default=4, help="bubble row: measured schedule steps per case (4)")
    parser.add_argument("--warmup", type=int, default=2, help="bubble row: unmeasured steps per case first (2)")
    parser.add_argument("--max-load", type=float, default=0.3, help="bubble row: discard above this other load")
    parser.add_argument("--max-attempts", type=int, default=3, help="bubble row: launches per repeat at most (3)")
    parser.add_argument("--quiet-wait", type=float, default=300.0, help="seconds to wait for a quiet machine (300)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a launch is killed (900)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="JSON file (default benchmarks/out/hybrid_<row>.json)")
    arguments = parser.parse_args(argv)
    overrides = json.loads(arguments.model_config)
    base = PIPELINE_MODEL if arguments.row == "bubble" else BENCHMARK_MODEL
    arguments.model = {**base, **overrides}
    if arguments.output is None:
        arguments.output = REPOSITORY_ROOT / "benchmarks" / "out" / f"hybrid_{arguments.row.replace('-', '_')}.json"
    return arguments


def _launch(spec: dict[str, Any], scratch: Path, name: str, timeout: float) -> list[dict[str, Any]]:
    directory = scratch / name
    directory.mkdir(parents=True)
    spec = {**spec, "directory": str(directory)}
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    launch_ranks("benchmarks.hybrid.ranks", ["--spec", str(spec_path)], spec["world_size"], directory, timeout)
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(spec["world_size"])]


def _case_key(case: dict[str, Any]) -> str:
    return f"{case['schedule']} m={case['microbatches']}"


_COMPUTE_PARTS = ("forward", "backward", "backward_input", "backward_weight", "loss")


def _case_summary(case_per_rank: list[dict[str, Any]], latency: dict[str, Any]) -> dict[str, Any]:
    """One launch's figures of one case: per rank the median over measured steps of compute and bubble.

    The ranks leave a barrier together, so a step lasts until its slowest rank returns from
    ``PipelineStep.train_step``; a rank that returns early (the last stage finishes its last backward before the first
    stage does) idles until then too.
    Bubble = 1 − this rank's compute / that step wall, as in the formulas.
    """
    step_walls = [
        max(step["wall_seconds"] for step in steps) for steps in zip(*(c["steps"] for c in case_per_rank), strict=True)
    ]
    ranks = []
    for rank, case in enumerate(case_per_rank):
        steps = case["steps"]
        compute = [sum(step[f"{part}_seconds"] for part in _COMPUTE_PARTS) for step in steps]
        transfers = statistics.median(step["transfers"] for step in steps)
        ranks.append(
            {
                "rank": rank,
                "own_wall_seconds": statistics.median(step["wall_seconds"] for step in steps),
                "compute_seconds": statistics.median(compute),
                "bubble": statistics.median(1 - busy / wall for busy, wall in zip(compute, step_walls, strict=True)),
                "point_to_point_wait_seconds": statistics.median(step["point_to_point_wait_seconds"] for step in steps),
                "transfers": transfers,
                "transfer_bytes": statistics.median(step["transfer_bytes"] for step in steps),
                # Upper bound of the transfers' own cost: each blocks as long as a lone ping-pong leg.
                "communication_share": transfers * latency["one_way_seconds_median"] / statistics.median(step_walls),
                "parts_seconds": {
                    part: statistics.median(step[f"{part}_seconds"] for step in steps) for part in _COMPUTE_PARTS
                },
                "steps": steps,
            }
        )
    other_load = window_other_load([{"window": case["window"]} for case in case_per_rank])
    return {"step_wall_seconds": statistics.median(step_walls), "ranks": ranks, "other_load": other_load}


def run_bubble(arguments: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    cases = [
        {"schedule": schedule, "chunks": 1 if schedule == "1f1b" else 2, "microbatches": microbatches}
        for schedule in arguments.schedules.split(",")
        for microbatches in arguments.microbatches
    ]
    accepted: dict[str, list[dict[str, Any]]] = {_case_key(case): [] for case in cases}
    discarded: list[dict[str, Any]] = []
    latencies = []
    order_random = random.Random(arguments.seed)
    launches = 0
    while any(len(runs) < arguments.repeats for runs in accepted.values()):
        if launches >= arguments.repeats * arguments.max_attempts:
            print("giving up: too many disturbed launches", flush=True)
            break
        needed = [case for case in cases if len(accepted[_case_key(case)]) < arguments.repeats]
        order_random.shuffle(needed)
        wait_for_quiet(arguments.max_load, arguments.quiet_wait)
        spec = {
            "kind": "pipeline",
            "world_size": 2,
            "model_config": arguments.model,
            "sequence_length": arguments.sequence_length,
            "microbatch_size": arguments.microbatch_size,
            "warmup_steps": arguments.warmup,
            "measured_steps": arguments.steps,
            "seed": arguments.seed,
            "process_group_timeout": arguments.timeout,
            "cases": needed,
        }
        results = _launch(spec, scratch, f"launch{launches}", arguments.timeout)
        launches += 1
        latency = results[0]["point_to_point"]
        latencies.append(latency)
        for index, case in enumerate(needed):
            summary = {**case, "launch": launches, **_case_summary([rank["cases"][index] for rank in results], latency)}
            load = summary["other_load"]
            disturbed = load is not None and load > arguments.max_load
            (discarded if disturbed else accepted[_case_key(case)]).append(summary)
            bubbles = " / ".join(f"{rank['bubble']:.3f}" for rank in summary["ranks"])
            status = "discarded" if disturbed else "accepted"
            print(
                f"  launch {launches} {_case_key(case):<16} bubble per rank {bubbles}, other load {load:.2f} -> {status}"
            )
    rows = []
    for case in cases:
        runs = accepted[_case_key(case)]
        if not runs:
            continue
        rows.append({**case, "theory": theory_bubble(case, pipeline_size=2), "runs": runs})
    return {"rows": rows, "discarded": discarded, "launches": launches, "point_to_point": latencies}


def run_probes(arguments: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    results = {}
    for label in ROW_CONFIGURATIONS[arguments.row]:
        spec = {
            "kind": "training",
            "world_size": 2,
            "strategy": "colossal_hybrid",
            "init_args": PROBE_CONFIGURATIONS[label],
            "model_config": arguments.model,
            "batch_size_per_rank": arguments.batch_size_per_rank,
            "sequence_length": arguments.sequence_length,
            "learning_rate": 3e-4,
            "seed": arguments.seed,
            "probed_steps": [1, 2],
        }
        print(f"  {label}: {PROBE_CONFIGURATIONS[label]}", flush=True)
        results[label] = {
            "init_args": PROBE_CONFIGURATIONS[label],
            "ranks": _launch(spec, scratch, label, arguments.timeout),
        }
    return {"configurations": results}


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    command_arguments = list(sys.argv[1:] if argv is None else argv)
    context = {
        "command": " ".join(["python", "-m", "benchmarks.hybrid", *command_arguments]),
        "machine": cpu_description(),
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git_revision(REPOSITORY_ROOT),
        "software": software_versions(),
        "model": arguments.model,
        "settings": {key: value for key, value in vars(arguments).items() if key not in ("output", "model")},
    }
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lightning_colossal_hybrid_") as scratch:
        try:
            body = (
                run_bubble(arguments, Path(scratch))
                if arguments.row == "bubble"
                else run_probes(arguments, Path(scratch))
            )
        except RunFailed as error:
            print(f"benchmark stopped: {error}", file=sys.stderr)
            return 1
    document = {**context, "wall_seconds": time.perf_counter() - start, **body}
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(document, indent=2, default=str))
    if arguments.row == "bubble":
        print(bubble_markdown(document))
    elif arguments.row == "tp-bytes":
        print(traffic_markdown(document))
    else:
        print(memory_markdown(document))
    print(f"raw measurements written to {arguments.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
