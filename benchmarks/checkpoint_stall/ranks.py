"""The body of one checkpoint-stall rank: ``python -m benchmarks.checkpoint_stall.ranks --spec run.json``.

``benchmarks.checkpoint_stall`` starts one of these per rank (``benchmarks.harness.launch.launch_ranks``). Each rank
trains the spec's GPT under ``colossal_zero2``: ``warmup`` steps, then intervals of ``interval`` steps, one per
mode in each one in each mode of the cycle's order (the spec's, the same on every rank):

- ``none``: no save;
- ``sync``: ``trainer.save_checkpoint`` at the interval's start with ``strategy.async_checkpoint = False``;
- ``async``: the same with ``async_checkpoint = True``; at the interval's end the rank waits for the background save
  (``checkpoint/async_save.py``), so whatever of the write did not overlap with the interval's steps counts in it.
  Its shard files are written by the writer process (``checkpoint/writer_process.py``);
- ``async_thread``: the same, with the shard files written on the background thread as before the writer process
  existed (its ``start`` answers ``None`` for that save), for a comparison in the same run.

An interval's time runs from its start (before the save call) to the end of its last step (after that wait). Every
save goes into the same path, as ``ModelCheckpoint(save_last=True)`` saves. The rank writes ``rank<RANK>.json``:
every interval's mode and seconds, the time each ``save_checkpoint`` call blocked, each background write's duration
and each end-of-interval wait, and the CPU-time window of the measured steps for the load check.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils.data import DataLoader

from benchmarks.harness.machine import read_cpu_times
from benchmarks.harness.workload import BenchmarkModule, build_strategy, parameter_count, train_on_cpu
from lightning_colossal.checkpoint import async_save, sharded, writer_process
from lightning_colossal.checkpoint.huggingface import describe_huggingface_model
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPTConfig


class Intervals(Callback):
    """Runs the spec's schedule of intervals and times them (see the module docstring)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.warmup, self.interval, self.path = spec["warmup"], spec["interval"], spec["checkpoint"]
        self.modes = [mode for order in spec["orders"] for mode in order]
        self.records: list[dict[str, Any]] = []
        self.window: dict[str, float] = {}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        measured = trainer.global_step - self.warmup
        if measured < 0 or measured % self.interval != 0:
            return
        now = time.perf_counter()
        if self.records:
            self._close(self.records[-1])
        else:
            self._open_window(now)
        index = measured // self.interval
        if index < len(self.modes):
            self._open(trainer, self.modes[index], now)

    def _open(self, trainer: Any, mode: str, start: float) -> None:
        record: dict[str, Any] = {"mode": mode, "start": start}
        if mode != "none":
            trainer.strategy.async_checkpoint = mode != "sync"
            start_writer = writer_process.start
            if mode == "async_thread":
                writer_process.start = lambda: None  # type: ignore[assignment]
            try:
                trainer.save_checkpoint(self.path)
            finally:
                writer_process.start = start_writer  # type: ignore[assignment]
            record["save_call_seconds"] = time.perf_counter() - start
        self.records.append(record)

    def _close(self, record: dict[str, Any]) -> None:
        if record["mode"] in ("async", "async_thread"):
            start = time.perf_counter()
            async_save.wait_for_background_save()
            record["end_wait_seconds"] = time.perf_counter() - start
        record["seconds"] = time.perf_counter() - record.pop("start")

    def _open_window(self, now: float) -> None:
        cpu_times = read_cpu_times()
        self.window = {
            "wall_start": now,
            "process_cpu_start": time.process_time(),
            "system_busy_start": cpu_times.busy_seconds if cpu_times else float("nan"),
        }

    def close_window(self) -> dict[str, float]:
        """The measured steps' wall, own CPU (every thread of this process) and the machine's busy seconds."""
        cpu_times = read_cpu_times()
        busy_end = cpu_times.busy_seconds if cpu_times else float("nan")
        return {
            "wall_seconds": time.perf_counter() - self.window["wall_start"],
            "process_cpu_seconds": time.process_time() - self.window["process_cpu_start"],
            "system_busy_seconds": busy_end - self.window["system_busy_start"],
        }


def timing_background_writes(record: list[float]) -> None:
    """Time every ``save_sharded`` that ``checkpoint/async_save.py`` runs on its thread (it calls the module's
    function; the synchronous path imported the name itself and is timed by its call instead)."""
    original = sharded.save_sharded
    lock = threading.Lock()

    def timed(*args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        try:
            original(*args, **kwargs)
        finally:
            with lock:
                record.append(time.perf_counter() - start)

    sharded.save_sharded = timed  # type: ignore[assignment]


def run(spec: dict[str, Any]) -> dict[str, Any]:
    model_config = GPTConfig(**spec["model_config"])
    intervals = Intervals(spec)
    world_size, batch = spec["world_size"], spec["batch_size_per_rank"]
    total_steps = spec["warmup"] + len(intervals.modes) * spec["interval"]
    torch.manual_seed(spec["seed"])
    loader = DataLoader(
        RandomTokenDataset(
            vocab_size=model_config.vocab_size,
            block_size=spec["sequence_length"],
            num_samples=batch * world_size * total_steps,
            seed=spec["seed"],
        ),
        batch_size=batch,
        shuffle=False,
        drop_last=True,
    )
    background_writes: list[float] = []
    timing_background_writes(background_writes)
    # A save describes any Hugging Face model in the module, and with `transformers` imported (the demo's imports pull
    # it in) the first look imports its modeling code: 0.4 s, once per process, in either mode. Paid here, before fit.
    describe_huggingface_model(torch.nn.Module())
    # async_checkpoint=True makes the background saves' process group when training starts; the intervals then
    # switch `strategy.async_checkpoint` per save.
    strategy = build_strategy("colossal_zero2", {"async_checkpoint": True})
    train_on_cpu(strategy, world_size, total_steps, BenchmarkModule(model_config, 3e-4), loader, [intervals])
    return {
        "rank": int(os.environ["RANK"]),
        "parameter_count": parameter_count(model_config),
        "window": intervals.close_window(),
        "intervals": intervals.records,
        "background_write_seconds": background_writes,
        "checkpoint_bytes": sum(
            path.stat().st_size for path in Path(spec["checkpoint"]).parent.rglob("*") if path.is_file()
        ),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="run spec JSON written by benchmarks.checkpoint_stall")
    spec_path = parser.parse_args(argv).spec
    spec = json.loads(spec_path.read_text())
    try:
        result = run(spec)
    except Exception:
        traceback.print_exc()
        raise SystemExit(3) from None
    # Written to a temporary name and renamed, so the orchestrator never reads half a file.
    result_path = spec_path.parent / f"rank{os.environ['RANK']}.json"
    temporary_path = result_path.with_suffix(".json.partial")
    temporary_path.write_text(json.dumps(result))
    temporary_path.rename(result_path)


if __name__ == "__main__":
    main()
