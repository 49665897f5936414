"""MemoryMonitor on 2 CPU ranks: the logged model-state bytes equal the per-rank formula exactly, per strategy, and
``plot`` writes a PNG (with Gemini's chunk-placement bar)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.loggers.logger import Logger

from lightning_colossal.callbacks import MemoryMonitor
from tests.distributed.oracle import new_module, quiet_trainer
from tests.distributed.test_zero_memory import owned_numel

FP32 = 4
STEP_SCALAR = 4  # AdamW's "step": a 0-dim float32 tensor per parameter tensor
STEPS = 2


class RecordingLogger(Logger):
    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int | None, dict[str, Any]]] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


def monitor_body(strategy: str, plot_path: str) -> dict[str, Any]:
    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    module = new_module()
    monitor, logger = MemoryMonitor(log_every_n_steps=1), RecordingLogger()
    trainer = quiet_trainer(
        strategy=strategy, devices=world_size, max_steps=STEPS, callbacks=[monitor], logger=logger, log_every_n_steps=1
    )
    trainer.fit(module)
    shapes = [tuple(parameter.shape) for parameter in new_module().parameters()]
    written = monitor.plot(plot_path) if rank == 0 else None
    return {
        "psi": sum(torch.Size(shape).numel() for shape in shapes),
        "owned": sum(owned_numel(shape, world_size, rank) for shape in shapes),
        "tensors": len(shapes),
        "history": monitor.history,
        "logged": [(step, metrics) for step, metrics in logger.logged if any(k.startswith("memory/") for k in metrics)],
        "png_bytes": written.stat().st_size if written is not None else None,
        "png_header": written.read_bytes()[:8] if written is not None else None,
    }


def _expected(strategy: str, result: dict[str, Any]) -> tuple[int, int, int]:
    psi, owned, steps = result["psi"], result["owned"], STEP_SCALAR * result["tensors"]
    if strategy == "colossal_ddp":  # 16Ψ: 4 / 4 / 8
        return FP32 * psi, FP32 * psi, 2 * FP32 * psi + steps
    if strategy == "colossal_zero2":  # 4Ψ + 12Ψ/N: whole fp32 parameters, own rows of gradients and moments
        return FP32 * psi, FP32 * owned, 2 * FP32 * owned + steps
    # ZeRO-3 (Gemini in every placement on CPU: the masters alias the shards; FSDP2): 16Ψ/N of own rows.
    return FP32 * owned, FP32 * owned, 2 * FP32 * owned + steps


@pytest.mark.parametrize(
    "strategy", ["colossal_ddp", "colossal_zero2", "colossal_gemini", "colossal_gemini_offload", "colossal_fsdp"]
)
def test_logged_model_state_bytes_follow_the_formula(rank_pool_2, tmp_path, strategy):
    plot_path = tmp_path / "memory.png"
    results = rank_pool_2.run(monitor_body, strategy, str(plot_path))
    history = results[0]["history"]
    assert [entry["step"] for entry in history] == list(range(1, STEPS + 1))
    for result in results:
        assert result["history"] == history, "every rank keeps every rank's records"
    logged = results[0]["logged"]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))
    for rank, result in enumerate(results):
        parameters, gradients, optimizer_state = _expected(strategy, result)
        for entry, (_, metrics) in zip(history, logged, strict=True):
            record = entry["ranks"][rank]
            measured = (record["parameters_bytes"], record["gradients_bytes"], record["optimizer_state_bytes"])
            assert measured == (parameters, gradients, optimizer_state), (strategy, rank, record, result)
            assert record["rss_bytes"] > 10 * 2**20
            for key in ("parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "rss_bytes"):
                assert metrics[f"memory/rank{rank}/{key}"] == record[key]
                assert isinstance(metrics[f"memory/rank{rank}/{key}"], int), "exact bytes, not float32"
            if strategy.startswith("colossal_gemini"):
                chunk_compute = sum(compute for compute, _ in record["chunks"])
                chunk_offload = sum(offload for _, offload in record["chunks"])
                assert (chunk_compute, chunk_offload) == (
                    record["gemini_compute_bytes"],
                    record["gemini_offload_bytes"],
                )
                if strategy == "colossal_gemini":
                    assert record["gemini_offload_bytes"] == 0
                else:  # only the working shards stay on the compute device
                    assert record["gemini_compute_bytes"] == parameters
                    assert record["gemini_offload_bytes"] == gradients + optimizer_state
            else:
                assert "gemini_compute_bytes" not in record
    # Together the ranks hold each element once (sharded modes) or each rank holds all (replicated ones).
    assert sum(result["owned"] for result in results) == results[0]["psi"]
    assert results[0]["png_header"] == b"\x89PNG\r\n\x1a\n"
    assert results[0]["png_bytes"] > 1000


def test_plot_without_measurements_says_so():
    with pytest.raises(ValueError, match="no measurements yet"):
        MemoryMonitor().plot("unused.png")
    with pytest.raises(ValueError, match="log_every_n_steps must be >= 1"):
        MemoryMonitor(log_every_n_steps=0)
