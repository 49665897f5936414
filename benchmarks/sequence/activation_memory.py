"""Activation bytes per rank of the demo GPT against sequence length: no sequence parallelism, Ulysses and ring.

    python -m benchmarks.sequence.activation_memory --lengths 256,512,1024,2048,4096 --budget-mib 16

For each sequence-parallel size (1, then 2 and 4 ranks over gloo, ``benchmarks.harness.launch``), every rank builds the
demo GPT (``--layers`` blocks of width ``--hidden``, ``--heads`` heads, fp32), splits it with the model's own policy
(``GPTPolicy`` under a ``ParallelContext`` whose ``sp_group`` is every rank: Ulysses with the contiguous layout, ring
with the zigzag one), takes its share of ``--batch`` sequences (``split_sequence``) and runs one forward and loss. The
figure is what autograd saves for backward, by storage, weights excluded (``saved_tensors_hooks``): the activation
memory a training step holds at the end of its forward. The planner's estimate (``planning.activations``) for the same
shape is printed beside it (the planner knows ring rows; its Ulysses figure is the one of ``sp_size=1`` divided the
same way, which the table shows as "–"). The last table gives, per mode, the longest length of ``--lengths`` whose
measured bytes fit ``--budget-mib`` per rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.harness.launch import REPOSITORY_ROOT, launch_ranks
from benchmarks.harness.machine import git_revision

MODES = {"ulysses": "contiguous", "ring": "zigzag"}


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.sequence.activation_memory", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--lengths", default="256,512,1024,2048,4096", help="sequence lengths (comma-separated)")
    parser.add_argument("--sizes", default="2,4", help="sequence-parallel sizes above 1 (comma-separated)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2, help="sequences per step (every rank holds a share of each)")
    parser.add_argument("--budget-mib", type=float, default=16.0, help="per-rank activation budget for the last table")
    parser.add_argument(
        "--output", type=Path, default=REPOSITORY_ROOT / "benchmarks" / "out" / "activation_memory.json"
    )
    return parser.parse_args(argv)


def rank_main(arguments: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from lightning_colossal.demo.model import GPT, GPTConfig
    from lightning_colossal.demo.parallel_policy import GPTPolicy
    from lightning_colossal.parallel.batches import split_sequence
    from lightning_colossal.parallel.tensor_parallel import ParallelContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    modes = MODES if world > 1 else {"none": "contiguous"}
    result: dict[str, Any] = {}
    for mode, layout in modes.items():
        context = ParallelContext(
            tp_group=None, tp_mesh=None, sp_group=dist.group.WORLD if world > 1 else None, sequence_layout=layout
        )
        for length in (int(text) for text in arguments.lengths.split(",")):
            torch.manual_seed(0)
            config = GPTConfig(
                num_layers=arguments.layers,
                embed_dim=arguments.hidden,
                num_heads=arguments.heads,
                vocab_size=256,
                block_size=length,
                dropout=0.0,
            )
            model = GPT(config)
            if world > 1:
                GPTPolicy().parallelize(model, context)
            tokens = torch.randint(0, 256, (arguments.batch, length + 1), generator=torch.Generator().manual_seed(1))
            inputs, targets = split_sequence((tokens[:, :-1], tokens[:, 1:]), world, rank, layout)
            weights = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
            saved: dict[int, int] = {}

            def pack(tensor: torch.Tensor, saved: dict[int, int] = saved) -> torch.Tensor:
                saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
                return tensor

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                logits = model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            loss.backward()  # every rank takes part in the backward's exchanges
            result[f"{mode}:{length}"] = sum(size for pointer, size in saved.items() if pointer not in weights)
    dist.destroy_process_group()
    return result


def _planner_bytes(arguments: argparse.Namespace, length: int, sp_size: int) -> int:
    from lightning_colossal.planning.activations import Workload, activation_estimate
    from lightning_colossal.planning.model_state import OPTIMIZERS, Training
    from lightning_colossal.planning.sources import DemoOverrides, demo_model

    shape = demo_model(
        DemoOverrides(
            layers=arguments.layers, hidden=arguments.hidden, heads=arguments.heads, vocab=256, block_size=length
        )
    )
    training = Training("32-true", OPTIMIZERS["adamw"], "cpu")
    return activation_estimate(shape, training, Workload(arguments.batch, length), sp_size=sp_size).total


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
    if os.environ.get("RANK") is not None:  # a rank
        print("RESULT " + json.dumps(rank_main(arguments)), flush=True)
        return 0
    lengths = [int(text) for text in arguments.lengths.split(",")]
    measured: dict[int, dict[str, int]] = {}  # per size, the largest rank's bytes by "mode:length"
    for size in [1, *(int(text) for text in arguments.sizes.split(","))]:
        with tempfile.TemporaryDirectory(prefix="activation_memory_") as scratch:
            launch_ranks("benchmarks.sequence.activation_memory", sys.argv[1:] if argv is None else argv, size,
                         Path(scratch), 900)  # fmt: skip
            ranks = []
            for rank in range(size):
                lines = (Path(scratch) / f"rank{rank}.log").read_text().splitlines()
                ranks.append(json.loads(next(line for line in lines if line.startswith("RESULT "))[7:]))
        measured[size] = {key: max(rank[key] for rank in ranks) for key in ranks[0]}
    mib = 2**20
    print(f"git {git_revision(REPOSITORY_ROOT)}; demo GPT {arguments.layers} layers, width {arguments.hidden},")
    print(f"{arguments.heads} heads, {arguments.batch} sequences, fp32; activation MiB per rank (largest rank)")
    print("| length | none | " + " | ".join(f"{mode} sp={size}" for size in measured if size > 1 for mode in MODES)
          + " | planner: none / " + " / ".join(f"ring sp={size}" for size in measured if size > 1) + " |")  # fmt: skip
    rows = []
    for length in lengths:
        cells = [f"{measured[1][f'none:{length}'] / mib:.2f}"]
        cells += [f"{measured[size][f'{mode}:{length}'] / mib:.2f}" for size in measured if size > 1 for mode in MODES]
        planner = [_planner_bytes(arguments, length, size) / mib for size in measured]
        rows.append({"length": length, "measured": {str(size): values for size, values in measured.items()}})
        print(f"| {length} | " + " | ".join(cells) + " | " + " / ".join(f"{value:.2f}" for value in planner) + " |")
    budget = arguments.budget_mib * mib
    print(f"\nLongest length of {lengths} within {arguments.budget_mib:g} MiB of activations per rank:")
    fitting: dict[str, int | None] = {}
    for size, values in measured.items():
        for mode in ["none"] if size == 1 else list(MODES):
            label = "none" if size == 1 else f"{mode} sp={size}"
            fits = [length for length in lengths if values[f"{mode}:{length}"] <= budget]
            fitting[label] = max(fits) if fits else None
            print(f"  {label}: {fitting[label]}")
    arguments.output.parent.mkdir(parents=True, exist_ok=True)
    arguments.output.write_text(
        json.dumps({"arguments": vars(arguments) | {"output": str(arguments.output)}, "measured": {
            str(size): values for size, values in measured.items()}, "longest_within_budget": fitting}, indent=2)
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
