"""Command line: which strategy and setting fit a model on given machines, with per-rank bytes and the reason.

Usage::

    python -m lightning_colossal.plan --model demo --devices 8 --device-memory 80GiB
    python -m lightning_colossal.plan --model path/to/config.json --devices 8 --nodes 2 --precision bf16-mixed
    python -m lightning_colossal.plan --parameters 7e9 --layers 32 --hidden 4096 --devices 8 --json
    python -m lightning_colossal.plan --parameters 7e9 --layers 32 --hidden 4096 --devices 8 --host-memory 64GiB \
        --offload-dir /local_nvme            # the disk tier: measures that disk (a few seconds)

Model-state bytes are the engines' own, exact to the byte (``tests/distributed/test_plan_against_engines.py``), on the
device, in host memory and, for the disk tier's settings (``--offload-dir``), on disk; working memory and activations
are estimates (docs/planner.md states how good). This module imports neither
Lightning nor transformers nor the demo: each model source imports what it needs when it is used.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from lightning_colossal.planning.activations import Workload
from lightning_colossal.planning.disk_tier import Disk
from lightning_colossal.planning.model_shape import ModelShape
from lightning_colossal.planning.model_state import OPTIMIZERS, Training
from lightning_colossal.planning.planner import Hardware, Plan, make_plan
from lightning_colossal.planning.report import plan_to_json, render_plan
from lightning_colossal.planning.sources import (
    DEFAULT_VOCAB,
    DemoOverrides,
    LayerShape,
    demo_model,
    huggingface_model,
    parameter_count_model,
)
from lightning_colossal.planning.units import parse_bytes, parse_count

__all__ = ["build_parser", "disk_from_arguments", "load_model", "main", "plan_from_arguments"]

PRECISIONS = ("bf16-mixed", "32-true", "16-mixed", "bf16-true")
DEFAULT_SEQUENCE_LENGTH = 2048
_SHAPE_FLAGS = ("layers", "hidden", "heads", "vocab")


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model (one of --model or --parameters)")
    group.add_argument(
        "--model", help="'demo' (the demo GPT), or a Hugging Face config.json or a directory holding one"
    )
    group.add_argument("--parameters", help="a parameter count (7e9, 7B, 1.3B, 125M), laid out Llama-style")
    group.add_argument("--layers", type=int, help="transformer layers (--parameters; overrides the demo's)")
    group.add_argument("--hidden", type=int, help="hidden width (--parameters; overrides the demo's embed_dim)")
    group.add_argument("--heads", type=int, help="attention heads (default: hidden / 128; the demo's own for demo)")
    group.add_argument("--kv-heads", type=int, help="key/value heads for grouped-query attention (--parameters)")
    group.add_argument("--vocab", type=int, help="vocabulary size (default 32000; the demo's 256 for demo)")
    group.add_argument("--block-size", type=int, help="the demo GPT's longest sequence (its position table)")
    group.add_argument("--tie-embeddings", action="store_true", help="--parameters: the head shares the embedding")


def _machine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("machines")
    group.add_argument("--devices", type=int, default=1, help="devices per node, as Trainer(devices=...) (default 1)")
    group.add_argument("--nodes", type=int, default=1, help="nodes, as Trainer(num_nodes=...) (default 1)")
    group.add_argument("--device-memory", default="80GiB", help="memory of one device (default 80GiB; 80GB = 10**9)")
    group.add_argument("--host-memory", default="512GiB", help="host memory per node, shared by its ranks (512GiB)")
    group.add_argument(
        "--device-reserve", default="2GiB", help="per device, not usable for training: CUDA context, fragmentation"
    )
    group.add_argument("--device-type", choices=("cuda", "cpu"), default="cuda", help="where ranks compute")


def _disk_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "disk tier (optimizer state on a local disk, and its fp32 masters too where the state alone does not fit the"
        " host; weighed when a disk is given, recommended only when nothing without it fits)"
    )
    group.add_argument(
        "--offload-dir",
        help="a directory on each node's local disk (NVMe) for the disk tier; the planner measures its bandwidth"
        " (writes and removes a 512 MiB file: a few seconds) and free space unless given below",
    )
    group.add_argument(
        "--disk-read-gbps",
        type=float,
        help="sequential read bandwidth of a node's disk in GB/s (10**9 bytes per second, as disk makers quote it;"
        " not gigabits); with --disk-write-gbps it describes a disk without --offload-dir or skips the measurement",
    )
    group.add_argument("--disk-write-gbps", type=float, help="sequential write bandwidth in GB/s, as --disk-read-gbps")
    group.add_argument(
        "--disk-space",
        help="free disk space per node for the tier, e.g. 2TiB (default: measured under --offload-dir, else unchecked)",
    )


def _training_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training")
    group.add_argument("--precision", choices=PRECISIONS, default="bf16-mixed", help="Trainer precision")
    group.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adamw", help="default adamw")
    group.add_argument("--micro-batch-size", type=int, default=1, help="sequences per rank per forward (default 1)")
    group.add_argument(
        "--sequence-length",
        type=int,
        help=f"tokens per sequence (default: the demo's block size, else {DEFAULT_SEQUENCE_LENGTH})",
    )
    group.add_argument("--activation-checkpointing", action="store_true", help="recompute each layer in backward")
    group.add_argument("--attention", choices=("sdpa", "eager"), help="override the model's attention kind")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m lightning_colossal.plan",
        description="Per-rank memory of every lightning_colossal strategy for a model on given machines, whether it"
        " fits, and which to use.",
    )
    _model_arguments(parser)
    _machine_arguments(parser)
    _disk_arguments(parser)
    _training_arguments(parser)
    return parser


def _given_shape_flags(arguments: argparse.Namespace) -> list[str]:
    return ["--" + flag for flag in _SHAPE_FLAGS if getattr(arguments, flag) is not None]


def _parameter_count_model(arguments: argparse.Namespace) -> ModelShape:
    missing = [flag for flag in ("layers", "hidden") if getattr(arguments, flag) is None]
    if missing:
        raise ValueError(
            f"--parameters needs the layer shape too: add {' '.join('--' + flag for flag in missing)}"
            " (e.g. --parameters 7e9 --layers 32 --hidden 4096)."
        )
    if arguments.block_size is not None:
        raise ValueError("--block-size is the demo GPT's; with --parameters pass --sequence-length only.")
    shape = LayerShape(
        parameters=parse_count(arguments.parameters, "--parameters"),
        layers=arguments.layers,
        hidden=arguments.hidden,
        vocab=arguments.vocab if arguments.vocab is not None else DEFAULT_VOCAB,
        heads=arguments.heads,
        kv_heads=arguments.kv_heads,
        tie_embeddings=arguments.tie_embeddings,
    )
    return parameter_count_model(shape)


def load_model(arguments: argparse.Namespace) -> ModelShape:
    """The model the arguments name.

    Raises:
        ValueError: no model or two models named, or flags that do not apply to the named source (naming the fix).
    """
    if arguments.model is not None and arguments.parameters is not None:
        raise ValueError("pass either --model or --parameters, not both.")
    if arguments.parameters is not None:
        return _parameter_count_model(arguments)
    if arguments.model is None:
        raise ValueError("name a model: --model demo, --model path/to/config.json, or --parameters 7e9 --layers ...")
    only_with_parameters = [
        flag
        for flag, given in (("--kv-heads", arguments.kv_heads), ("--tie-embeddings", arguments.tie_embeddings))
        if given
    ]
    if only_with_parameters:
        raise ValueError(f"{' '.join(only_with_parameters)} apply to --parameters only; drop them with --model.")
    if arguments.model == "demo":
        overrides = DemoOverrides(
            arguments.layers, arguments.hidden, arguments.heads, arguments.vocab, arguments.block_size
        )
        return demo_model(overrides)
    given = _given_shape_flags(arguments) + (["--block-size"] if arguments.block_size is not None else [])
    if given:
        raise ValueError(
            f"{' '.join(given)} apply to --model demo and --parameters; a Hugging Face config fixes its own shape:"
            " edit its config.json instead."
        )
    return huggingface_model(arguments.model)


def _workload(arguments: argparse.Namespace, model: ModelShape) -> Workload:
    sequence_length = arguments.sequence_length
    if sequence_length is None:
        limit = model.architecture.max_sequence
        sequence_length = limit if model.source == "demo" and limit else DEFAULT_SEQUENCE_LENGTH
    if arguments.micro_batch_size < 1 or sequence_length < 1:
        raise ValueError("--micro-batch-size and --sequence-length must be positive, e.g. 1 and 2048.")
    limit = model.architecture.max_sequence
    if model.source == "demo" and limit is not None and sequence_length > limit:
        raise ValueError(
            f"--sequence-length {sequence_length} is longer than the demo GPT's block_size {limit}, which it refuses:"
            f" pass --block-size {sequence_length} or a shorter --sequence-length."
        )
    return Workload(arguments.micro_batch_size, sequence_length, arguments.activation_checkpointing)


def _gbps(value: float | None, option: str) -> float | None:
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise ValueError(f"{option} {value}: pass a positive bandwidth in GB/s, e.g. 3.5.")
    return None if value is None else value * 1e9


def _existing_directory(path: str, needed_for: str) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise ValueError(
            f"--offload-dir {path!r} is not a directory here, and the planner needs it for {needed_for}: create it"
            " on the local disk first, or describe that disk with --disk-read-gbps, --disk-write-gbps"
            " (and --disk-space)."
        )
    return directory


def _measured(directory: Path) -> tuple[float, float, bool]:
    """(read, write bytes per second, direct I/O) of the disk under ``directory``."""
    from lightning_colossal.disk.bandwidth import measure_bandwidth

    print(f"measuring the disk under {directory} (512 MiB written and read back) ...", file=sys.stderr, flush=True)
    try:
        bandwidth = measure_bandwidth(str(directory))
    except (OSError, RuntimeError) as error:
        raise ValueError(
            f"--offload-dir {str(directory)!r}: measuring its bandwidth failed ({error}); pass --disk-read-gbps and"
            " --disk-write-gbps to skip the measurement."
        ) from error
    return bandwidth.read_bytes_per_second, bandwidth.write_bytes_per_second, bandwidth.direct_io


def disk_from_arguments(arguments: argparse.Namespace) -> Disk | None:
    """The node's disk the arguments describe: ``--offload-dir`` (measured where bandwidths or space are not
    given), or ``--disk-read-gbps`` with ``--disk-write-gbps`` alone; ``None`` without any of them.

    Raises:
        ValueError: half a description (one bandwidth, or only a space), or a directory that cannot be measured.
    """
    read = _gbps(arguments.disk_read_gbps, "--disk-read-gbps")
    write = _gbps(arguments.disk_write_gbps, "--disk-write-gbps")
    space = None if arguments.disk_space is None else parse_bytes(arguments.disk_space, "--disk-space", allow_zero=True)
    if arguments.offload_dir is None:
        if read is None and write is None:
            if space is not None:
                raise ValueError(
                    "--disk-space describes the disk tier's disk: add --offload-dir PATH, or --disk-read-gbps and"
                    " --disk-write-gbps."
                )
            return None
        if read is None or write is None:
            missing = "--disk-read-gbps" if read is None else "--disk-write-gbps"
            raise ValueError(
                f"a disk without --offload-dir needs both bandwidths: add {missing} (GB/s), or pass --offload-dir to"
                " measure the disk."
            )
        return Disk(read, write, space=space)
    measured, direct_io = False, None
    if read is None or write is None:
        measured_read, measured_write, direct_io = _measured(_existing_directory(arguments.offload_dir, "measuring"))
        read = measured_read if read is None else read
        write = measured_write if write is None else write
        measured = True
    if space is None:
        space = shutil.disk_usage(_existing_directory(arguments.offload_dir, "its free space")).free
    return Disk(read, write, arguments.offload_dir, space, measured=measured, direct_io=direct_io)


def plan_from_arguments(arguments: argparse.Namespace) -> Plan:
    """Build the plan the parsed arguments ask for (``ValueError`` for bad input, naming the fix)."""
    model = load_model(arguments)
    if arguments.attention is not None:
        model = replace(model, architecture=replace(model.architecture, attention=arguments.attention))
    hardware = Hardware(
        devices_per_node=arguments.devices,
        nodes=arguments.nodes,
        device_memory=parse_bytes(arguments.device_memory, "--device-memory"),
        host_memory=parse_bytes(arguments.host_memory, "--host-memory"),
        device_type=arguments.device_type,
        device_reserve=parse_bytes(arguments.device_reserve, "--device-reserve", allow_zero=True),
        disk=disk_from_arguments(arguments),
    )
    training = Training(arguments.precision, OPTIMIZERS[arguments.optimizer], arguments.device_type)
    return make_plan(model, hardware, training, _workload(arguments, model))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    arguments = parser.parse_args(argv)
    try:
        plan = plan_from_arguments(arguments)
    except ValueError as error:
        parser.error(str(error))
    print(json.dumps(plan_to_json(plan), indent=2) if arguments.json else render_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())
