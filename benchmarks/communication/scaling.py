"""Scaling shape: bytes, CPU time and training memory per rank at 1, 2 and 4 ranks and 3 model sizes, next to the
formulas and the planner, and both carried to 64 ranks.

    python -m benchmarks.communication.scaling                          # every size, world size and strategy
    python -m benchmarks.communication.scaling --sizes small --world-sizes 1,2

Each (size, world size) is one ``benchmarks.communication`` invocation of the data-parallel strategies at their
default settings (one launch of ``n`` gloo ranks each, the per-rank batch fixed: weak scaling). Per rank it keeps
the bytes written to sockets in a steady step, the main thread's and the other threads' CPU time ([Note: CPU time
per rank] in ``exchanges.py``: with 4 ranks on 2 cores wall time measures the scheduler, CPU time does not), and the
training memory ([Note: training memory per rank] in ``exchanges.py``). Beside them: the textbook bytes
(``counting.formula``) and what ``python -m lightning_colossal.plan`` predicts per rank for the same model, batch and
ranks (CPU ranks, fp32, AdamW), and both at 64 ranks (8 nodes of 8), the curve a user would see.

Writes ``--output`` (JSON, default ``benchmarks/out/scaling.json``) and a markdown block to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.communication import exchanges
from benchmarks.communication.counting import formula
from benchmarks.harness.launch import REPOSITORY_ROOT
from benchmarks.harness.machine import cpu_description, git_revision, software_versions

# Three demo GPTs, tied head (what the planner's ``--model demo`` lays out), 64-token blocks: 2.1M, 14.7M and 34.7M
# parameters. The largest keeps 4 ranks of colossal_ddp (16 bytes per parameter each, plus activations) within
# this machine's memory and a launch of 4 ranks on 2 cores within a few minutes.
SIZES: dict[str, dict[str, Any]] = {
    "small": {
        "vocab_size": 2048,
        "block_size": 64,
        "num_layers": 2,
        "num_heads": 4,
        "embed_dim": 256,
        "tie_weights": True,
    },
    "medium": {
        "vocab_size": 4096,
        "block_size": 64,
        "num_layers": 4,
        "num_heads": 8,
        "embed_dim": 512,
        "tie_weights": True,
    },
    "large": {
        "vocab_size": 8192,
        "block_size": 64,
        "num_layers": 4,
        "num_heads": 12,
        "embed_dim": 768,
        "tie_weights": True,
    },
}
# The data-parallel strategies at their defaults (hybrid's tensor and pipeline axes need 2 ranks or more and are
# measured at 2 ranks in ``exchanges.py``).
STRATEGIES = ["colossal_ddp", "colossal_zero1", "colossal_zero2", "colossal_gemini", "colossal_fsdp"]
PROJECTED_RANKS = (8, 8)  # devices per node, nodes: 64 ranks


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.communication.scaling", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated ({', '.join(SIZES)})")
    parser.add_argument("--world-sizes", default="1,2,4", help="comma-separated rank counts (1,2,4)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated (the data-parallel ones)")
    parser.add_argument("--batch-size-per-rank", type=int, default=4, help="sequences per rank (4)")
    parser.add_argument("--sequence-length", type=int, default=64, help="tokens per sequence (64)")
    parser.add_argument("--steps", type=int, default=5, help="training steps per launch (5; steps 2-4 probed)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a launch is killed (900)")
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "scaling.json")
    arguments = parser.parse_args(argv)
    arguments.size_names = [name for name in arguments.sizes.split(",") if name]
    unknown = [name for name in arguments.size_names if name not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; known: {', '.join(SIZES)}")
    arguments.world_size_list = [int(value) for value in arguments.world_sizes.split(",") if value]
    arguments.strategy_list = [name for name in arguments.strategies.split(",") if name]
    unknown = [name for name in arguments.strategy_list if name not in exchanges.CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown strategies {unknown}; known: {', '.join(exchanges.CONFIGURATIONS)}")
    return arguments


def planner_prediction(model: dict[str, Any], devices: int, nodes: int, arguments: argparse.Namespace) -> dict:
    """``python -m lightning_colossal.plan --json`` for the demo GPT on CPU ranks: per setting, its JSON row."""
    command = [
        sys.executable, "-m", "lightning_colossal.plan", "--model", "demo",
        "--layers", str(model["num_layers"]), "--hidden", str(model["embed_dim"]), "--heads", str(model["num_heads"]),
        "--vocab", str(model["vocab_size"]), "--block-size", str(model["block_size"]),
        "--devices", str(devices), "--nodes", str(nodes), "--device-type", "cpu", "--precision", "32-true",
        "--optimizer", "adamw", "--micro-batch-size", str(arguments.batch_size_per_rank),
        "--sequence-length", str(arguments.sequence_length), "--json",
    ]  # fmt: skip
    completed = subprocess.run(command, cwd=REPOSITORY_ROOT, capture_output=True, text=True, check=True)
    plan = json.loads(completed.stdout)
    return {row["setting"]: row for row in plan["settings"]}


def _launch(size: str, world_size: int, arguments: argparse.Namespace) -> dict[str, Any]:
    model = SIZES[size]
    launch_arguments = exchanges.parse_arguments(
        [
            "--configurations",
            ",".join(arguments.strategy_list),
            "--world-size",
            str(world_size),
            "--model-config",
            json.dumps(model),
            "--batch-size-per-rank",
            str(arguments.batch_size_per_rank),
            "--sequence-length",
            str(arguments.sequence_length),
            "--steps",
            str(arguments.steps),
            "--timeout",
            str(arguments.timeout),
            "--skip-primitives",
        ]  # fmt: skip
    )
    context = exchanges._context(launch_arguments, [])
    launched = exchanges._launch_all(launch_arguments, context)
    if launched is None:
        raise SystemExit(f"a launch of {size} at {world_size} ranks failed (reported above)")
    return launched[1]


def summarise(size: str, world_size: int, results: dict[str, Any], plan: dict, parameters: int) -> list[dict]:
    rows = []
    for label, result in results.items():
        mode = exchanges.CONFIGURATIONS[label][2]
        ranks = result["analysis"]["ranks"]
        raw = {rank["rank"]: rank for rank in result["raw"]}
        before = [raw[rank["rank"]]["resident_bytes_before_model"] for rank in ranks]
        memory = [raw[rank["rank"]]["peak_resident_bytes"] - base for rank, base in zip(ranks, before, strict=True)]
        setup = [
            raw[rank["rank"]]["peak_resident_bytes_at_train_start"] - base
            for rank, base in zip(ranks, before, strict=True)
        ]
        steady = [
            raw[rank["rank"]]["resident_bytes_after_probed_steps"] - base
            for rank, base in zip(ranks, before, strict=True)
        ]
        predicted = plan[label]
        rows.append(
            {
                "size": size,
                "parameters": parameters,
                "strategy": label,
                "ranks": world_size,
                "socket_bytes_per_rank": [rank["socket_bytes_sent"] for rank in ranks],
                "formula_bytes_per_rank": formula(mode, parameters, world_size).wire_bytes,
                "main_thread_cpu_ms": [rank["main_thread_cpu_seconds"] * 1000 for rank in ranks],
                "other_threads_cpu_ms": [rank["other_threads_cpu_seconds"] * 1000 for rank in ranks],
                "wall_ms": [rank["wall_seconds"] * 1000 for rank in ranks],
                "training_memory_bytes": memory,
                "setup_peak_bytes": setup,
                "steady_resident_bytes": steady,
                "planned_host_bytes_per_rank": predicted["host_bytes_per_rank"],
                "planned_model_state_bytes": _model_state_bytes(predicted),
            }
        )
    return rows


def _model_state_bytes(row: dict[str, Any]) -> int:
    return sum(sum(tiers.values()) for tiers in row["model_state"].values())


def _mib(value: float) -> str:
    return f"{value / 2**20:,.1f}"


def markdown(document: dict[str, Any]) -> str:
    lines = [
        f"Scaling shape ({document['started_at']}, git {document['git']}, {document['machine']}); per rank, median"
        " over the ranks of the steady probed steps (CPU ms: medians over steps 2-4).",
        "",
        "| size | strategy | ranks | socket MB written | formula MB | main thread CPU ms | other threads CPU ms"
        " | wall ms | training memory MiB (max rank) | peak by the first step MiB | resident after the probed steps MiB"
        " | planner MiB | measured / planner |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in document["rows"]:
        memory = max(row["training_memory_bytes"])
        lines.append(
            f"| {row['size']} ({row['parameters'] / 1e6:.1f}M) | {row['strategy']} | {row['ranks']}"
            f" | {statistics.median(row['socket_bytes_per_rank']) / 1e6:,.2f}"
            f" | {row['formula_bytes_per_rank'] / 1e6:,.2f}"
            f" | {statistics.median(row['main_thread_cpu_ms']):.0f}"
            f" | {statistics.median(row['other_threads_cpu_ms']):.0f}"
            f" | {statistics.median(row['wall_ms']):.0f}"
            f" | {_mib(memory)} | {_mib(max(row['setup_peak_bytes']))} | {_mib(max(row['steady_resident_bytes']))}"
            f" | {_mib(row['planned_host_bytes_per_rank'])}"
            f" | {memory / row['planned_host_bytes_per_rank']:.2f} |"
        )
    lines += [
        "",
        "At 64 ranks (8 nodes of 8), per rank: the formula's bytes and the planner's memory.",
        "",
        "| size | strategy | formula MB per step | planner model state MiB | planner total MiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in document["projection"]:
        lines.append(
            f"| {row['size']} | {row['strategy']} | {row['formula_bytes_per_rank'] / 1e6:,.2f}"
            f" | {_mib(row['planned_model_state_bytes'])} | {_mib(row['planned_host_bytes_per_rank'])} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    started = time.perf_counter()
    document: dict[str, Any] = {
        "command": " ".join(["python", "-m", "benchmarks.communication.scaling", *(argv or sys.argv[1:])]),
        "machine": cpu_description(),
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "git": git_revision(REPOSITORY_ROOT),
        "software": software_versions(),
        "sizes": {name: SIZES[name] for name in arguments.size_names},
        "rows": [],
        "projection": [],
    }
    for size in arguments.size_names:
        parameters = exchanges.parameter_count(SIZES[size])
        for world_size in arguments.world_size_list:
            print(f"{size} ({parameters / 1e6:.1f}M) at {world_size} ranks", flush=True)
            results = _launch(size, world_size, arguments)
            plan = planner_prediction(SIZES[size], world_size, 1, arguments)
            document["rows"] += summarise(size, world_size, results, plan, parameters)
        devices, nodes = PROJECTED_RANKS
        plan = planner_prediction(SIZES[size], devices, nodes, arguments)
        for label in arguments.strategy_list:
            document["projection"].append(
                {
                    "size": size,
                    "strategy": label,
                    "formula_bytes_per_rank": formula(
                        exchanges.CONFIGURATIONS[label][2], parameters, devices * nodes
                    ).wire_bytes,
                    "planned_model_state_bytes": _model_state_bytes(plan[label]),
                    "planned_host_bytes_per_rank": plan[label]["host_bytes_per_rank"],
                }
            )
    document["wall_seconds"] = time.perf_counter() - started
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(document, indent=2, default=str))
    print(markdown(document))
    print(f"raw measurements written to {arguments.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
