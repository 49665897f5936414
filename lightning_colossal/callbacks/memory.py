"""Per-rank memory of training: model-state bytes by category, process RSS, accelerator memory, Gemini placement.

[Note: what MemoryMonitor counts]
Every ``log_every_n_steps`` optimizer steps, right after the step, each rank measures what it holds itself:

- parameters, gradients and optimizer state, summing local shards only. Gemini ranks are read from their engine's
  ``memory_report()`` (its parameters are empty placeholders between uses), ZeRO ranks (and hybrid ones with ZeRO)
  from theirs (its flat gradient buffers and masters are not the model's ``.grad``), every other strategy by walking the real tensors
  (DTensors by their local shard, shared storage once; ``memory_accounting.py``). These are the categories the
  benchmarks check against the model-state formulas (``benchmarks/measure.py``);
- "other": the process's resident set size and, on CUDA, ``torch.cuda.memory_allocated`` and
  ``max_memory_allocated``;
- on Gemini also the chunk bytes on the compute device vs offloaded, those of gathered chunks, and per chunk where
  its bytes live (kept for ``plot``, not logged).

The ranks' records are exchanged (one ``all_gather_object`` per logging step) so every rank keeps all of them in
``history`` and rank zero's loggers, the only ones that write, get every rank's values under distinct names:
``memory/rank{r}/{key}``. Values are logged with ``trainer.loggers``' ``log_metrics`` as Python ints, not with
``LightningModule.log``, which would round byte counts to float32 and tie the logging to the Trainer's own
``log_every_n_steps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_colossal.callbacks.memory_accounting import (
    gemini_model_state_bytes,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
    process_rss_bytes,
    zero_model_state_bytes,
)
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.zero import ZeroEngine, ZeroMemoryReport

__all__ = ["MODEL_STATE_KEYS", "MemoryMonitor", "measure_memory"]

MODEL_STATE_KEYS = ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes")


def measure_memory(trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
    """This rank's memory now (see the module's Note "what MemoryMonitor counts").

    Returns a flat mapping of ints (``parameters_bytes``, ``gradients_bytes``, ``optimizer_state_bytes``,
    ``rss_bytes``, ``cuda_allocated_bytes`` / ``cuda_max_allocated_bytes`` on CUDA, ``gemini_*`` on Gemini,
    ``disk_bytes`` / ``disk_staging_bytes`` with the disk tier) and, on
    Gemini, ``"chunks"``: per chunk ``(compute_bytes, offload_bytes)``.
    """
    engines = list(getattr(trainer.strategy, "engines", None) or [])
    engine = engines[0] if len(engines) == 1 else None
    data_parallel = getattr(engine, "data_parallel", None)
    if not isinstance(engine, GeminiEngine | ZeroEngine) and isinstance(data_parallel, ZeroEngine):
        engine = data_parallel  # colossal_hybrid with ZeRO: its ZeRO engine holds the gradients and masters
    record: dict[str, Any] = {}
    if len(engines) > 1:
        # ZeRO with one engine per optimizer: what they hold together.
        report = ZeroMemoryReport.combined([each.memory_report() for each in engines])
        state = zero_model_state_bytes(report._asdict())
        if report.disk_bytes:
            record["disk_bytes"] = report.disk_bytes
            record["disk_staging_bytes"] = report.disk_staging_bytes
    elif isinstance(engine, GeminiEngine):
        report = engine.memory_report()
        chunks = report.chunks
        state = gemini_model_state_bytes({**report._asdict(), "chunks": chunks._asdict()})
        record["gemini_compute_bytes"] = chunks.compute
        record["gemini_offload_bytes"] = chunks.offload
        record["gemini_gathered_bytes"] = chunks.gathered
        record["chunks"] = [(chunk.compute, chunk.offload) for chunk in engine.memory_by_chunk()]
    elif isinstance(engine, ZeroEngine):
        state = zero_model_state_bytes(engine.memory_report()._asdict())
    else:
        # The optimizer's own tensors too: an engine may keep reduced gradients on separate masters; shared storage
        # is counted once.
        stepped = [p for optimizer in trainer.optimizers for group in optimizer.param_groups for p in group["params"]]
        state = {
            "parameters": parameter_bytes(pl_module.parameters()),
            "gradients": gradient_bytes([*pl_module.parameters(), *stepped]),
            "optimizer_state": optimizer_state_bytes(trainer.optimizers)[0],
        }
    if isinstance(engine, GeminiEngine | ZeroEngine) and engine.disk_state is not None:
        disk = engine.memory_report()
        record["disk_bytes"] = disk.disk_bytes  # the disk tier's optimizer state (not in the model-state figures)
        record["disk_staging_bytes"] = disk.disk_staging_bytes
    record["parameters_bytes"] = state["parameters"]
    record["gradients_bytes"] = state["gradients"]
    record["optimizer_state_bytes"] = state["optimizer_state"]
    rss = process_rss_bytes()
    if rss is not None:
        record["rss_bytes"] = rss
    device = pl_module.device
    allocated = devices.memory_allocated(device)
    if allocated is not None:
        # Keys named for CUDA since they were first logged; on any compute device they are its allocator's figures.
        record["cuda_allocated_bytes"] = allocated
        record["cuda_max_allocated_bytes"] = devices.max_memory_allocated(device)
    return record


class MemoryMonitor(Callback):
    """Log every rank's memory every ``log_every_n_steps`` optimizer steps as ``memory/rank{r}/{key}`` (bytes).

    Keys: ``parameters_bytes``, ``gradients_bytes``, ``optimizer_state_bytes`` (local shards only), ``rss_bytes``,
    on CUDA ``cuda_allocated_bytes`` and ``cuda_max_allocated_bytes``, on Gemini ``gemini_compute_bytes``,
    ``gemini_offload_bytes`` and ``gemini_gathered_bytes``. See the module's Note "what MemoryMonitor counts".
    Every rank must run the callback (it exchanges the records); ``history`` holds, per logging step, ``{"step",
    "ranks": [record of rank 0, rank 1, ...]}``, and ``plot(path)`` draws it.

    Args:
        log_every_n_steps: Optimizer steps between measurements.
    """

    def __init__(self, log_every_n_steps: int = 10) -> None:
        super().__init__()
        if log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps must be >= 1, got {log_every_n_steps}; pass e.g. 10.")
        self.log_every_n_steps = log_every_n_steps
        self.history: list[dict[str, Any]] = []
        self._last_step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.history = []
        self._last_step = None

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if step == 0 or step % self.log_every_n_steps != 0 or step == self._last_step:
            return  # not a boundary, or a later micro-batch of the same optimizer step
        self._last_step = step
        records = collectives.gather_objects(measure_memory(trainer, pl_module))
        self.history.append({"step": step, "ranks": records})
        metrics = {
            f"memory/rank{rank}/{key}": value
            for rank, record in enumerate(records)
            for key, value in record.items()
            if key != "chunks"
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def plot(self, path: str | Path) -> Path:
        """Write a PNG of memory over steps, one panel per category with a line per rank, and on Gemini a bar of
        where each chunk's bytes live (compute device vs offloaded) at the last measurement, per rank.

        Raises:
            ImportError: matplotlib is not installed.
            ValueError: nothing was measured yet.
        """
        try:
            from matplotlib.figure import Figure
        except ImportError as error:
            raise ImportError("MemoryMonitor.plot needs matplotlib: pip install matplotlib") from error
        if not self.history:
            raise ValueError("MemoryMonitor has no measurements yet; plot after training at least log_every_n_steps.")
        steps = [entry["step"] for entry in self.history]
        panels = [
            ("model state: parameters", "parameters_bytes"),
            ("model state: gradients", "gradients_bytes"),
            ("model state: optimizer state", "optimizer_state_bytes"),
            ("other: process RSS", "rss_bytes"),
            ("other: CUDA allocated", "cuda_allocated_bytes"),
            ("Gemini: chunks on compute device", "gemini_compute_bytes"),
            ("Gemini: chunks offloaded", "gemini_offload_bytes"),
            ("disk tier: optimizer state on disk", "disk_bytes"),
        ]
        last_ranks = self.history[-1]["ranks"]
        panels = [(title, key) for title, key in panels if any(key in record for record in last_ranks)]
        chunk_ranks = [record["chunks"] for record in last_ranks if "chunks" in record]
        rows = len(panels) + (1 if chunk_ranks else 0)
        figure = Figure(figsize=(8, 2.4 * rows), layout="constrained")
        axes = figure.subplots(rows, 1, squeeze=False)[:, 0]
        for axis, (title, key) in zip(axes, panels, strict=False):
            for rank in range(len(last_ranks)):
                values = [entry["ranks"][rank].get(key) for entry in self.history]
                axis.plot(steps, [v / 2**20 if v is not None else float("nan") for v in values], label=f"rank {rank}")
            axis.set_title(title)
            axis.set_ylabel("MiB")
            axis.legend(fontsize="small")
        axes[len(panels) - 1].set_xlabel("optimizer step")
        if chunk_ranks:
            axis = axes[-1]
            width = 0.8 / len(chunk_ranks)
            for rank, chunks in enumerate(chunk_ranks):
                positions = [index + rank * width for index in range(len(chunks))]
                compute = [c / 2**20 for c, _ in chunks]
                offload = [o / 2**20 for _, o in chunks]
                axis.bar(positions, compute, width, label=f"rank {rank}: compute device")
                axis.bar(positions, offload, width, bottom=compute, label=f"rank {rank}: offloaded (CPU)")
            axis.set_title(f"Gemini chunk placement at step {steps[-1]}")
            axis.set_xlabel("chunk")
            axis.set_ylabel("MiB")
            axis.legend(fontsize="small")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path, format="png")
        return path
