"""The body of one benchmark rank: ``python -m benchmarks.peers.worker --spec run.json``.

The orchestrator (``benchmarks.peers``) starts one of these per rank with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, so Lightning launches nothing and the ranks join through the
environment. Each rank trains the GPT for ``warmup_steps + measured_steps`` steps and writes
``rank<RANK>.json`` into the run's result directory: its step times, peak RSS, model-state bytes and the CPU
time of the measured window (for the load check of ``benchmarks/harness/machine.py``). Gemini ranks also record their engine's
``memory_report()`` and the peak of their gathered chunks.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

import lightning_colossal  # noqa: F401  (registers the colossal_* strategy names)
from benchmarks.harness.machine import read_cpu_times
from benchmarks.harness.measure import gemini_model_state_bytes, gradient_bytes, optimizer_state_bytes, parameter_bytes
from benchmarks.harness.workload import (
    BenchmarkModule,
    build_strategy,
    parameter_count,
    tensor_parallel_parameter_count,
    train_on_cpu,
)
from benchmarks.peers.configuration import DEEPSPEED_STAGES, RunSpec
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPTConfig
from lightning_colossal.gemini import GeminiEngine, GeminiMemoryReport
from lightning_colossal.strategies import GeminiStrategy

#: When this module's imports finished (torch, Lightning, the project): a phase of the whole run a user waits for.
_IMPORTS_DONE = time.time()


class BenchmarkProbe(Callback):
    """Times every training step and measures model-state bytes at the end of training.

    A step is ``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, gradient communication and
    the optimizer step. Gradient bytes are read in ``on_before_optimizer_step`` of the last step, when the
    gradients of the last backward (after any reduction or sharding) are all present; parameter and optimizer
    bytes at ``on_train_end``, before the strategy tears anything down.

    Under Gemini the parameters are empty placeholders between uses, so the model-state bytes come from the engine's
    ``memory_report()`` at ``on_train_end`` instead (see ``gemini_model_state_bytes``); the tensor walk is kept
    beside it as a cross-check. The peak of the gathered chunks is the engine's own figure when its report has one;
    otherwise it is sampled during the warm-up steps only, so the sampling costs the measured steps nothing
    (``GatheredPeakSampler``).
    """

    def __init__(self, warmup_steps: int, total_steps: int) -> None:
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.step_times: list[float] = []
        self.warmup_step_times: list[float] = []
        self.losses: list[float] = []
        self.bytes: dict[str, Any] = {}
        self.window: dict[str, float] = {}
        self._step_start = 0.0
        self._gathered_sampler: GatheredPeakSampler | None = None
        self.tensor_parallel_parameter_count = 0
        #: Wall-clock moments (``time.time()``) of the run's phases, for the setup and teardown a user also waits for.
        self.moments: dict[str, float] = {}

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.moments.setdefault("setup_hook", time.time())  # the process group exists; the strategy set up nothing

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.moments["fit_start"] = time.time()  # the strategy wrapped the model and optimizers

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.moments["fit_end"] = time.time()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        engine = _gemini_engine(trainer)
        if engine is not None and batch_idx == 0 and self.warmup_steps > 0 and not _ENGINE_TRACKS_PEAK:
            self._gathered_sampler = GatheredPeakSampler(engine, pl_module)
        if batch_idx == 0:
            self.moments["first_batch"] = time.time()
        if batch_idx == self.warmup_steps:
            if self._gathered_sampler is not None:
                self._gathered_sampler.remove()  # before the window opens: measured steps run without the hooks
            self.open_window()
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        elapsed = time.perf_counter() - self._step_start
        (self.step_times if batch_idx >= self.warmup_steps else self.warmup_step_times).append(elapsed)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        if batch_idx == self.total_steps - 1:
            self.close_window()
            self.moments["last_batch_end"] = time.time()

    def on_before_optimizer_step(
        self, trainer: Trainer, pl_module: LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # global_step counts finished optimizer steps, so this is the last step's gradient.
        if trainer.global_step == self.total_steps - 1:
            # Sharded engines keep reduced gradients on the optimizer's own tensors (ZeRO-2: this rank's rows);
            # shared storage is counted once, so views of the same buffers are not double-counted.
            stepped = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            self.bytes["gradients"] = gradient_bytes([*pl_module.parameters(), *stepped])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        state_total, state_by_key = optimizer_state_bytes(trainer.optimizers)
        self.bytes["parameters"] = parameter_bytes(pl_module.parameters())
        self.bytes["optimizer_state"] = state_total
        self.bytes["optimizer_state_by_key"] = state_by_key
        self.bytes["parameter_tensors"] = sum(1 for _ in pl_module.parameters())
        self.tensor_parallel_parameter_count = tensor_parallel_parameter_count(trainer, pl_module)
        engine = _gemini_engine(trainer)
        if engine is not None:
            self._use_memory_report(engine)

    def _use_memory_report(self, engine: GeminiEngine) -> None:
        """Replace the tensor walk's figures by the engine's own count of its chunk tensors."""
        report = engine.memory_report()
        memory_report = {**report._asdict(), "chunks": report.chunks._asdict()}
        from_report = gemini_model_state_bytes(memory_report)
        # The walk finds empty placeholders for parameters, but its gradient and optimizer-state figures count the
        # same tensors as the report: kept so the JSON shows whether the two counts agree.
        self.bytes["tensor_walk"] = {key: self.bytes.get(key) for key in ("parameters", "gradients", "optimizer_state")}
        self.bytes["parameters"] = from_report["parameters"]
        self.bytes["gradients"] = from_report["gradients"]
        self.bytes["optimizer_state"] = from_report["optimizer_state"]
        self.bytes["memory_report"] = memory_report
        sampler = self._gathered_sampler
        if memory_report.get(_ENGINE_PEAK_FIELD) is not None:
            self.bytes["gathered_peak"] = memory_report[_ENGINE_PEAK_FIELD]
            self.bytes["gathered_peak_source"] = "engine"
        elif sampler is not None and sampler.samples:
            self.bytes["gathered_peak"] = sampler.peak
            self.bytes["gathered_peak_source"] = "sampled in the warm-up steps"
        else:
            self.bytes["gathered_peak"] = None
            self.bytes["gathered_peak_source"] = None

    def open_window(self) -> None:
        """Start the CPU-time window of the measured steps (the load check of ``benchmarks/harness/machine.py``)."""
        cpu_times = read_cpu_times()
        self.window["wall_start"] = time.perf_counter()
        self.window["process_cpu_start"] = time.process_time()
        self.window["system_busy_start"] = cpu_times.busy_seconds if cpu_times else float("nan")
        self.window["system_steal_start"] = cpu_times.steal_seconds if cpu_times else float("nan")

    def close_window(self) -> None:
        """End the window opened by ``open_window``: its wall, own CPU, machine busy and steal seconds."""
        cpu_times = read_cpu_times()
        self.window["wall_seconds"] = time.perf_counter() - self.window.pop("wall_start")
        self.window["process_cpu_seconds"] = time.process_time() - self.window.pop("process_cpu_start")
        busy_start = self.window.pop("system_busy_start")
        steal_start = self.window.pop("system_steal_start")
        self.window["system_busy_seconds"] = cpu_times.busy_seconds - busy_start if cpu_times else float("nan")
        self.window["system_steal_seconds"] = cpu_times.steal_seconds - steal_start if cpu_times else float("nan")


# An engine whose report carries its own running peak of gathered chunks and full gradients counts every allocation
# (in-flight reductions too); with it, the harness needs no hooks of its own. Older reports lack the field.
_ENGINE_PEAK_FIELD = "peak_working_set_bytes"
_ENGINE_TRACKS_PEAK = _ENGINE_PEAK_FIELD in GeminiMemoryReport._fields


def _gemini_engine(trainer: Trainer) -> GeminiEngine | None:
    strategy = trainer.strategy
    return strategy.engine if isinstance(strategy, GeminiStrategy) else None


class GatheredPeakSampler:
    """The largest ``memory_report().chunks.gathered`` (whole chunks plus their full gradients) seen while hooked.

    Samples after the engine's own hooks, where chunks are gathered and reduced: after every module's forward
    pre-hook (the engine gathers there) and after every parameter's post-accumulate-grad hook (the engine fills a
    chunk's full gradient there, then reduces and releases the chunk once its gradients are complete). Hooks
    registered later run later, so each sample sees the engine's work done. A sample point falls between the
    engine's steps, not inside them, so the figure is a lower bound on the true peak; in-flight reduction buffers the
    report does not count are not in it either.
    """

    def __init__(self, engine: GeminiEngine, module: LightningModule) -> None:
        self.engine = engine
        self.peak = 0
        self.samples = 0
        self._handles: list[RemovableHandle] = [
            submodule.register_forward_pre_hook(lambda *_: self.sample()) for submodule in module.modules()
        ]
        self._handles.extend(
            parameter.register_post_accumulate_grad_hook(lambda _: self.sample())
            for parameter in module.parameters()
            if parameter.requires_grad
        )

    def sample(self) -> None:
        self.peak = max(self.peak, self.engine.memory_report().chunks.gathered)
        self.samples += 1

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def run(spec: RunSpec, rank: int) -> dict[str, Any]:
    """Train one run on this rank and return its measurements."""
    model_config = GPTConfig(**spec.model_config)
    torch.manual_seed(spec.seed)  # the same initial weights on every rank and in every configuration
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=spec.sequence_length,
        num_samples=spec.batch_size_per_rank * spec.world_size * spec.total_steps,
        seed=spec.seed,
    )
    # Every configuration sees the same batches in the same order: the loader is not shuffled, and Lightning replaces
    # its sampler by a DistributedSampler that shuffles training data with a fixed seed (PL_GLOBAL_SEED, else 0).
    loader = DataLoader(dataset, batch_size=spec.batch_size_per_rank, shuffle=False, drop_last=True)
    probe = BenchmarkProbe(spec.warmup_steps, spec.total_steps)
    probe.moments["process_start"] = _process_start_time()
    probe.moments["imports_done"] = _IMPORTS_DONE
    probe.moments["before_trainer"] = time.time()  # the data made; ``train_on_cpu`` builds the Trainer, then fits
    trainer = train_on_cpu(
        build_strategy(spec.strategy, spec.init_args),
        spec.world_size,
        spec.total_steps,
        BenchmarkModule(model_config, spec.learning_rate),
        loader,
        [probe],
    )
    probe.moments["fit_returned"] = time.time()
    if len(probe.step_times) != spec.measured_steps:
        raise RuntimeError(f"Measured {len(probe.step_times)} steps, expected {spec.measured_steps}.")
    sampler_arguments = getattr(trainer.strategy, "distributed_sampler_kwargs", None) or {}
    return rank_result(
        probe,
        rank,
        model_config,
        # Ranks that read different batches; tensor- and sequence-parallel peers share one.
        data_parallel_size=int(sampler_arguments.get("num_replicas", spec.world_size)),
        strategy_class=type(trainer.strategy).__qualname__,
    )


def _process_start_time() -> float:
    """This process's start as a ``time.time()`` moment (Linux: /proc), or NaN where that cannot be read."""
    try:
        ticks_after_boot = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, ValueError, IndexError, StopIteration):
        return float("nan")
    return boot + ticks_after_boot / os.sysconf("SC_CLK_TCK")


def rank_result(
    probe: BenchmarkProbe, rank: int, model_config: GPTConfig, data_parallel_size: int, strategy_class: str
) -> dict[str, Any]:
    """What one rank writes for the orchestrator: its probe's figures, peak RSS and the model's Ψ."""
    return {
        "rank": rank,
        "step_times": probe.step_times,
        "warmup_step_times": probe.warmup_step_times,
        "losses": probe.losses,
        # ru_maxrss is in KiB on Linux.
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "bytes": probe.bytes,
        "parameter_count": parameter_count(model_config),
        "tensor_parallel_parameter_count": probe.tensor_parallel_parameter_count,
        "data_parallel_size": data_parallel_size,
        "window": probe.window,
        "moments": probe.moments,
        "strategy_class": strategy_class,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="run spec JSON written by benchmarks.peers")
    arguments = parser.parse_args(argv)
    spec = RunSpec.read(arguments.spec)
    rank = int(os.environ["RANK"])
    if spec.strategy in DEEPSPEED_STAGES:
        # Lightning's DeepSpeedStrategy refuses CPU accelerators, so DeepSpeed's own engine trains these runs; imported
        # only here, so the other configurations run without DeepSpeed installed.
        from benchmarks.peers.deepspeed_worker import run_deepspeed

        result = run_deepspeed(spec, rank)
    else:
        result = run(spec, rank)
    # Written to a temporary name and renamed, so the orchestrator never reads half a file.
    result_path = Path(spec.result_directory) / f"rank{rank}.json"
    temporary_path = result_path.with_suffix(".json.partial")
    temporary_path.write_text(json.dumps(result))
    temporary_path.rename(result_path)


if __name__ == "__main__":
    main()
