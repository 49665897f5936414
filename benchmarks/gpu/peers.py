"""The GPU benchmark: tokens/s, model FLOP utilisation and peak memory per strategy for a ~1B GPT on one GPU.

``python -m benchmarks.gpu --out DIR`` runs every configuration in its own interpreter (a fresh CUDA context and
allocator each, so one configuration's peak or crash never leaks into the next), one after another on the one GPU,
and prints a table. Each configuration trains ``--warmup`` steps, then ``--steps`` measured steps; a step is timed
from ``on_train_batch_start`` to ``on_train_batch_end`` with the device synchronised at both ends, so queued kernels
are counted in the step that launched them. Peak device memory is the allocator's ``max_memory_allocated`` over the
measured steps (reset when they begin), and host memory the process's peak resident set.

Model FLOPs per token follow PaLM's convention: ``6 * N + 12 * L * d * s``, with ``N`` the parameters that take part
in matrix products (the tied LM head counted once, the embedding lookups not) and the attention term counted as a
full, not causal, score matrix. MFU divides the achieved rate by the card's dense bf16 peak (989 TFLOP/s for H100 and
H200 SXM, the datasheet figure), which this script names in its output so a reader can rescale it.

Lightning's own ``ddp`` and FSDP2 (``ModelParallelStrategy`` + ``fully_shard``, as ``benchmarks.peers.worker`` sets it up)
run in the same invocation, so every colossal row has a peer measured on the same card minutes apart.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CONFIGURATIONS = [
    "ddp",
    "colossal_ddp",
    "colossal_zero2",
    "fsdp2",
    "colossal_fsdp",
    "colossal_gemini",
    "colossal_gemini_auto_budget",
    "colossal_zero2_offload",
    "colossal_gemini_offload",
    "colossal_fsdp_offload",
]

# Dense bf16 peaks from the datasheets (TFLOP/s), by a substring of torch.cuda.get_device_name().
DENSE_BF16_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def model_shape(size: str) -> dict[str, int]:
    """The GPT shapes: ``1b`` is 1.07B parameters (20 layers of width 2048, a 32k vocabulary, 1024 tokens)."""
    shapes = {
        "1b": {"vocab_size": 32000, "block_size": 1024, "num_layers": 20, "num_heads": 16, "embed_dim": 2048},
        "tiny": {"vocab_size": 256, "block_size": 64, "num_layers": 2, "num_heads": 2, "embed_dim": 64},
    }
    return shapes[size]


def flops_per_token(shape: dict[str, int]) -> float:
    layers, width, sequence = shape["num_layers"], shape["embed_dim"], shape["block_size"]
    matrix_parameters = 12 * layers * width * width + shape["vocab_size"] * width
    return 6.0 * matrix_parameters + 12.0 * layers * width * sequence


def build_strategy(name: str, budget_bytes: int) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from lightning_colossal import AutoPlacement, GeminiStrategy

    if name == "fsdp2":
        return ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
    if name == "colossal_gemini_auto_budget":
        # A budget below the model state, so automatic placement must split chunks between the GPU and the host.
        return GeminiStrategy(placement=AutoPlacement(compute_memory_budget=budget_bytes))
    return name


def run_configuration(arguments: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process: train, time, and return the row."""
    import torch
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    import lightning_colossal  # noqa: F401  (registers the colossal_* names)
    from benchmarks.peers.worker import BenchmarkModule
    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.model import GPTConfig

    torch.backends.cuda.matmul.allow_tf32 = True
    on_cuda = arguments.accelerator == "cuda"

    def synchronize() -> None:
        if on_cuda:
            torch.cuda.synchronize()

    shape = model_shape(arguments.size)
    total_steps = arguments.warmup + arguments.steps

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self.start = 0.0

        def on_train_batch_start(self, trainer: Trainer, module: Any, batch: Any, batch_idx: int) -> None:
            synchronize()
            if batch_idx == arguments.warmup and on_cuda:
                torch.cuda.reset_peak_memory_stats()
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer: Trainer, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            synchronize()
            elapsed = time.perf_counter() - self.start
            if batch_idx >= arguments.warmup:
                self.times.append(elapsed)
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss.detach()))

    seed_everything(0, verbose=False)
    module = BenchmarkModule(GPTConfig(**shape), learning_rate=1e-4)
    data = RandomTokenDataset(shape["vocab_size"], shape["block_size"], arguments.batch * total_steps, seed=1)
    timer = StepTimer()
    started = time.perf_counter()
    trainer = Trainer(
        accelerator=arguments.accelerator,
        devices=1,
        strategy=build_strategy(arguments.worker, int(arguments.budget_gib * 2**30)),
        precision="bf16-mixed",
        max_steps=total_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer],
    )
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=arguments.batch))
    step = statistics.median(timer.times)
    tokens_per_second = arguments.batch * shape["block_size"] / step
    name = torch.cuda.get_device_name() if on_cuda else "cpu"
    peak = next((value for key, value in DENSE_BF16_PEAK_TFLOPS.items() if key in name), float("nan"))
    achieved = tokens_per_second * flops_per_token(shape) / 1e12
    return {
        "configuration": arguments.worker,
        "device": name,
        "matrix_parameters": 12 * shape["num_layers"] * shape["embed_dim"] ** 2
        + shape["vocab_size"] * shape["embed_dim"],
        "batch": arguments.batch,
        "sequence": shape["block_size"],
        "step_seconds_median": step,
        "step_seconds": timer.times,
        "tokens_per_second": tokens_per_second,
        "achieved_tflops": achieved,
        "mfu": achieved / peak,
        "peak_tflops_assumed": peak,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if on_cuda else float("nan"),
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if on_cuda else float("nan"),
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "losses": timer.losses,
        "wall_seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_benchmark"))
    parser.add_argument("--size", default="1b", choices=["1b", "tiny"])
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget-gib", type=float, default=8.0, help="compute budget of colossal_gemini_auto_budget")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds one configuration may take")
    parser.add_argument("--only", nargs="*", default=CONFIGURATIONS)
    parser.add_argument("--accelerator", default="cuda", help="cpu only to try the script itself without a GPU")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.worker:
        print("ROW " + json.dumps(run_configuration(arguments)), flush=True)
        return
    arguments.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    passthrough = ["--size", arguments.size, "--batch", str(arguments.batch), "--warmup", str(arguments.warmup)]
    passthrough += ["--steps", str(arguments.steps), "--budget-gib", str(arguments.budget_gib)]
    passthrough += ["--accelerator", arguments.accelerator]
    environment = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in arguments.only:
        log = arguments.out / f"{name}.log"
        command = [sys.executable, "-m", "benchmarks.gpu", "--worker", name, *passthrough]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=arguments.timeout, env=environment)
            output, failed = result.stdout + result.stderr, result.returncode != 0
        except subprocess.TimeoutExpired as expired:
            output, failed = (
                f"timed out after {arguments.timeout} s\n{expired.stdout or ''}{expired.stderr or ''}",
                True,
            )
        log.write_text(output if isinstance(output, str) else str(output))
        row_lines = [line for line in str(output).splitlines() if line.startswith("ROW ")]
        if row_lines and not failed:
            rows.append(json.loads(row_lines[-1][4:]))
        else:
            lines = [line for line in str(output).splitlines() if line.strip()]
            errors = [line for line in lines if "Error" in line or "timed out" in line] or lines[-1:] or ["no output"]
            rows.append({"configuration": name, "error": errors[-1][:300]})
        print(json.dumps(rows[-1])[:400], flush=True)
        (arguments.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'configuration':30} {'step s':>8} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'host GiB':>9}")
    for row in rows:
        if "error" in row:
            print(f"{row['configuration']:30} FAILED: {row['error'][:150]}")
            continue
        print(
            f"{row['configuration']:30} {row['step_seconds_median']:8.3f} {row['tokens_per_second']:10.0f} "
            f"{row['mfu']:6.3f} {row['peak_allocated_gib']:9.2f} {row['host_peak_rss_gib']:9.2f}"
        )


if __name__ == "__main__":
    main()
