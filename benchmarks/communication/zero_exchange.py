"""ZeRO's parameter exchange by route, on the benchmark GPT: what giving every rank the updated rows costs alone.

``python -m benchmarks.communication.zero_exchange [--stage S] [--rounds R] [--repeats N]`` starts two gloo ranks,
builds ``ZeroEngine`` on the 27.4M benchmark GPT (its buckets and layout as in a run) and times
``ParameterExchange``'s routes bucket by bucket, each started behind a barrier and waited for at once:

- rows in place: point-to-point sends of each parameter's rows straight into the other rank's parameters (the route
  on gloo since 2026-11-28, ``zero/exchange.py`` [Note: parameter exchange per backend]);
- rank-major buffer: the rows packed into a buffer, all-gathered point to point, unpacked (the route before, and
  NCCL's shape);
- all-reduce: the rows into a zeroed full buffer, all-reduced (``communication="all_reduce"``).

The routes alternate in ``R`` rounds of ``N`` timed exchanges after one warm-up each, so drift of the shared machine's
load falls on every route alike. Prints the median and range per route and each route's median ratio to rows in
place.
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
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.harness.launch import free_port
from benchmarks.peers.configuration import BENCHMARK_MODEL
from lightning_colossal.config import ZeroConfig
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.zero.engine import ZeroEngine
from lightning_colossal.zero.exchange import ParameterExchange
from lightning_colossal.zero.reducer import Bucket


def _routes(exchange: ParameterExchange) -> dict[str, Callable[[Bucket], object]]:
    # The routes ParameterExchange.start chooses between, called directly so that each can be timed on gloo.
    return {
        "rows in place": lambda bucket: exchange._start_rows_in_place(bucket.members),
        "rank-major buffer": lambda bucket: exchange._start_all_gather(bucket.members, bucket.dtype),
        "all-reduce": exchange._start_all_reduce,
    }


def _exchange_all(exchange: ParameterExchange, start: Callable[[Bucket], object]) -> float:
    dist.barrier()
    began = time.perf_counter()
    for bucket in exchange.reducer.buckets:
        work = start(bucket)
        if work is not None:
            work.wait()  # type: ignore[attr-defined]
    return time.perf_counter() - began


def _rank(rank: int, port: int, stage: int, rounds: int, repeats: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)
    model = GPT(GPTConfig(**BENCHMARK_MODEL))
    optimizer = torch.optim.AdamW(model.parameters())
    engine = ZeroEngine(model, optimizer, ZeroConfig(stage=stage), init_device_mesh("cpu", (2,)), torch.device("cpu"))
    routes = _routes(engine.exchange)
    seconds: dict[str, list[float]] = {label: [] for label in routes}
    for _ in range(rounds):
        for label, start in routes.items():
            _exchange_all(engine.exchange, start)  # warm-up: pooled buffers, first touch
            seconds[label].extend(_exchange_all(engine.exchange, start) for _ in range(repeats))
    if rank == 0:
        numel = sum(parameter.numel() for parameter in model.parameters())
        buckets = engine.reducer.buckets
        print(
            f"ZeRO-{stage}, 2 gloo ranks, {numel:,} fp32 parameters in {len(buckets)} buckets"
            f" ({sum(len(bucket.members) for bucket in buckets)} parameters), {rounds} rounds x {repeats}",
            flush=True,
        )
        reference = statistics.median(seconds["rows in place"])
        for label, values in seconds.items():
            median = statistics.median(values)
            print(
                f"{label}: median {median * 1e3:.1f} ms [{min(values) * 1e3:.1f}–{max(values) * 1e3:.1f}],"
                f" n={len(values)}, {median / reference:.2f}x rows in place",
                flush=True,
            )
    engine.remove()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2), help="ZeRO stage (its buckets)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each timing every route in turn")
    parser.add_argument("--repeats", type=int, default=4, help="timed exchanges per route and round")
    arguments = parser.parse_args(argv)
    mp.spawn(_rank, args=(free_port(), arguments.stage, arguments.rounds, arguments.repeats), nprocs=2)


if __name__ == "__main__":
    main()
