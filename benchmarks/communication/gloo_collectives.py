"""Raw gloo collectives on this machine: what one parameter exchange of the benchmark GPT costs by each route.

``python -m benchmarks.communication.gloo_collectives [--numel N] [--repeats R]`` starts two gloo ranks and times, on the
27,369,472 fp32 elements of the benchmark GPT: an all-reduce of the whole tensor (ZeRO's exchange on gloo, every rank
contributing its own rows into zeros), gloo's all-gather of each rank's half into the whole, the same all-gather and
a reduce-scatter built from point-to-point sends (``lightning_colossal.distributed.direct_exchange``, the engines'
route on gloo), and the buffer work the all-reduce route adds (zeroing the buffer and copying the result out). Prints the median and
range over ``R`` timed repeats after one warm-up, each started behind a barrier.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness.launch import free_port
from lightning_colossal.distributed import direct_exchange

BENCHMARK_GPT_NUMEL = 27_369_472


def _timed(operation: Callable[[], object], repeats: int) -> list[float]:
    operation()  # warm-up: first-touch page faults and gloo's connection set-up
    seconds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        operation()
        seconds.append(time.perf_counter() - start)
    return seconds


def _rank(rank: int, port: int, numel: int, repeats: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    whole = torch.zeros(numel)
    half = torch.randn(numel // 2)
    gathered = torch.empty(numel // 2 * 2)
    parameters = torch.empty(numel)
    half_out = torch.empty(numel // 2)
    routes: dict[str, Callable[[], object]] = {
        "all_reduce of the whole tensor": lambda: dist.all_reduce(whole),
        "gloo's all_gather of the halves": lambda: dist.all_gather(list(gathered.view(2, -1).unbind(0)), half),
        "point-to-point all-gather of the halves": lambda: direct_exchange.all_gather(gathered, half, None).wait(),
        "point-to-point reduce-scatter of the whole tensor": lambda: direct_exchange.reduce_scatter(
            half_out, whole, None
        ).wait(),
        "zero the buffer + copy the result out": lambda: (whole.zero_(), parameters.copy_(whole)),
    }
    for label, operation in routes.items():
        seconds = _timed(operation, repeats)
        if rank == 0:
            print(
                f"{label}: median {statistics.median(seconds) * 1e3:.1f} ms"
                f" [{min(seconds) * 1e3:.1f}–{max(seconds) * 1e3:.1f}], n={repeats}",
                flush=True,
            )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=BENCHMARK_GPT_NUMEL, help="fp32 elements exchanged")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per route")
    arguments = parser.parse_args(argv)
    print(f"2 gloo ranks, {arguments.numel:,} fp32 elements ({arguments.numel * 4 / 2**20:.1f} MiB)", flush=True)
    mp.spawn(_rank, args=(free_port(), arguments.numel, arguments.repeats), nprocs=2)


if __name__ == "__main__":
    main()
