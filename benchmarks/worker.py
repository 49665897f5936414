"""The body of one benchmark rank: ``python -m benchmarks.worker --spec run.json``.

The orchestrator (``benchmarks.run``) starts one of these per rank with ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set, so Lightning launches nothing and the ranks join through the
environment. Each rank trains the GPT for ``warmup_steps + measured_steps`` steps and writes
``rank<RANK>.json`` into the run's result directory: its step times, peak RSS, model-state bytes and the CPU
time of the measured window (for the load check of ``benchmarks.machine``). Gemini ranks also record their engine's
``memory_report()`` and the peak of their gathered chunks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import resource
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy, StrategyRegistry
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

import lightning_colossal  # noqa: F401  (registers the colossal_* strategy names)
from benchmarks.configuration import DEEPSPEED_STAGES, RunSpec
from benchmarks.machine import read_cpu_times
from benchmarks.measure import gemini_model_state_bytes, gradient_bytes, optimizer_state_bytes, parameter_bytes
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.gemini import GeminiEngine, GeminiMemoryReport
from lightning_colossal.strategies import GeminiStrategy, HybridParallelStrategy


class BenchmarkModule(LightningModule):
    """Next-token training of the GPT with plain AdamW: no scheduler and no logging, so nothing but the
    strategy differs between configurations and nothing synchronises outside the strategy."""

    def __init__(self, model_config: GPTConfig, learning_rate: float) -> None:
        super().__init__()
        self.model_config = model_config
        self.learning_rate = learning_rate
        self.model: GPT | None = None
        # Set by configure_model when the logits come out vocabulary-sharded (Lightning's tensor-parallel peer).
        self.loss_parallel = False

    def configure_model(self) -> None:
        # Built here so sharded strategies can build it inside their own init contexts; idempotent.
        if self.model is not None:
            return
        self.model = GPT(self.model_config)
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            # Lightning's ModelParallelStrategy leaves parallelisation to the user. Its mesh says which: tensor
            # parallelism over the tensor_parallel axis when that has more than one rank, FSDP2 over the
            # data_parallel axis when that does (or when nothing else is asked: the FSDP2 peer at one rank).
            tensor_parallel_size = self.device_mesh["tensor_parallel"].size()
            data_parallel_size = self.device_mesh["data_parallel"].size()
            if tensor_parallel_size > 1:
                apply_tensor_parallel(self.model, self.device_mesh["tensor_parallel"])
                self.loss_parallel = True
            if data_parallel_size > 1 or tensor_parallel_size == 1:
                # FSDP2 on every block, then the model: the units colossal_fsdp picks by itself.
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for block in self.model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(self.model, mesh=mesh)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        assert self.model is not None, "configure_model() runs before training"
        input_ids, targets = batch
        logits = self.model(input_ids)
        with self._loss_context():
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        # A loss computed from vocabulary-sharded logits is a replicated DTensor; Lightning gets the plain local value
        # (equal on every rank), as colossal_hybrid hands it over.
        return loss.to_local() if isinstance(loss, DTensor) else loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        # loss_parallel's cross-entropy has a DTensor backward that must run inside the same context.
        with self._loss_context():
            loss.backward(*args, **kwargs)

    def _loss_context(self) -> Any:
        return loss_parallel() if self.loss_parallel else nullcontext()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.learning_rate)


def apply_tensor_parallel(model: GPT, mesh: DeviceMesh) -> None:
    """torch's standard tensor parallelism on the GPT over ``mesh``, the plan torchtitan uses for its Llama.

    Megatron's split of every block: ``attn.qkv`` and ``mlp.fc`` column-wise, ``attn.proj`` and ``mlp.proj``
    row-wise (the GPT's fused qkv is head-major and its attention infers the local head count from the qkv width, so
    a column shard holds whole heads). The token embedding is split row-wise (by vocabulary, outputs all-reduced) and
    the LM head column-wise with vocabulary-sharded logits left as a DTensor, for ``loss_parallel``'s cross-entropy:
    the same vocabulary-parallel embedding, head and loss colossal_hybrid uses, so neither side computes a whole
    8192-wide head on every rank. Norms and the position embedding stay whole on every rank, as in colossal_hybrid.
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {
        # Token ids are the same on every rank (Replicate); RowwiseParallel's default input layout, Shard(-1), is
        # for the activations a row-parallel linear receives.
        "token_embedding": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for index in range(len(model.blocks)):
        plan[f"blocks.{index}.attn.qkv"] = ColwiseParallel()
        plan[f"blocks.{index}.attn.proj"] = RowwiseParallel()
        plan[f"blocks.{index}.mlp.fc"] = ColwiseParallel()
        plan[f"blocks.{index}.mlp.proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


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

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        engine = _gemini_engine(trainer)
        if engine is not None and batch_idx == 0 and self.warmup_steps > 0 and not _ENGINE_TRACKS_PEAK:
            self._gathered_sampler = GatheredPeakSampler(engine, pl_module)
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
        """Start the CPU-time window of the measured steps (the load check of ``benchmarks.machine``)."""
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


def build_strategy(name: str, init_args: dict[str, Any]) -> Strategy | str:
    """The strategy of a configuration: a registered name, with ``init_args`` merged over its own, or
    ``module:Class(**init_args)``.

    Raises:
        ValueError: the name is neither registered nor importable.
    """
    if ":" in name:
        module_name, _, class_name = name.partition(":")
        strategy_class = getattr(importlib.import_module(module_name), class_name)
        return strategy_class(**init_args)
    if name not in StrategyRegistry:
        available = ", ".join(sorted(StrategyRegistry.keys()))
        raise ValueError(f"Strategy {name!r} is not registered; registered names: {available}; or use module:Class.")
    if not init_args:
        return name  # let the Trainer resolve it exactly as a user's Trainer(strategy=name) would
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **init_args})


def tensor_parallel_parameter_count(trainer: Trainer, module: LightningModule) -> int:
    """Ψₜ: parameters split by tensor parallelism, counted whole (the rest is held whole on every rank).

    Lightning's tensor-parallel peer holds them as DTensors sharded over its ``tensor_parallel`` mesh axis (FSDP2's
    shards, over ``data_parallel``, are not counted); colossal_hybrid holds plain local shards and its engine's plan
    records which parameters were split and their whole shapes.
    """
    strategy = trainer.strategy
    if isinstance(strategy, HybridParallelStrategy):
        engine = strategy.engine
        if engine is None or engine.context.tp_size == 1:
            return 0
        return sum(
            math.prod(engine.names.full_shapes[id(parameter)])
            for parameter in module.parameters()
            if id(parameter) in engine.plan.placements
        )
    count = 0
    for parameter in module.parameters():
        if not isinstance(parameter, DTensor):
            continue
        names = parameter.device_mesh.mesh_dim_names or ()
        if any(
            isinstance(placement, Shard) and names[dim] == "tensor_parallel"
            for dim, placement in enumerate(parameter.placements)
        ):
            count += parameter.numel()
    return count


def parameter_count(model_config: GPTConfig) -> int:
    """Ψ: parameters of the whole model, from a copy on the meta device (no memory, no RNG draw)."""
    with torch.device("meta"):
        return GPT(model_config).num_parameters()


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
    trainer = Trainer(
        accelerator="cpu",
        devices=spec.world_size,
        strategy=build_strategy(spec.strategy, spec.init_args),
        max_steps=spec.total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[probe],
    )
    trainer.fit(BenchmarkModule(model_config, spec.learning_rate), train_dataloaders=loader)
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
        "strategy_class": strategy_class,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="run spec JSON written by benchmarks.run")
    arguments = parser.parse_args(argv)
    spec = RunSpec.read(arguments.spec)
    rank = int(os.environ["RANK"])
    if spec.strategy in DEEPSPEED_STAGES:
        # Lightning's DeepSpeedStrategy refuses CPU accelerators, so DeepSpeed's own engine trains these runs; imported
        # only here, so the other configurations run without DeepSpeed installed.
        from benchmarks.deepspeed_worker import run_deepspeed

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
