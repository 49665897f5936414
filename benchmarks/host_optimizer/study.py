"""How fast an optimizer steps parameters in host memory, against what the memory allows.

``python -m benchmarks.host_optimizer`` steps AdamW over ``--sizes`` million fp32 parameters (one tensor of each
size, split into ``--tensors`` tensors, as an engine's host shards are) with each implementation in turn:

- ``loop``: torch's default for host tensors (neither ``foreach`` nor ``fused``), what an offloaded optimizer ran before
  the engines stepped host masters with the fused kernel;
- ``foreach``: ``foreach=True``;
- ``engines``: what ZeRO and Gemini now run on host masters, the user's AdamW inside
  ``optimizer_takeover.fused_host_step`` (torch's fused CPU kernel);
- ``deepspeed``: DeepSpeed's ``DeepSpeedCPUAdam`` (``adamw_mode=True``), when DeepSpeed is installed (the
  ``benchmark-deepspeed`` extra) and its CPU Adam builds here.

The bound: an Adam step must read the parameter, its gradient and two moments and write three of them back, 28 bytes
per fp32 parameter; the host's bandwidth is measured in the same invocation with ``a += b`` over arrays larger than
the caches (12 bytes per element, in place as Adam's updates are), on the same threads, after each size's rounds. A step's time is the median over
``--repeats`` rounds (after ``--warmup``), the implementations in a seeded random order each round, so a shared
machine's drift falls on all of them alike. Threads: ``--threads`` (default: every core torch sees).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.launch import REPOSITORY_ROOT
from benchmarks.harness.machine import cpu_description, git_revision, software_versions
from lightning_colossal.engine_parts.optimizer_takeover import fused_host_step

BYTES_PER_ADAM_PARAMETER = 28
# The engines step host masters with the fused kernel when the model computes on an accelerator (offload).
OFFLOADING_FROM = torch.device("cuda", 0)
IMPLEMENTATIONS = ("loop", "foreach", "engines", "deepspeed")


def measure_bandwidth(elements: int, repeats: int) -> float:
    """Bytes per second of ``a += b`` over ``elements`` fp32 elements (read both, write ``a`` back: 12 bytes, and no
    store to memory it did not read, as in Adam's in-place updates), the median of ``repeats``."""
    a, b = torch.rand(elements), torch.rand(elements)
    a.add_(b)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a.add_(b)
        times.append(time.perf_counter() - start)
    return 12 * elements / statistics.median(times)


class Stepper:
    """One implementation's AdamW over ``tensors`` fp32 tensors summing to ``elements``, with gradients set."""

    def __init__(self, implementation: str, elements: int, tensors: int) -> None:
        sizes = [elements // tensors + (1 if index < elements % tensors else 0) for index in range(tensors)]
        self.parameters = [torch.nn.Parameter(torch.rand(size)) for size in sizes]
        for parameter in self.parameters:
            parameter.grad = torch.rand_like(parameter)
        settings = {"lr": 1e-4, "weight_decay": 0.01}
        self.implementation = implementation
        if implementation == "deepspeed":
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # type: ignore[import-not-found]

            self.optimizer: Any = DeepSpeedCPUAdam(self.parameters, adamw_mode=True, **settings)
        elif implementation == "foreach":
            self.optimizer = torch.optim.AdamW(self.parameters, foreach=True, **settings)
        else:
            self.optimizer = torch.optim.AdamW(self.parameters, **settings)

    def step(self) -> float:
        start = time.perf_counter()
        if self.implementation == "engines":
            with fused_host_step(self.optimizer, OFFLOADING_FROM):
                self.optimizer.step()
        else:
            self.optimizer.step()
        return time.perf_counter() - start


def available(implementation: str) -> str | None:
    """``None`` when ``implementation`` can run here, else why not."""
    if implementation != "deepspeed":
        return None
    try:
        Stepper("deepspeed", 16, 1)
    except Exception as error:  # not installed, or its CPU Adam does not build on this machine
        return f"{type(error).__name__}: {error}".splitlines()[0][:200]
    return None


def run_size(million: float, arguments: argparse.Namespace, implementations: list[str], seed: int) -> dict[str, Any]:
    elements = int(million * 1_000_000)
    steppers = {name: Stepper(name, elements, arguments.tensors) for name in implementations}
    for stepper in steppers.values():
        for _ in range(arguments.warmup):
            stepper.step()
    times: dict[str, list[float]] = {name: [] for name in implementations}
    order_random = random.Random(seed)
    for _ in range(arguments.repeats):
        order = list(implementations)
        order_random.shuffle(order)
        for name in order:
            times[name].append(steppers[name].step())
    bandwidth = measure_bandwidth(max(elements, 50_000_000), 2 * arguments.repeats + 1)
    bound = BYTES_PER_ADAM_PARAMETER * elements / bandwidth
    rows = {}
    for name, measured in times.items():
        median = statistics.median(measured)
        rows[name] = {
            "median_seconds": median,
            "range_seconds": [min(measured), max(measured)],
            "elements_per_second": elements / median,
            "fraction_of_bandwidth_bound": bound / median,
        }
    return {
        "million_parameters": million,
        "bandwidth_bytes_per_second": bandwidth,
        "bound_seconds": bound,
        "rows": rows,
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"`{report['command']}` ({report['date']}, {report['machine']}, {report['threads']} thread(s), git"
        f" {report['git']}; median of {report['repeats']} rounds)",
        "",
        "| parameters | bandwidth | bound (28 B/param) | " + " | ".join(report["implementations"]) + " |",
        "|---|---|---|" + "---|" * len(report["implementations"]),
    ]
    for size in report["sizes"]:
        cells = []
        for name in report["implementations"]:
            row = size["rows"][name]
            cells.append(
                f"{row['median_seconds'] * 1e3:.0f} ms, {row['elements_per_second'] / 1e6:.0f} M/s,"
                f" {row['fraction_of_bandwidth_bound']:.0%} of bound"
            )
        lines.append(
            f"| {size['million_parameters']:g}M | {size['bandwidth_bytes_per_second'] / 1e9:.1f} GB/s |"
            f" {size['bound_seconds'] * 1e3:.0f} ms | " + " | ".join(cells) + " |"
        )
    for name, why in report["not_run"].items():
        lines.append(f"\n{name} did not run: {why}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[10, 50, 100], help="million parameters")
    parser.add_argument("--tensors", type=int, default=64, help="tensors the parameters are split into")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "host_optimizer.json")
    parser.add_argument("--markdown", action="store_true", help="print the table for benchmarks/RESULTS.md")
    arguments = parser.parse_args(argv)
    torch.set_num_threads(arguments.threads)
    not_run = {name: why for name in arguments.implementations if (why := available(name)) is not None}
    implementations = [name for name in arguments.implementations if name not in not_run]
    sizes = [
        run_size(million, arguments, implementations, arguments.seed + index)
        for index, million in enumerate(arguments.sizes)
    ]
    report = {
        "command": "python -m benchmarks.host_optimizer "
        + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": cpu_description(),
        "software": software_versions(),
        "git": git_revision(REPOSITORY_ROOT),
        "threads": arguments.threads,
        "repeats": arguments.repeats,
        "implementations": implementations,
        "not_run": not_run,
        "sizes": sizes,
    }
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(report, indent=2))
    print(markdown(report) if arguments.markdown else json.dumps(report, indent=2))
    return 0
