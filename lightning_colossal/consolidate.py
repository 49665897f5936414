"""Command line: turn a sharded lightning_colossal checkpoint (its file and shards) into one self-contained file.

Usage::

    python -m lightning_colossal.consolidate CKPT OUT.safetensors            # weights, safetensors
    python -m lightning_colossal.consolidate CKPT OUT.ckpt                   # full Lightning checkpoint
    python -m lightning_colossal.consolidate CKPT OUT.pt --weights-only --strip-prefix model.
    python -m lightning_colossal.consolidate CKPT OUT_DIR --format huggingface        # from_pretrained directory
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lightning_colossal.checkpoint.consolidate import consolidate
from lightning_colossal.checkpoint.layout import locate_checkpoint
from lightning_colossal.checkpoint.sharded import load_description


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-colossal-consolidate",
        description="Write a sharded lightning_colossal checkpoint (its file and .shards directory) as one file.",
    )
    parser.add_argument(
        "checkpoint", help="the checkpoint (e.g. .../checkpoints/last.ckpt, with last.ckpt.shards/ next to it)"
    )
    parser.add_argument(
        "output",
        help="file to write: *.safetensors for weights in safetensors, anything else for a torch file; a directory"
        " with --format huggingface",
    )
    parser.add_argument(
        "--format",
        choices=("file", "huggingface"),
        default="file",
        help="'huggingface' writes a directory AutoModelFor...from_pretrained loads (config.json, safetensors shards"
        " and their index), reading one shard's weights at a time",
    )
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="largest safetensors file with --format huggingface (e.g. 5GB, 500MB)",
    )
    parser.add_argument(
        "--config-dir",
        default=None,
        help="with --format huggingface: a directory holding the model's config.json, for checkpoints that recorded"
        " none",
    )
    parser.add_argument(
        "--weights-only",
        action="store_true",
        help="write only {name: tensor} instead of a full Lightning checkpoint (implied by .safetensors)",
    )
    parser.add_argument(
        "--strip-prefix",
        default=None,
        help="drop this prefix from parameter names, e.g. 'model.' for the wrapped model's own names",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = build_parser().parse_args(argv)
    try:
        if arguments.format == "huggingface":
            from lightning_colossal.checkpoint.huggingface import export_huggingface, parse_size

            if arguments.weights_only or arguments.strip_prefix:
                raise ValueError(
                    "--format huggingface writes weights under the model's own names: drop --weights-only"
                    " and --strip-prefix."
                )
            written = export_huggingface(
                arguments.checkpoint,
                arguments.output,
                max_shard_bytes=parse_size(arguments.max_shard_size),
                config_dir=arguments.config_dir,
            )
        else:
            written = consolidate(
                arguments.checkpoint,
                arguments.output,
                weights_only=arguments.weights_only,
                strip_prefix=arguments.strip_prefix,
            )
        provenance = load_description(locate_checkpoint(arguments.checkpoint)).provenance()
    except (FileNotFoundError, ValueError, IsADirectoryError, NotADirectoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {written}" + (f" from a checkpoint {provenance}" if provenance else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
