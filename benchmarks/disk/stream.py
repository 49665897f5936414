"""The disk tier's streamed optimizer step alone, without Gemini or Lightning: where its time goes against the I/O bound.

    python -m benchmarks.disk.stream --records 25 --record-numel 2101248 --steps 5

Starts 2 gloo ranks (``benchmarks.harness.launch``, ``OMP_NUM_THREADS=1``); each holds ``--records`` fp32 masters of
``--record-numel`` elements (the speed row's default: one rank's shard of a 4,202,496-element chunk, one record of
16.8 MB of Adam state each) under ``torch.optim.AdamW`` with its state in the tier (``open_disk_state``, one record per
master) under ``--offload-dir``, and times, both ranks starting each step together:

- ``adamw``: ``DiskOptimizerState.step``, the tier's own stream (read the next record, step this one, write the last);
- ``no_arithmetic``: the same stream with the optimizer's step of a record replaced by nothing (``_step_only``
  patched in this process): the stream's reads, writes and their ordering alone;
- ``no_dependencies``: the same reads and writes (every record read and written once) submitted at once to the
  tier's own I/O pool, alternating read and write, and waited for: the requests without the stream's ordering;
- ``bound``: per step, bytes read / read bandwidth + bytes written / write bandwidth, from sequential passes of the
  same size by both ranks at once right before (``benchmarks.disk.ranks.measure_case``).

Prints one line per variant and rank (seconds per step) and writes the figures as JSON (``--output``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, launch_ranks
from benchmarks.harness.machine import git_revision


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.disk.stream", description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=25)
    parser.add_argument("--record-numel", type=int, default=2_101_248)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (after 2 unmeasured)")
    parser.add_argument(
        "--one-task-per-transfer",
        action="store_true",
        help="the tier as before 2026-11-27: each read or write one task on a 2-thread pool (blocks in turn)",
    )
    parser.add_argument(
        "--staging-slots",
        type=int,
        default=None,
        help="staging buffers of the tier (its STAGING_SLOTS when omitted); reads queue ahead into the spare ones",
    )
    parser.add_argument(
        "--offload-dir", type=Path, default=Path(tempfile.gettempdir()) / "lightning_colossal_disk_stream"
    )
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "disk_stream.json")
    return parser.parse_args(argv)


def rank_main(arguments: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from benchmarks.disk.ranks import _tier_files, measure_case
    from lightning_colossal.disk import optimizer_state
    from lightning_colossal.disk.files import TierDirectory, align_up, aligned_buffer

    dist.init_process_group("gloo")
    if arguments.one_task_per_transfer:
        from lightning_colossal.disk import files

        files.SPLIT_TRANSFERS, files.IO_THREADS = False, 2
    if arguments.staging_slots is not None:
        optimizer_state.STAGING_SLOTS = arguments.staging_slots
    torch.manual_seed(0)
    masters = [torch.zeros(arguments.record_numel, requires_grad=True) for _ in range(arguments.records)]
    for master in masters:
        master.grad = torch.randn_like(master) * 1e-3
    optimizer = torch.optim.AdamW(masters, lr=1e-4)
    rank = dist.get_rank()
    state = optimizer_state.open_disk_state(
        optimizer, [[master] for master in masters], str(arguments.offload_dir), rank, torch.device("cpu"), "stream"
    )
    result: dict[str, Any] = {"rank": rank}
    try:

        def timed(run: Any, steps: int) -> list[float]:
            seconds = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                run()
                seconds.append(time.perf_counter() - start)
            return seconds

        def stream() -> None:
            state.step(None)

        timed(stream, 2)  # the first step writes only; the second is the first that reads
        read_before, written_before = state.bytes_read, state.bytes_written
        result["adamw"] = timed(stream, arguments.steps)
        result["bytes_read_per_step"] = (state.bytes_read - read_before) // arguments.steps
        result["bytes_written_per_step"] = (state.bytes_written - written_before) // arguments.steps
        original = optimizer_state.DiskOptimizerState._step_only
        optimizer_state.DiskOptimizerState._step_only = lambda self, keep: None  # type: ignore[method-assign]
        try:
            result["no_arithmetic"] = timed(stream, arguments.steps)
        finally:
            optimizer_state.DiskOptimizerState._step_only = original  # type: ignore[method-assign]
        size = align_up(state.records[0].nbytes)
        buffers = [aligned_buffer(size) for _ in range(2)]

        def no_dependencies() -> None:
            futures = []
            for record in state.records:
                futures.append(state.file.read(record.file_offset, buffers[0][:size]))
                futures.append(state.file.write(record.file_offset, buffers[1][:size]))
            for future in futures:
                future.result()

        result["no_dependencies"] = timed(no_dependencies, arguments.steps)
        # The bound, measured now with both ranks at once: the same bytes, in record-sized calls.
        directory = TierDirectory(arguments.offload_dir, rank)
        try:
            total = size * arguments.records
            (tier,), source, sink = _tier_files(directory, total, 1)
            passes = measure_case((tier, None), (source, sink), total, size, 3, dist.barrier)
            tier.close()
        finally:
            directory.close()
        result["bandwidth_passes"] = passes
        result["pass_bytes"] = total
    finally:
        state.close()
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("RANK") is not None:  # a rank
        arguments = parse_arguments(argv)
        result = rank_main(arguments)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    arguments = parse_arguments(argv)
    created = not arguments.offload_dir.exists()
    try:
        with tempfile.TemporaryDirectory(prefix="disk_stream_") as scratch:
            launch_ranks("benchmarks.disk.stream", sys.argv[1:] if argv is None else argv, 2, Path(scratch), 900)
            ranks = []
            for rank in (0, 1):
                lines = (Path(scratch) / f"rank{rank}.log").read_text().splitlines()
                ranks.append(json.loads(next(line for line in lines if line.startswith("RESULT "))[7:]))
    finally:
        if created:
            import shutil

            shutil.rmtree(arguments.offload_dir, ignore_errors=True)
    total = ranks[0]["pass_bytes"]
    passes = list(zip(*(rank["bandwidth_passes"] for rank in ranks), strict=True))
    read = statistics.median(total / max(p["read_seconds"] for p in both) for both in passes)
    write = statistics.median(total / max(p["write_seconds"] for p in both) for both in passes)
    bound = ranks[0]["bytes_read_per_step"] / read + ranks[0]["bytes_written_per_step"] / write
    print(f"git {git_revision(REPOSITORY_ROOT)}; per rank and step {ranks[0]['bytes_read_per_step'] / 1e6:.0f} MB read")
    print(f"and written; bandwidth with both ranks at once {read / 1e9:.2f} GB/s read, {write / 1e9:.2f} GB/s write")
    print(f"I/O bound {bound:.3f} s per step")
    summary = {}
    for variant in ("adamw", "no_arithmetic", "no_dependencies"):
        # Per step the slower rank (the steps start together), then the median over the steps.
        seconds = statistics.median(max(pair) for pair in zip(*(rank[variant] for rank in ranks), strict=True))
        summary[variant] = {"seconds": seconds, "over_bound": seconds / bound}
        print(f"{variant:>16}: {seconds:.3f} s per step, {seconds / bound:.2f}x the bound")
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "arguments": {k: str(v) if isinstance(v, Path) else v for k, v in vars(arguments).items()},
        "git": git_revision(REPOSITORY_ROOT),
        "read_bytes_per_second": read,
        "write_bytes_per_second": write,
        "bound_seconds": bound,
        "summary": summary,
        "ranks": ranks,
    }
    arguments.output.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
