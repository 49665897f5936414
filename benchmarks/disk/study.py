"""The disk tier on this machine: its disk's bandwidth, and the streamed optimizer step against the I/O bound.

    python -m benchmarks.disk                    # both rows, as in benchmarks/RESULTS.md ("The disk tier")
    python -m benchmarks.disk --rows bandwidth   # sequential read/write bandwidth, 1 rank and 2 ranks at once
    python -m benchmarks.disk --rows speed       # Gemini static, optimizer state on disk vs in host memory

Both rows launch ranks of ``benchmarks.disk.ranks`` with ``benchmarks.harness.launch`` (gloo, ``OMP_NUM_THREADS=1``)
and work under ``--offload-dir`` (a directory on the disk to measure; the tier's per-run directories are removed at
the end of each run, and this directory too if this study created it).

- ``bandwidth``: per rank count (1, then 2 at once, since ranks share the disk) and per (total, transfer) size,
  ``--rounds`` passes of: write ``total`` bytes in ``transfer``-byte calls then ``fsync``; read them back; read and
  write at once on two threads (the streamed step's pattern). Every call goes through the tier's own ``TierFile``
  (``O_DIRECT``, ``BLOCK_BYTES`` per system call, aligned buffers). A rank's bandwidth is its bytes over its seconds.
- ``speed``: the demo GPT (``--model-config``) under ``colossal_gemini`` with
  ``StaticPlacement(offload_optim_frac=1, disk_fraction=1)`` and ``offload_dir`` (``gemini_disk``) against the same
  with ``disk_fraction=0`` (``gemini_host``: the state in host memory), ``--repeats`` fresh 2-rank launches each in a
  seeded random order, waiting for a quiet machine before each and redoing a launch whose measured steps ran while
  other processes used more than ``--max-load`` cores. Per step: the whole step (``on_train_batch_start`` to
  ``on_train_batch_end``), the optimizer step alone (the strategy's ``precision_plugin.optimizer_stepper``, wrapped),
  the bytes the tier read and wrote, and where the optimizer step's time went (``benchmarks.disk.ranks.StepProfile``).
  The I/O bound of a rank's optimizer step is bytes read / read bandwidth + bytes written / write bandwidth, with the
  per-rank bandwidth both ranks get at once at the tier's record size, measured inside each disk launch right before
  its measured steps and right after them (``io_bound``); the same bound with the bandwidth row's 2-rank figures at
  the nearest transfer size is kept as ``io_bound_row``.

Every raw figure goes to ``--output`` (JSON) and a markdown block to stdout.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, RunFailed, launch_ranks, wait_for_quiet, window_other_load
from benchmarks.harness.machine import cpu_description, git_revision, software_versions

MIB = 2**20
GB = 1e9

# The speed row's model: wide layers (12.6M parameters each at d1024) and little compute per step (2 x 32 tokens per
# rank), so the optimizer step over ~50M elements per rank (400 MB of Adam state each way) is a large share of it.
SPEED_MODEL: dict[str, Any] = {
    "vocab_size": 256,
    "block_size": 32,
    "num_layers": 8,
    "num_heads": 16,
    "embed_dim": 1024,
}

# label -> (registered strategy, constructor arguments); "OFFLOAD_DIR" is replaced by the run's directory.
CONFIGURATIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemini_disk": (
        "colossal_gemini",
        {
            "placement": {"kind": "static", "offload_optim_frac": 1.0, "disk_fraction": 1.0},
            "offload_dir": "OFFLOAD_DIR",
        },
    ),
    "gemini_host": ("colossal_gemini", {"placement": {"kind": "static", "offload_optim_frac": 1.0}}),
    # gemini_disk with 6 staging buffers instead of the tier's 3 (an experiment on where the step's time goes).
    "gemini_disk_6_slots": (
        "colossal_gemini",
        {
            "placement": {"kind": "static", "offload_optim_frac": 1.0, "disk_fraction": 1.0},
            "offload_dir": "OFFLOAD_DIR",
        },
    ),
    # gemini_disk with each step waiting for its own I/O, as before the tier's I/O ran on into the forward.
    "gemini_disk_step_waits": (
        "colossal_gemini",
        {
            "placement": {"kind": "static", "offload_optim_frac": 1.0, "disk_fraction": 1.0},
            "offload_dir": "OFFLOAD_DIR",
        },
    ),
    "zero2_disk": (
        "colossal_zero2",
        {"cpu_offload": True, "disk_fraction": 1.0, "offload_dir": "OFFLOAD_DIR", "bucket_size_mb": 25.0},
    ),
    "zero2_host": ("colossal_zero2", {"cpu_offload": True, "bucket_size_mb": 25.0}),
}


def _integers(text: str) -> list[int]:
    return [int(value) for value in text.split(",") if value]


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="bandwidth,speed", help="bandwidth, speed or both (default both)")
    parser.add_argument(
        "--offload-dir", type=Path, default=Path(tempfile.gettempdir()) / "lightning_colossal_disk_study"
    )
    parser.add_argument("--totals-mib", type=_integers, default=[256, 1024], help="bandwidth: bytes per pass")
    parser.add_argument("--transfers-mib", type=_integers, default=[8, 16, 64], help="bandwidth: bytes per call")
    parser.add_argument("--rounds", type=int, default=5, help="bandwidth: passes per case")
    parser.add_argument("--configurations", default="gemini_disk,gemini_host", help=f"speed: of {list(CONFIGURATIONS)}")
    parser.add_argument("--model-config", default="{}", help="speed: JSON overriding SPEED_MODEL's fields")
    parser.add_argument(
        "--chunk-numel", type=int, default=None, help="speed: Gemini chunk elements (default 4·d² + 8·d: a block in 3)"
    )
    parser.add_argument("--batch-size-per-rank", type=int, default=2)
    parser.add_argument("--sequence-length", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="speed: accepted launches per configuration")
    parser.add_argument("--steps", type=int, default=5, help="speed: measured steps per launch")
    parser.add_argument("--warmup", type=int, default=2, help="speed: unmeasured steps first (the first reads nothing)")
    parser.add_argument("--bound-mib", type=int, default=256, help="speed: bytes per bandwidth pass in a launch")
    parser.add_argument("--bound-rounds", type=int, default=3, help="speed: bandwidth passes before and after")
    parser.add_argument("--max-load", type=float, default=0.3, help="speed: redo a launch above this other load")
    parser.add_argument("--max-attempts", type=int, default=3, help="speed: launches per (repeat, configuration)")
    parser.add_argument("--quiet-wait", type=float, default=120.0, help="seconds to wait for a quiet machine")
    parser.add_argument("--run-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "disk.json")
    arguments = parser.parse_args(argv)
    arguments.rows = [row for row in arguments.rows.split(",") if row]
    if not arguments.rows or any(row not in ("bandwidth", "speed") for row in arguments.rows):
        parser.error("--rows takes bandwidth, speed or both")
    arguments.configurations = [label for label in arguments.configurations.split(",") if label]
    unknown = [label for label in arguments.configurations if label not in CONFIGURATIONS]
    if unknown:
        parser.error(f"unknown configurations {unknown}; choose from {list(CONFIGURATIONS)}")
    arguments.model = {**SPEED_MODEL, **json.loads(arguments.model_config)}
    if arguments.chunk_numel is None:
        # The largest weight (the MLP's 4·d²) and 8·d more: a block packs into 3 full chunks (3 records of state).
        width = arguments.model["embed_dim"]
        arguments.chunk_numel = 4 * width * width + 8 * width
    return arguments


def _launch(spec: dict[str, Any], scratch: Path, name: str, world_size: int, timeout: float) -> list[dict[str, Any]]:
    directory = scratch / name
    directory.mkdir(parents=True)
    spec_path = directory / "spec.json"
    spec_path.write_text(json.dumps(spec, indent=2))
    launch_ranks("benchmarks.disk.ranks", ["--spec", str(spec_path)], world_size, directory, timeout)
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in range(world_size)]


# ---------------------------------------------------------------------------------------------------------------
# Bandwidth
# ---------------------------------------------------------------------------------------------------------------


def bandwidth_cases(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per case, per round: each direction's per-rank bandwidth (bytes over the slowest rank's seconds: the ranks
    started together, so that is what each got while all ran) and the aggregate (every rank's bytes over it)."""
    world_size = len(ranks)
    cases = []
    for index, case in enumerate(ranks[0]["cases"]):
        total = case["total_bytes"]
        rounds = [[rank["cases"][index]["rounds"][r] for rank in ranks] for r in range(len(case["rounds"]))]
        per_rank: dict[str, list[float]] = {"read": [], "write": [], "duplex_read": [], "duplex_write": []}
        for passes in rounds:
            per_rank["read"].append(total / max(p["read_seconds"] for p in passes))
            per_rank["write"].append(total / max(p["write_seconds"] for p in passes))
            per_rank["duplex_read"].append(total / max(p["duplex"]["read_seconds"] for p in passes))
            per_rank["duplex_write"].append(total / max(p["duplex"]["write_seconds"] for p in passes))
        cases.append(
            {
                "ranks": world_size,
                "total_bytes": total,
                "transfer_bytes": case["transfer_bytes"],
                "per_rank_bytes_per_second": per_rank,
                "median_per_rank": {key: statistics.median(values) for key, values in per_rank.items()},
            }
        )
    return cases


def run_bandwidth(arguments: argparse.Namespace, scratch: Path, transfers: list[int]) -> dict[str, Any]:
    results: dict[str, Any] = {"cases": []}
    for world_size in (1, 2):
        wait_for_quiet(arguments.max_load, arguments.quiet_wait)
        spec = {
            "task": "bandwidth",
            "offload_dir": str(arguments.offload_dir),
            "totals_bytes": [total * MIB for total in arguments.totals_mib],
            "transfers_bytes": [transfer * MIB for transfer in transfers],
            "rounds": arguments.rounds,
        }
        ranks = _launch(spec, scratch, f"bandwidth_{world_size}", world_size, arguments.run_timeout)
        results["direct_io"] = ranks[0]["direct_io"]
        results["block_bytes"] = ranks[0]["block_bytes"]
        results[f"raw_{world_size}"] = ranks
        results["cases"].extend(bandwidth_cases(ranks))
        for case in results["cases"][-len(arguments.totals_mib) * len(transfers) :]:
            median = case["median_per_rank"]
            print(
                f"  {world_size} rank(s), {case['total_bytes'] // MIB} MiB in {case['transfer_bytes'] // MIB} MiB calls:"
                f" read {median['read'] / GB:.2f}, write {median['write'] / GB:.2f} GB/s per rank",
                flush=True,
            )
    return results


def _fmt_range(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    return (
        f"{statistics.median(values) / scale:.{digits}f} [{min(values) / scale:.{digits}f}–"
        f"{max(values) / scale:.{digits}f}]"
    )


def bandwidth_markdown(results: dict[str, Any]) -> list[str]:
    lines = [
        "| ranks at once | MiB per pass | MiB per call | read GB/s per rank | write GB/s per rank |"
        " read + write at once: read GB/s | : write GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for case in results["cases"]:
        per_rank = case["per_rank_bytes_per_second"]
        lines.append(
            f"| {case['ranks']} | {case['total_bytes'] // MIB} | {case['transfer_bytes'] // MIB} | "
            f"{_fmt_range(per_rank['read'], GB)} | {_fmt_range(per_rank['write'], GB)} | "
            f"{_fmt_range(per_rank['duplex_read'], GB)} | {_fmt_range(per_rank['duplex_write'], GB)} |"
        )
    return lines


def bound_bandwidth(results: dict[str, Any], record_bytes: int) -> dict[str, Any]:
    """The 2-rank case nearest the tier's record size (then the largest pass): per-rank read and write bandwidth
    (medians over the rounds) for the I/O bound."""
    cases = [case for case in results["cases"] if case["ranks"] == 2]
    case = min(cases, key=lambda c: (abs(c["transfer_bytes"] - record_bytes), -c["total_bytes"]))
    return {
        "ranks": 2,
        "total_bytes": case["total_bytes"],
        "transfer_bytes": case["transfer_bytes"],
        "read_bytes_per_second": case["median_per_rank"]["read"],
        "write_bytes_per_second": case["median_per_rank"]["write"],
    }


# ---------------------------------------------------------------------------------------------------------------
# Speed
# ---------------------------------------------------------------------------------------------------------------


def speed_spec(arguments: argparse.Namespace, label: str, offload_dir: Path) -> dict[str, Any]:
    strategy, init_args = CONFIGURATIONS[label]
    init_args = {key: str(offload_dir) if value == "OFFLOAD_DIR" else value for key, value in init_args.items()}
    if strategy == "colossal_gemini":
        init_args["chunk_numel"] = arguments.chunk_numel
    return {
        "staging_slots": 6 if label == "gemini_disk_6_slots" else None,
        "io_within_step": label == "gemini_disk_step_waits",
        "task": "speed",
        "label": label,
        "strategy": strategy,
        "init_args": init_args,
        "model_config": arguments.model,
        "world_size": 2,
        "batch_size_per_rank": arguments.batch_size_per_rank,
        "sequence_length": arguments.sequence_length,
        "warmup": arguments.warmup,
        "steps": arguments.steps,
        "learning_rate": 3e-4,
        "seed": arguments.seed,
        "offload_dir": str(offload_dir),
        "bound_total_bytes": arguments.bound_mib * MIB,
        "bound_rounds": arguments.bound_rounds,
    }


_PROFILE_KEYS = ("arithmetic", "bind", "read_wait", "write_wait", "local", "read_io", "write_io", "io_busy")


def launch_bandwidth(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The bandwidth a disk launch measured with both ranks at once before and after its steps: per pass the bytes
    over the slowest rank's seconds, median over the passes."""
    passes: dict[str, list[float]] = {"read": [], "write": []}
    for moment in ("before", "after"):
        measured = [rank["bandwidth"].get(moment) for rank in ranks]
        if any(figures is None for figures in measured):
            continue
        total = measured[0]["total_bytes"]
        for rounds in zip(*(figures["rounds"] for figures in measured), strict=True):
            passes["read"].append(total / max(p["read_seconds"] for p in rounds))
            passes["write"].append(total / max(p["write_seconds"] for p in rounds))
    if not passes["read"]:
        return None
    return {
        "read_bytes_per_second": statistics.median(passes["read"]),
        "write_bytes_per_second": statistics.median(passes["write"]),
        "passes": passes,
        "transfer_bytes": ranks[0]["bandwidth"]["before"]["transfer_bytes"],
    }


def other_disk_traffic(ranks: list[dict[str, Any]]) -> float | None:
    """Bytes per second other processes read and wrote on the machine's disks during the measured steps: the devices'
    traffic over rank 0's window less every rank's own tier bytes in it (``/proc/diskstats``; other work on this
    machine shares the disk)."""
    window = ranks[0]["window"]
    if "device_read_bytes" not in window:
        return None
    device = window["device_read_bytes"] + window["device_written_bytes"]
    own = sum(rank["window"]["tier_read_bytes"] + rank["window"]["tier_written_bytes"] for rank in ranks)
    return max(0.0, device - own) / window["wall_seconds"]


def _bound(read: float, written: float, bandwidth: dict[str, Any] | None) -> float | None:
    if bandwidth is None or not (read or written):
        return None
    return read / bandwidth["read_bytes_per_second"] + written / bandwidth["write_bytes_per_second"]


def run_summary(ranks: list[dict[str, Any]], row_bandwidth: dict[str, Any] | None) -> dict[str, Any]:
    """One launch: per measured step the slowest rank's whole step and optimizer step, then their medians; per rank
    the medians of bytes and profile; the I/O bound of the fuller rank, with this launch's bandwidth (``io_bound``)
    and with the bandwidth row's (``io_bound_row``)."""
    measured = [rank["steps"][rank["warmup"] :] for rank in ranks]
    step = [max(times) for times in zip(*([s["step_seconds"] for s in steps] for steps in measured), strict=True)]
    optimizer = [
        max(times) for times in zip(*([s["optimizer_step_seconds"] for s in steps] for steps in measured), strict=True)
    ]
    bandwidth = launch_bandwidth(ranks)
    per_rank = []
    for rank, steps in zip(ranks, measured, strict=True):
        profile = {key: statistics.median(s["profile"].get(key, 0.0) for s in steps) for key in _PROFILE_KEYS}
        read = statistics.median(s["bytes_read"] for s in steps)
        written = statistics.median(s["bytes_written"] for s in steps)
        per_rank.append(
            {
                "rank": rank["rank"],
                "optimizer_step_seconds": statistics.median(s["optimizer_step_seconds"] for s in steps),
                "bytes_read_per_step": read,
                "bytes_written_per_step": written,
                "io_bound_seconds": _bound(read, written, bandwidth),
                "io_bound_row_seconds": _bound(read, written, row_bandwidth),
                "profile_seconds": profile,
                "peak_rss_bytes": rank["host_memory"]["peak_rss_bytes"],
                "engine": rank["engine"],
            }
        )

    def fullest(key: str) -> float | None:
        bounds = [rank[key] for rank in per_rank if rank[key] is not None]
        return max(bounds) if bounds else None

    return {
        "step_seconds": statistics.median(step),
        "optimizer_step_seconds": statistics.median(optimizer),
        "launch_bandwidth": bandwidth,
        "io_bound_seconds": fullest("io_bound_seconds"),
        "io_bound_row_seconds": fullest("io_bound_row_seconds"),
        "other_load": window_other_load(ranks),
        "other_disk_bytes_per_second": other_disk_traffic(ranks),
        "last_loss": statistics.mean(rank["losses"][-1] for rank in ranks),
        "ranks": per_rank,
    }


def run_speed(arguments: argparse.Namespace, scratch: Path, bandwidth: dict[str, Any] | None) -> dict[str, Any]:
    accepted: dict[str, list[dict[str, Any]]] = {label: [] for label in arguments.configurations}
    discarded: list[dict[str, Any]] = []
    order = random.Random(arguments.seed)
    launches = 0
    for repeat in range(arguments.repeats):
        labels = list(arguments.configurations)
        order.shuffle(labels)
        for label in labels:
            for attempt in range(arguments.max_attempts):
                wait_for_quiet(arguments.max_load, arguments.quiet_wait)
                spec = speed_spec(arguments, label, arguments.offload_dir)
                launches += 1
                start = time.perf_counter()
                try:
                    ranks = _launch(spec, scratch, f"speed_{launches}_{label}", 2, arguments.run_timeout)
                except RunFailed as error:
                    print(f"  {label} repeat {repeat}: failed\n{error}", flush=True)
                    discarded.append({"label": label, "repeat": repeat, "error": str(error)[-4000:]})
                    break
                for rank in ranks:
                    rank["warmup"] = arguments.warmup
                summary = {
                    "label": label,
                    "repeat": repeat,
                    "attempt": attempt,
                    "wall_seconds": time.perf_counter() - start,
                    **run_summary(ranks, bandwidth),
                    "raw": ranks,
                }
                load = summary["other_load"]
                disturbed = load is not None and load > arguments.max_load
                print(
                    f"  {label} repeat {repeat}: step {summary['step_seconds']:.2f} s, optimizer step"
                    f" {summary['optimizer_step_seconds']:.2f} s, bound {summary['io_bound_seconds'] or 0:.2f} s,"
                    f" other load {load if load is not None else float('nan'):.2f}"
                    f" -> {'discarded' if disturbed else 'accepted'} ({summary['wall_seconds']:.0f} s)",
                    flush=True,
                )
                if disturbed:
                    discarded.append(summary)
                    continue
                accepted[label].append(summary)
                break
    return {"accepted": accepted, "discarded": discarded, "launches": launches}


def _per_rank(runs: list[dict[str, Any]], figure: Any, digits: int = 2) -> str:
    """``figure`` of each rank, median over the runs: ``rank 0 / rank 1``."""
    values = [statistics.median(figure(run["ranks"][rank]) for run in runs) for rank in range(len(runs[0]["ranks"]))]
    return " / ".join(f"{value:.{digits}f}" for value in values)


def speed_markdown(results: dict[str, Any]) -> list[str]:
    lines = [
        "| configuration | runs | step s | optimizer step s | read / written per step per rank MB |"
        " I/O bound s | optimizer step / bound | step / bound | other load (cores) | other disk traffic MB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, runs in results["accepted"].items():
        if not runs:
            lines.append(f"| {label} | 0 | – | – | – | – | – | – | – | – |")
            continue
        steps = [run["step_seconds"] for run in runs]
        optimizer = [run["optimizer_step_seconds"] for run in runs]
        bounds = [run["io_bound_seconds"] for run in runs if run["io_bound_seconds"]]
        read = statistics.median(max(r["bytes_read_per_step"] for r in run["ranks"]) for run in runs)
        written = statistics.median(max(r["bytes_written_per_step"] for r in run["ranks"]) for run in runs)
        loads = [run["other_load"] or 0.0 for run in runs]
        traffic = [run.get("other_disk_bytes_per_second") or 0.0 for run in runs]
        if bounds:
            bound = _fmt_range(bounds)
            ratio_optimizer = _fmt_range([r["optimizer_step_seconds"] / r["io_bound_seconds"] for r in runs])
            ratio_step = _fmt_range([r["step_seconds"] / r["io_bound_seconds"] for r in runs])
        else:
            bound = ratio_optimizer = ratio_step = "–"
        lines.append(
            f"| {label} | {len(runs)} | {_fmt_range(steps)} | {_fmt_range(optimizer)} |"
            f" {read / 1e6:.0f} / {written / 1e6:.0f} | {bound} | {ratio_optimizer} | {ratio_step} |"
            f" {_fmt_range(loads)} | {_fmt_range(traffic, 1e6, 0)} |"
        )
    lines += [
        "",
        "Where a rank's optimizer step goes (s, median over steps, then over runs; rank 0 / rank 1):",
        "",
        "| configuration | optimizer step | stepping (arithmetic) | waiting for reads | waiting for writes |"
        " binding state | rank-local stream | rank agreement | reads in flight | writes in flight | disk busy |"
        " peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, runs in results["accepted"].items():
        if not runs:
            continue
        profile = {key: _per_rank(runs, lambda rank, key=key: rank["profile_seconds"][key]) for key in _PROFILE_KEYS}
        agreement = _per_rank(
            runs,
            lambda rank: (
                rank["optimizer_step_seconds"] - rank["profile_seconds"]["local"]
                if rank["profile_seconds"]["local"]
                else 0.0
            ),
        )
        rss = _per_rank(runs, lambda rank: rank["peak_rss_bytes"] / MIB, digits=0)
        lines.append(
            f"| {label} | {_per_rank(runs, lambda rank: rank['optimizer_step_seconds'])} | {profile['arithmetic']} |"
            f" {profile['read_wait']} | {profile['write_wait']} | {profile['bind']} | {profile['local']} |"
            f" {agreement} | {profile['read_io']} | {profile['write_io']} | {profile['io_busy']} | {rss} |"
        )
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def record_bytes(arguments: argparse.Namespace) -> int:
    """One Gemini chunk's Adam state on one of 2 ranks: 8 bytes per element of its shard."""
    return 8 * arguments.chunk_numel // 2


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    start = time.perf_counter()
    created = not arguments.offload_dir.exists()
    arguments.offload_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    transfers = sorted(set(arguments.transfers_mib) | {max(1, record_bytes(arguments) // MIB)})
    try:
        with tempfile.TemporaryDirectory(prefix="disk_study_") as scratch:
            if "bandwidth" in arguments.rows:
                print("bandwidth", flush=True)
                results["bandwidth"] = run_bandwidth(arguments, Path(scratch), transfers)
            if "speed" in arguments.rows:
                if "bandwidth" not in results:
                    # The bound needs this disk's 2-rank bandwidth now: the record-size case alone.
                    narrowed = argparse.Namespace(**{**vars(arguments), "totals_mib": [max(arguments.totals_mib)]})
                    results["bandwidth"] = run_bandwidth(narrowed, Path(scratch), [record_bytes(arguments) // MIB])
                bound = bound_bandwidth(results["bandwidth"], record_bytes(arguments))
                print("speed", flush=True)
                results["speed"] = {"bound_bandwidth": bound, **run_speed(arguments, Path(scratch), bound)}
    finally:
        if created:
            shutil.rmtree(arguments.offload_dir, ignore_errors=True)
    context = {
        "cpu": cpu_description(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": shlex.join(["python", "-m", "benchmarks.disk", *(sys.argv[1:] if argv is None else argv)]),
        "software": ", ".join(f"{name} {version}" for name, version in software_versions().items()),
        "git": git_revision(REPOSITORY_ROOT),
        "wall_seconds": time.perf_counter() - start,
    }
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(arguments).items()},
        "context": context,
        **results,
    }
    arguments.output.write_text(json.dumps(payload, indent=2))
    lines = [
        f"- Machine: {context['cpu']}",
        f"- Date: {context['date']}",
        f"- Command: `{context['command']}`",
        f"- Software: {context['software']}, git {context['git']}",
        f"- Wall time: {context['wall_seconds']:.0f} s",
        "",
    ]
    if "bandwidth" in results:
        bandwidth = results["bandwidth"]
        lines += [
            f"Bandwidth (direct I/O: {bandwidth['direct_io']}, {bandwidth['block_bytes'] // MIB} MiB per system call,"
            f" median [min–max] over {arguments.rounds} passes):",
            "",
            *bandwidth_markdown(bandwidth),
            "",
        ]
    if "speed" in results:
        speed = results["speed"]
        bound = speed["bound_bandwidth"]
        lines += [
            f"Speed (model {json.dumps(arguments.model)}, chunk {arguments.chunk_numel:,} elements,"
            f" {arguments.batch_size_per_rank} x {arguments.sequence_length} tokens per rank, {arguments.warmup}"
            f" warm-up + {arguments.steps} measured steps per launch; per launch the median over measured steps of the"
            " slowest rank, shown as median [min–max] over launches). I/O bound per rank with"
            f" {bound['read_bytes_per_second'] / GB:.2f} GB/s read and {bound['write_bytes_per_second'] / GB:.2f}"
            f" GB/s write per rank (2 ranks at once, {bound['transfer_bytes'] // MIB} MiB calls):",
            "",
            *speed_markdown(speed),
            "",
        ]
    print("\n".join(lines))
    print(f"JSON: {arguments.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
