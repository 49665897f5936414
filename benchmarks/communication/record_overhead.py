"""What recording the collective in flight costs (``distributed/in_flight.py``, reported in docs/reliability.md).

Two gloo ranks on this host run ``--calls`` one-element all-reduces through ``collectives.all_reduce`` (blocking) and
``collectives.all_reduce_async(...).wait()`` (the engines' path), with the record and with it patched out,
alternating every ``--calls / 20`` calls, for ``--rounds`` rounds; the medians and their ratio are printed. The
record's own cost, without communication, is timed too (entering and leaving ``Collective`` and ``Activity``), since
on a shared machine the all-reduces' own noise is larger than the record: ``--control`` keeps the record in both
arms, so its ratio is the noise floor of the comparison.

    python -m benchmarks.communication.record_overhead --calls 10000 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as multiprocessing

from benchmarks.harness.launch import free_port
from lightning_colossal.distributed import collectives, in_flight

BLOCKS = 20  # per round and mode


class _NoRecord:
    """``in_flight.Collective`` with the record taken out (the same call, doing nothing)."""

    def __init__(self, *arguments: Any, **keywords: Any) -> None:
        pass

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exception_info: Any) -> None:
        pass


def _use_record(enabled: bool) -> None:
    collectives.Collective = in_flight.Collective if enabled else _NoRecord  # type: ignore[misc]
    collectives.RecordedWork = in_flight.RecordedWork if enabled else (lambda work, *arguments: work)  # type: ignore


def _timed(function: Any, calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        function()
    return time.perf_counter() - start


def _record_only_nanoseconds(calls: int) -> dict[str, float]:
    tensor = torch.zeros(1)
    start = time.perf_counter()
    for _ in range(calls):
        with in_flight.Collective("all_reduce", None, tensor):
            pass
    collective = (time.perf_counter() - start) / calls * 1e9
    start = time.perf_counter()
    for index in range(calls):
        with in_flight.Activity("reducing gradient bucket {} of {}", index, calls):
            pass
    activity = (time.perf_counter() - start) / calls * 1e9
    return {"Collective enter+exit (ns)": collective, "Activity enter+exit (ns)": activity}


def _worker(rank: int, port: int, calls: int, rounds: int, control: bool, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tensor = torch.zeros(1)
    paths = {
        "blocking all_reduce": lambda: collectives.all_reduce(tensor),
        "async all_reduce + wait": lambda: collectives.all_reduce_async(tensor).wait(),
    }
    seconds: dict[tuple[str, bool], list[float]] = {(path, enabled): [] for path in paths for enabled in (True, False)}
    # The fastest block of each mode: the least disturbed by other work on a shared machine.
    fastest: dict[tuple[str, bool], float] = {}
    block = max(1, calls // BLOCKS)
    for path, function in paths.items():
        _timed(function, calls // 10)  # warm-up
        for _ in range(rounds):
            # Alternating in small blocks, so the load of a shared machine drifts over both modes alike.
            totals = {True: 0.0, False: 0.0}
            for block_index in range(BLOCKS):
                for enabled in (True, False) if block_index % 2 == 0 else (False, True):
                    _use_record(enabled or control)
                    elapsed = _timed(function, block)
                    totals[enabled] += elapsed
                    fastest[(path, enabled)] = min(fastest.get((path, enabled), elapsed), elapsed)
            for enabled, total in totals.items():
                seconds[(path, enabled)].append(total)
    _use_record(True)
    if rank == 0:
        results.put((seconds, fastest, block, _record_only_nanoseconds(100_000)))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--control", action="store_true", help="keep the record in both arms: the ratio then shows the noise floor"
    )
    arguments = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    processes = [
        context.Process(
            target=_worker, args=(rank, port, arguments.calls, arguments.rounds, arguments.control, results)
        )
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    seconds, fastest, block, record_only = results.get()
    for process in processes:
        process.join()
    if arguments.control:
        print("--control: the record is on in both arms, so 'without' is the record too; the ratio is the noise floor.")
    print(f"{arguments.calls} one-element all-reduces on 2 gloo ranks, median of {arguments.rounds} rounds:")
    for path in dict.fromkeys(path for path, _ in seconds):
        with_record = statistics.median(seconds[(path, True)])
        without = statistics.median(seconds[(path, False)])
        print(
            f"  {path}: {with_record:.3f} s with the record, {without:.3f} s without, ratio {with_record / without:.3f}"
            f" ({(with_record - without) / arguments.calls * 1e6:+.2f} us per call)"
        )
    print(f"fastest block of {block} calls:")
    for path in dict.fromkeys(path for path, _ in fastest):
        with_record, without = fastest[(path, True)], fastest[(path, False)]
        print(
            f"  {path}: {with_record / block * 1e6:.1f} us per call with the record, {without / block * 1e6:.1f} us"
            f" without, ratio {with_record / without:.3f}"
        )
    print("the record alone, no communication:")
    for name, nanoseconds in record_only.items():
        print(f"  {name}: {nanoseconds:.0f}")


if __name__ == "__main__":
    main()
