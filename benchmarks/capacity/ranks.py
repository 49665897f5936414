"""The body of one capacity-probe rank: ``python -m benchmarks.capacity.ranks --spec probe.json``.

``benchmarks.capacity`` starts one of these per rank (``benchmarks.harness.launch.launch_ranks``: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` set, ``OMP_NUM_THREADS=1``). Each rank trains the GPT of the spec for a few steps
under the spec's strategy and samples, all through those steps, the model-state bytes its engine holds on the
compute device (see ``device_bytes``). It writes ``rank<RANK>.json``: the losses, every sampled figure's maximum
(per step and overall) and the breakdown at the peak; a rank that raised writes the error there before failing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader
from torch.utils.hooks import RemovableHandle

from benchmarks.harness.workload import BenchmarkModule, build_strategy, parameter_count, train_on_cpu
from lightning_colossal.callbacks.memory_accounting import gradient_bytes, optimizer_state_bytes, parameter_bytes
from lightning_colossal.config import AutoPlacement, StaticPlacement
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPTConfig
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.zero import ZeroEngine


def _tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def gemini_device_bytes(engine: GeminiEngine) -> dict[str, int]:
    """The engine's own split: every chunk byte it places on the compute device (shards, gathered chunks, full
    gradients, and masters / gradient shards / optimizer state of chunks whose optimizer is not offloaded), plus the
    parameters kept whole outside chunks (always on the device)."""
    report = engine.memory_report()
    return {
        "total": report.chunks.compute + report.replicated_bytes,
        "chunks_on_device": report.chunks.compute,
        "replicated": report.replicated_bytes,
        "gathered": report.chunks.gathered,
        "offloaded": report.chunks.offload,
        # Host model state as automatic placement's host_memory_budget counts it: the chunk bytes off the compute
        # device. The disk tier's staging buffers come on top; reported apart (disk_staging_bytes).
        "host": report.chunks.offload,
    }


class GeminiBytes:
    """``gemini_device_bytes`` without a whole ``memory_report()`` per sample (which walks every chunk's tensors and
    optimizer state: milliseconds at hundreds of chunks, thousands of times a step). Between refreshes the bytes of a
    chunk's shard, separate master and optimizer state do not change, only where they live (an eviction moves them);
    so a sample adds those cached sizes by the chunks' current locations, and reads the tensors that come and go
    (the gathered chunk and full gradient of the working set, and the gradient shard, made at the chunk's first
    reduction) live. ``refresh`` re-reads every size from the
    engine's own per-chunk report (around each optimizer step, where state is created) and records the largest
    difference between this figure and ``gemini_device_bytes`` seen there (``max_error_bytes``: 0 when they agree).
    """

    def __init__(self, engine: GeminiEngine) -> None:
        self.engine = engine
        self.max_error_bytes = 0
        self.refresh()

    def refresh(self) -> None:
        from lightning_colossal.gemini.chunk import Location

        self._compute = Location.COMPUTE
        self._sizes = []
        for chunk, figures in zip(self.engine.manager.chunks, self.engine.memory_by_chunk(), strict=True):
            # The report's own split: shard bytes at the shard's location, the optimizer side at the masters'.
            self._sizes.append((chunk, figures.shard, figures.master + figures.optimizer_state))
        report = self.engine.memory_report()
        self._replicated = report.replicated_bytes
        exact = gemini_device_bytes(self.engine)
        fast = self.now()
        self.max_error_bytes = max(
            self.max_error_bytes, *(abs(exact[key] - fast[key]) for key in ("total", "gathered", "host"))
        )

    def now(self) -> dict[str, int]:
        compute = offload = working = 0
        for chunk, shard, optimizer_side in self._sizes:
            if chunk.gradient is not None:
                optimizer_side += chunk.gradient.numel() * chunk.gradient.element_size()
            if chunk.full is not None:
                working += chunk.full.numel() * chunk.full.element_size()
            if chunk.full_gradient is not None:
                working += chunk.full_gradient.numel() * chunk.full_gradient.element_size()
            if chunk.shard_location is self._compute:
                compute += shard
            else:
                offload += shard
            if chunk.master_location is self._compute:
                compute += optimizer_side
            else:
                offload += optimizer_side
        on_device = compute + working
        return {
            "total": on_device + self._replicated,
            "chunks_on_device": on_device,
            "replicated": self._replicated,
            "gathered": working,
            "offloaded": offload,
            "host": offload,
        }


def zero_device_bytes(engine: ZeroEngine) -> dict[str, int]:
    """Whole parameters, the persistent gradient accumulator and the pooled communication buckets are on the device;
    masters, their gradient shard and the optimizer state join them unless ``cpu_offload`` put them on the host
    (``ZeroEngine``: ``offload_device``)."""
    report = engine.memory_report()
    parts = {
        "parameters": report.parameter_bytes,
        "gradient_accumulator": engine.reducer.persistent_gradient_bytes(),
        "buckets": report.bucket_bytes,
    }
    offloaded = {
        "masters": report.master_bytes,
        "master_gradients": _tensor_bytes(engine.master_gradient_buffer),
        "optimizer_state": report.optimizer_state_bytes,
    }
    if not engine.config.cpu_offload:
        parts.update(offloaded)
    return {
        "total": sum(parts.values()),
        **parts,
        "offloaded": 0 if not engine.config.cpu_offload else sum(offloaded.values()),
    }


def walked_device_bytes(trainer: Trainer, module: LightningModule) -> dict[str, int]:
    """DDP keeps everything on the device: the real tensors, shared storage once (with ``gradient_as_bucket_view``
    the gradients are DDP's buckets, so the buckets are counted by counting the gradients)."""
    stepped = [
        parameter
        for optimizer in trainer.optimizers
        for group in optimizer.param_groups
        for parameter in group["params"]
    ]
    parts = {
        "parameters": parameter_bytes(module.parameters()),
        "gradients": gradient_bytes([*module.parameters(), *stepped]),
        "optimizer_state": optimizer_state_bytes(trainer.optimizers)[0],
    }
    return {"total": sum(parts.values()), **parts, "offloaded": 0}


def device_bytes(trainer: Trainer, module: LightningModule) -> dict[str, int]:
    """Model-state bytes this rank holds on the compute device now, by the engine's own accounting."""
    engine = getattr(trainer.strategy, "engine", None)
    if isinstance(engine, GeminiEngine):
        return gemini_device_bytes(engine)
    if isinstance(engine, ZeroEngine):
        return zero_device_bytes(engine)
    return walked_device_bytes(trainer, module)


class DeviceBytesProbe(Callback):
    """Samples ``device_bytes`` through every step and keeps the maxima.

    Sample points: after every module's forward pre-hook and forward hook (Gemini gathers before a module runs and
    may release after), after every parameter's post-accumulate-grad hook (gradients arrive and are reduced there),
    before the optimizer step (all gradients present) and after the step (optimizer state grown). The hooks are
    registered after the engine's, so each sample sees the engine's work for that point done. Points between them
    (inside a collective, inside the optimizer's own temporaries) are not sampled: the sampled maximum is a lower
    bound of the true peak. For Gemini the verdict uses a bound from above instead (``peak_device_bytes``).
    """

    def __init__(self) -> None:
        self.peak: dict[str, int] = {"total": 0}
        self.step_peaks: list[int] = []
        self.after_step: list[int] = []
        self.losses: list[float] = []
        self.step_seconds: list[float] = []
        self.samples = 0
        self.host_peak = 0
        self.resident_peak = 0
        self._step_peak = 0
        self._step_start = 0.0
        self._handles: list[RemovableHandle] = []
        self.gemini: GeminiBytes | None = None
        self.working_set_samples = 0
        self._trainer: Trainer | None = None
        self._module: LightningModule | None = None

    def sample(self) -> None:
        assert self._trainer is not None and self._module is not None
        now = self.gemini.now() if self.gemini is not None else device_bytes(self._trainer, self._module)
        self.samples += 1
        # Gemini's bytes outside its working set (shards, and optimizer-side tensors left on the device): they only
        # move in the engine's hooks, which are sampled, so their maximum is seen; see ``peak_device_bytes``.
        self.resident_peak = max(self.resident_peak, now["total"] - now.get("gathered", 0))
        self.host_peak = max(self.host_peak, now.get("host", 0))
        self._step_peak = max(self._step_peak, now["total"])
        if now["total"] > self.peak["total"]:
            self.peak = now

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._trainer, self._module = trainer, pl_module
        engine = getattr(trainer.strategy, "engine", None)
        if isinstance(engine, GeminiEngine):
            self.gemini = GeminiBytes(engine)
            self._sample_at_working_set_growth(engine)
        for submodule in pl_module.modules():
            self._handles.append(submodule.register_forward_pre_hook(lambda *_: self.sample()))
            self._handles.append(submodule.register_forward_hook(lambda *_: self.sample()))
        for parameter in pl_module.parameters():
            if parameter.requires_grad:
                self._handles.append(parameter.register_post_accumulate_grad_hook(lambda _: self.sample()))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_peak = 0
        self._step_start = time.perf_counter()

    def _sample_at_working_set_growth(self, engine: GeminiEngine) -> None:
        """Sample whenever Gemini's working set grows (a chunk gathered, a full gradient allocated: every such change
        goes through ``ChunkManager._count_working_set``), besides the module and gradient hooks: the device bytes
        only grow there or in the engine's hooks (a shard moved onto the device), so the sampled maximum is the peak
        of the engine's own figure, not a lower bound of it."""
        manager = engine.manager
        count = manager._count_working_set

        def counted(delta: int) -> None:
            count(delta)
            if delta > 0:
                self.working_set_samples += 1
                self.sample()

        manager._count_working_set = counted  # type: ignore[method-assign]

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        if self.gemini is not None:
            self.gemini.refresh()
        self.sample()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.gemini is not None:
            self.gemini.refresh()
        self.sample()
        self.after_step.append(device_bytes(trainer, pl_module)["total"])
        self.step_peaks.append(self._step_peak)
        self.step_seconds.append(time.perf_counter() - self._step_start)
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def gemini_extras(trainer: Trainer) -> dict[str, Any]:
    """Gemini's own figures: its running peak of gathered chunks + full gradients (exact, every allocation), the
    chunks automatic placement evicted, and the activations its tracer saw (what auto placement budgets for them)."""
    engine = getattr(trainer.strategy, "engine", None)
    if not isinstance(engine, GeminiEngine):
        return {}
    report = engine.memory_report()
    state = engine.disk_state
    return {
        "disk_bytes": report.disk_bytes,
        "disk_staging_bytes": report.disk_staging_bytes,
        "disk_bytes_read": 0 if state is None else state.bytes_read,
        "disk_bytes_written": 0 if state is None else state.bytes_written,
        "peak_working_set_bytes": report.peak_working_set_bytes,
        "evictions": report.evictions,
        "traced_activation_peak_bytes": engine.tracer.peak_non_model_bytes,
        "num_chunks": report.num_chunks,
        "chunk_numel": report.chunk_numel,
    }


def strategy_arguments(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec's constructor arguments, with a JSON ``placement`` (``{"kind": "auto"|"static", ...}``) made into
    the Gemini placement object it describes (JSON cannot carry the object itself)."""
    arguments = dict(spec["init_args"])
    placement = arguments.pop("placement", None)
    if placement is not None:
        fields = {key: value for key, value in placement.items() if key != "kind"}
        arguments["placement"] = AutoPlacement(**fields) if placement["kind"] == "auto" else StaticPlacement(**fields)
    return arguments


def train(spec: dict[str, Any], probe: DeviceBytesProbe) -> Trainer:
    """Train the spec's GPT for ``spec["steps"]`` steps under its strategy, with ``probe`` sampling."""
    model_config = GPTConfig(**spec["model_config"])
    torch.manual_seed(spec["seed"])
    steps, batch, world_size = spec["steps"], spec["batch_size_per_rank"], spec["world_size"]
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=spec["sequence_length"],
        num_samples=batch * world_size * steps,
        seed=spec["seed"],
    )
    loader = DataLoader(dataset, batch_size=batch, shuffle=False, drop_last=True)
    trainer = train_on_cpu(
        build_strategy(spec["strategy"], strategy_arguments(spec)),
        world_size,
        steps,
        BenchmarkModule(
            model_config,
            spec["learning_rate"],
            activation_checkpointing=spec.get("activation_checkpointing", False),
            meta_init=spec.get("meta_init", False),
        ),
        loader,
        [probe],
        precision=spec.get("precision", "32-true"),
    )
    return trainer


def peak_device_bytes(probe: DeviceBytesProbe, extras: dict[str, Any], rule: str = "bound") -> dict[str, Any]:
    """The peak the verdict uses. DDP and ZeRO have no peak figure of their own; theirs is the sampled maximum. For
    Gemini, ``rule``:

    - ``"bound"``: raised to a bound that is never below the true peak: the most bytes held outside the working set
      plus the engine's exact running peak of its working set (gathered chunks and full gradients, every allocation
      counted). The two maxima need not coincide: when automatic placement fills the device with shards while the
      working set is small and gathers large chunks later, the bound can exceed B while the device never held B;
    - ``"events"``: the sampled maximum, which for Gemini includes a sample at every growth of the working set
      (``DeviceBytesProbe._sample_at_working_set_growth``): the peak of the engine's own figure.

    Both figures are kept whichever rule decides."""
    sampled = probe.peak["total"]
    if "peak_working_set_bytes" not in extras:
        return {"peak_device_bytes": sampled, "peak_source": "sampled"}
    bound = probe.resident_peak + extras["peak_working_set_bytes"]
    if rule == "events":
        peak, source = sampled, "sampled at every hook and working-set growth"
    else:
        peak, source = max(sampled, bound), "bound" if bound > sampled else "sampled"
    return {
        "peak_device_bytes": peak,
        "peak_source": source,
        "sampled_peak_device_bytes": sampled,
        "bound_device_bytes": bound,
        "resident_outside_working_set_peak_bytes": probe.resident_peak,
        "working_set_samples": probe.working_set_samples,
        "fast_accounting_max_error_bytes": None if probe.gemini is None else probe.gemini.max_error_bytes,
    }


def peak_rss_bytes() -> int:
    """This process's peak resident set (``getrusage``): every byte it ever held in RAM at once, imports included."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def result_of(
    spec: dict[str, Any], probe: DeviceBytesProbe, trainer: Trainer | None, error: str | None
) -> dict[str, Any]:
    extras = gemini_extras(trainer) if trainer is not None else {}
    return {
        "rank": int(os.environ["RANK"]),
        "error": error,
        "parameter_count": parameter_count(GPTConfig(**spec["model_config"])),
        "steps_done": len(probe.losses),
        "losses": probe.losses,
        "finite": all(math.isfinite(loss) for loss in probe.losses),
        **peak_device_bytes(probe, extras, spec.get("peak_rule", "bound")),
        "peak_breakdown": probe.peak,
        "peak_host_bytes": probe.host_peak,
        "peak_rss_bytes": peak_rss_bytes(),
        "step_peak_device_bytes": probe.step_peaks,
        "after_step_device_bytes": probe.after_step,
        "step_seconds": probe.step_seconds,
        "samples": probe.samples,
        **extras,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="probe spec JSON written by benchmarks.capacity")
    spec_path = parser.parse_args(argv).spec
    spec = json.loads(spec_path.read_text())
    probe = DeviceBytesProbe()
    trainer, error = None, None
    try:
        trainer = train(spec, probe)
    except Exception as exception:  # noqa: BLE001 (recorded for the orchestrator, then re-raised)
        error = f"{type(exception).__name__}: {exception}"
        traceback.print_exc()
    # Written to a temporary name and renamed, so the orchestrator never reads half a file.
    result_path = spec_path.parent / f"rank{os.environ['RANK']}.json"
    temporary_path = result_path.with_suffix(".json.partial")
    temporary_path.write_text(json.dumps(result_of(spec, probe, trainer, error)))
    temporary_path.rename(result_path)
    if error is not None:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
