"""Where a step's time goes, per strategy: the phases of a step and what the CPU does in them.

``python -m benchmarks.peers.phases`` trains the peers' benchmark GPT (``configuration.BENCHMARK_MODEL``) on 2 gloo
ranks under each configuration in turn, with two probes on every rank:

- **phases** (wall clock, every measured step): forward (batch start to ``on_before_backward``), backward (to
  ``on_after_backward``), the engine's work between backward and the optimizer (to ``on_before_optimizer_step``:
  waits for gradient reductions, clipping) and the optimizer step (to the batch's end). Per step the slower rank's
  figure, then the median over steps.
- **what runs** (``torch.profiler`` on the CPU, the same steps, in a second run of the configuration): the self
  time of every operator, grouped as compute (the model's arithmetic), the optimizer's arithmetic, copies and fills
  (moving bytes between buffers), communication (time inside collective calls and waits), and the rest of the step's
  wall time, which no operator accounts for: Python (hooks, bookkeeping, Lightning's loop) and the profiler itself.

The profiled run is slower than the timed one (the profiler costs a few microseconds per operator), so its figures are
shares of a profiled step, next to the unprofiled phase times; they say where the time goes, not how long a step is.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, launch_ranks
from benchmarks.harness.machine import git_revision

#: Operator name prefixes, by what the CPU is doing in them (the first match wins; lower case).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "communication",
        (
            "gloo:",
            "c10d::",
            "c10d:",
            "record_param_comms",
            "nccl:",
            "aten::_allgather",
            "aten::_reduce",
            "allreduce",
            "allgather",
            "reduce_scatter",
            "send",
            "recv",
            "wait",
            "barrier",
            "broadcast",
            "_c10d_functional",
        ),
    ),
    (
        "optimizer arithmetic",
        ("aten::_foreach", "aten::lerp", "aten::addcdiv", "aten::addcmul", "aten::sqrt", "aten::_fused_adam"),
    ),
    (
        "copies and fills",
        (
            "aten::copy_",
            "aten::cat",
            "aten::fill_",
            "aten::zero_",
            "aten::zeros",
            "aten::empty",
            "aten::clone",
            "aten::contiguous",
            "aten::to",
            "aten::_to_copy",
            "aten::index_put",
            "aten::split_with_sizes_copy",
            "aten::resize_",
            "aten::set_",
            "aten::narrow_copy",
            "aten::flatten_dense_tensors",
            "aten::new_empty",
            "aten::new_zeros",
        ),
    ),
)
COMPUTE = "compute"
SCOPES = "Python inside scopes and autograd nodes"
UNACCOUNTED = "Python and profiler (no operator)"


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers.phases", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configuration",
        action="append",
        default=None,
        help="label=strategy[:json init args], e.g. lightning_fsdp2=lightning.pytorch.strategies:ModelParallelStrategy"
        ' with args {"data_parallel_size": 2, "tensor_parallel_size": 1} written as label=strategy@{json}',
    )
    parser.add_argument("--steps", type=int, default=8, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "phases.json")
    parser.add_argument(
        "--python-profile",
        action="store_true",
        help="also run cProfile over the measured steps of the profiled run and list the Python functions with the"
        " most own time",
    )
    parser.add_argument("--rank-spec", type=Path, default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


DEFAULT_CONFIGURATIONS = (
    "colossal_gemini=colossal_gemini",
    "colossal_fsdp=colossal_fsdp",
    'lightning_fsdp2=lightning.pytorch.strategies:ModelParallelStrategy@{"data_parallel_size":2,"tensor_parallel_size":1}',
)


def _parse_configuration(text: str) -> tuple[str, str, dict[str, Any]]:
    label, _, rest = text.partition("=")
    strategy, _, arguments = rest.partition("@")
    return label, strategy, json.loads(arguments) if arguments else {}


def category_of(name: str) -> str:
    """The category of an operator: communication by any of its words anywhere in the name (``gloo:all_reduce``,
    ``c10d::send``, ``record_param_comms``), the others by prefix; other ``aten::`` operators are the model's
    arithmetic, and everything else a scope (an autograd node, ``FSDP::all_gather``, ``Optimizer.step``) whose self
    time is the Python that ran inside it: hooks in autograd nodes, an engine's bookkeeping."""
    lowered = name.lower()
    communication, *others = CATEGORIES
    if any(word in lowered for word in communication[1]):
        return communication[0]
    for category, prefixes in others:
        if lowered.startswith(prefixes):
            return category
    return COMPUTE if lowered.startswith("aten::") else SCOPES


# ------------------------------------------------------------------------------------------------------------- ranks
def rank_main(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from lightning.pytorch import Callback
    from torch.utils.data import DataLoader

    import lightning_colossal  # noqa: F401  (registers the colossal_* names)
    from benchmarks.harness.workload import BenchmarkModule, build_strategy, train_on_cpu
    from benchmarks.peers.configuration import BENCHMARK_MODEL
    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.model import GPTConfig

    torch.set_num_threads(1)
    warmup, steps, profiled = spec["warmup"], spec["steps"], spec["profiled"]

    class Phases(Callback):
        def __init__(self) -> None:
            self.marks: list[dict[str, float]] = []
            self.profiler: Any = None

        def _mark(self, name: str) -> None:
            self.marks[-1][name] = time.perf_counter()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_index: int) -> None:
            if profiled and batch_index == warmup:
                if spec.get("python_profile"):
                    self.profiler = cProfile.Profile()
                    self.profiler.enable()
                else:
                    self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                    self.profiler.__enter__()
            self.marks.append({"start": time.perf_counter()})

        def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
            self._mark("forward_end")

        def on_after_backward(self, trainer: Any, module: Any) -> None:
            self._mark("backward_end")

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self._mark("optimizer_start")

        def on_train_batch_end(self, trainer: Any, module: Any, *args: Any) -> None:
            self._mark("end")
            if self.profiler is not None and len(self.marks) == warmup + steps:
                if isinstance(self.profiler, cProfile.Profile):
                    self.profiler.disable()
                else:
                    self.profiler.__exit__(None, None, None)

    model_config = GPTConfig(**BENCHMARK_MODEL)
    torch.manual_seed(0)
    batch_size, world_size = 4, 2
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=model_config.block_size,
        num_samples=batch_size * world_size * (warmup + steps),
        seed=0,
    )
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, drop_last=True)
    probe = Phases()
    trainer = train_on_cpu(
        build_strategy(spec["strategy"], spec["init_args"]),
        world_size,
        warmup + steps,
        BenchmarkModule(model_config, 3e-4),
        loader,
        [probe],
    )
    measured = probe.marks[warmup:]
    engine = getattr(trainer.strategy, "engine", None)
    pool = getattr(getattr(engine, "manager", None), "buffers", None)
    result: dict[str, Any] = {
        "phases": [
            {
                "forward": mark["forward_end"] - mark["start"],
                "backward": mark["backward_end"] - mark["forward_end"],
                "after backward": mark["optimizer_start"] - mark["backward_end"],
                "optimizer step": mark["end"] - mark["optimizer_start"],
                "step": mark["end"] - mark["start"],
            }
            for mark in measured
        ]
    }
    if pool is not None:
        result["buffer_pool"] = {"reused": pool.reused, "allocated": pool.allocated}
    if isinstance(probe.profiler, cProfile.Profile):
        statistics_ = pstats.Stats(probe.profiler)
        own = sorted(statistics_.stats.items(), key=lambda item: -item[1][2])[:30]  # type: ignore[attr-defined]
        result["python_functions"] = {
            f"{Path(file).name}:{line} {name}": {
                "own_seconds_per_step": entry[2] / steps,
                "calls_per_step": entry[1] / steps,
            }
            for (file, line, name), entry in own
        }
    elif probe.profiler is not None:
        by_category: dict[str, float] = {}
        operators: dict[str, float] = {}
        for event in probe.profiler.key_averages():
            seconds = event.self_cpu_time_total / 1e6 / steps
            by_category[category_of(event.key)] = by_category.get(category_of(event.key), 0.0) + seconds
            operators[event.key] = seconds
        wall = sum(phase["step"] for phase in result["phases"]) / steps
        by_category[UNACCOUNTED] = wall - sum(by_category.values())
        result["profile"] = {
            "step_wall": wall,
            "by_category": by_category,
            "top_operators": dict(sorted(operators.items(), key=lambda item: -item[1])[:25]),
        }
    return result


# ------------------------------------------------------------------------------------------------------ orchestrator
def _run(label: str, strategy: str, init_args: dict[str, Any], arguments: argparse.Namespace, profiled: bool) -> Any:
    with tempfile.TemporaryDirectory(prefix=f"phases_{label}_") as scratch:
        spec_path = Path(scratch) / "spec.json"
        spec = {
            "strategy": strategy,
            "init_args": init_args,
            "warmup": arguments.warmup,
            "steps": arguments.steps,
            "profiled": profiled,
            "python_profile": arguments.python_profile,
        }
        spec_path.write_text(json.dumps(spec))
        launch_ranks("benchmarks.peers.phases", ["--rank-spec", str(spec_path)], 2, Path(scratch), 900)
        ranks = []
        for rank in (0, 1):
            lines = (Path(scratch) / f"rank{rank}.log").read_text().splitlines()
            ranks.append(json.loads(next(line for line in lines if line.startswith("RESULT "))[7:]))
    return ranks


def _slowest_rank_medians(ranks: list[dict[str, Any]]) -> dict[str, float]:
    names = ranks[0]["phases"][0].keys()
    return {
        name: statistics.median(
            max(pair) for pair in zip(*([step[name] for step in r["phases"]] for r in ranks), strict=True)
        )
        for name in names
    }


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if arguments.rank_spec is not None:  # a rank
        result = rank_main(json.loads(arguments.rank_spec.read_text()))
        if os.environ.get("RANK") is not None:
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    configurations = [_parse_configuration(text) for text in (arguments.configuration or DEFAULT_CONFIGURATIONS)]
    report: dict[str, Any] = {"git": git_revision(REPOSITORY_ROOT), "arguments": vars(arguments), "results": {}}
    report["arguments"] = {key: str(value) for key, value in vars(arguments).items()}
    for label, strategy, init_args in configurations:
        timed = _run(label, strategy, init_args, arguments, profiled=False)
        profiled = _run(label, strategy, init_args, arguments, profiled=True)
        phases = _slowest_rank_medians(timed)
        entry = {"phases": phases, "profile_per_rank": [rank.get("profile") for rank in profiled]}
        if arguments.python_profile:
            entry["python_functions_per_rank"] = [rank.get("python_functions") for rank in profiled]
            for name, figures in list(profiled[0]["python_functions"].items())[:15]:
                print(
                    f"  {figures['own_seconds_per_step'] * 1e3:7.1f} ms {figures['calls_per_step']:7.0f} calls  {name}"
                )
        report["results"][label] = entry
        print(f"{label}: " + ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in phases.items()))
        pools = [rank.get("buffer_pool") for rank in timed]
        if pools[0] is not None:
            print(f"  host buffers reused / allocated per rank: {pools}")
        for rank, profile in enumerate(entry["profile_per_rank"]):
            if profile is None:
                continue
            shares = ", ".join(f"{name} {seconds * 1e3:.0f}" for name, seconds in profile["by_category"].items())
            print(f"  rank {rank} profiled step {profile['step_wall'] * 1e3:.0f} ms: {shares} ms")
        sys.stdout.flush()
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
