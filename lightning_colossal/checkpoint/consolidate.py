"""Turning a sharded checkpoint (its file and shards) into one self-contained file.

This is the one place that deliberately holds a whole model in one process: it runs offline, after training, on
a machine with enough host memory. Outputs:

- ``*.safetensors``: the model weights by parameter name (what Hugging Face and other tools load);
- any other name with ``weights_only=True``: a ``torch.save`` of the weights ``{name: tensor}``;
- any other name: a full Lightning checkpoint (``state_dict``, ``optimizer_states`` by position, loops, callbacks,
  schedulers, precision state) that ``Trainer.fit(ckpt_path=...)`` of any strategy, including Lightning's own,
  and ``LightningModule.load_from_checkpoint`` can read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_colossal.checkpoint import atomic
from lightning_colossal.checkpoint.format import CURRENT_MODEL_STATE, MODEL_KEY, CheckpointDescription, TrainingTensors
from lightning_colossal.checkpoint.layout import CheckpointFiles, CheckpointKind, locate_checkpoint
from lightning_colossal.checkpoint.optimizer_state import rekey_by_position
from lightning_colossal.checkpoint.sharded import load_file_weights, load_metadata, read_sharded

__all__ = ["consolidate", "read_sharded", "strip_name_prefix"]


def strip_name_prefix(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Drop ``prefix`` from every name (e.g. ``"model."`` to get the wrapped model's own names).

    Raises:
        ValueError: no name starts with ``prefix`` (a typo would otherwise silently keep the long names).
    """
    if not any(name.startswith(prefix) for name in weights):
        examples = ", ".join(sorted(weights)[:3])
        raise ValueError(f"No parameter name starts with {prefix!r} (names look like: {examples}); fix --strip-prefix.")
    return {name[len(prefix) :] if name.startswith(prefix) else name: tensor for name, tensor in weights.items()}


def consolidate(
    checkpoint: str | Path,
    output: str | Path,
    weights_only: bool = False,
    strip_prefix: str | None = None,
) -> Path:
    """Write the sharded checkpoint ``checkpoint`` (its file and shards) as the single file ``output``.

    Args:
        checkpoint: a checkpoint written by any lightning_colossal strategy (a checkpoint file with its ``.shards``
            directory next to it, or a format-1 checkpoint directory).
        output: the file to write; a ``.safetensors`` suffix selects safetensors (weights only).
        weights_only: write only ``{name: tensor}`` instead of a full Lightning checkpoint.
        strip_prefix: drop this prefix from parameter names (weights-only outputs only).

    Returns:
        The path written.
    """
    checkpoint = Path(checkpoint)
    output = Path(output)
    files = locate_checkpoint(checkpoint)
    as_safetensors = output.suffix == ".safetensors"
    weights_only = weights_only or as_safetensors
    _check_request(checkpoint, output, files, weights_only, strip_prefix)
    state = _read_state(checkpoint, files, weights_only)
    weights: dict[str, torch.Tensor] = state.model
    if strip_prefix:
        weights = strip_name_prefix(weights, strip_prefix)
    output.parent.mkdir(parents=True, exist_ok=True)
    # Written straight into a temporary file that replaces ``output`` at the end: one copy of the weights in memory,
    # and never a half-written ``output``.
    with atomic.replacing(output) as temporary:
        if as_safetensors:
            _save_safetensors(weights, temporary)
        else:
            torch.save(weights if weights_only else _lightning_checkpoint(files, state, weights), temporary)
    return output


def _check_request(
    checkpoint: Path, output: Path, files: CheckpointFiles, weights_only: bool, strip_prefix: str | None
) -> None:
    """Refuse what cannot be written before reading anything."""
    if files.kind is CheckpointKind.FULL:
        raise ValueError(f"{checkpoint} is already a single-file checkpoint; there is nothing to consolidate.")
    if strip_prefix and not weights_only:
        raise ValueError(
            "--strip-prefix renames parameters, which a Lightning checkpoint cannot load back: add --weights-only"
            " or write a .safetensors file."
        )
    if output.exists() and output.is_dir():
        raise IsADirectoryError(f"{output} is a directory: pass a file name such as model.safetensors or full.ckpt.")
    if output.exists() and output.resolve() == checkpoint.resolve():
        raise ValueError(f"{output} is the checkpoint itself: write the consolidated file under another name.")
    if not files.has_shards and not weights_only:
        raise FileNotFoundError(
            f"The sharded training state of {checkpoint} is missing (expected at {files.shards}): copy that"
            " directory next to the file to write a full checkpoint with optimizer state, or add --weights-only."
        )


def _read_state(checkpoint: Path, files: CheckpointFiles, weights_only: bool) -> TrainingTensors:
    """The checkpoint's tensors: the weights alone, or everything the shards hold."""
    if not files.has_shards:
        # A checkpoint file copied without its shards still carries the weights (weights-only outputs).
        return TrainingTensors(model=dict(load_file_weights(files)))
    return TrainingTensors.from_state(read_sharded(files.shards, keys={MODEL_KEY} if weights_only else None))


def _lightning_checkpoint(
    files: CheckpointFiles, state: TrainingTensors, weights: dict[str, torch.Tensor]
) -> dict[str, Any]:
    """A full Lightning checkpoint: the file's metadata, the weights, and the optimizer states keyed by position."""
    contents = load_metadata(files)
    # Without the description the file is a plain Lightning checkpoint, which every strategy loads as one.
    CheckpointDescription.remove_from(contents)
    contents["state_dict"] = weights
    if state.current_model is not None:
        # A weight-averaging run: `state_dict` is the average, as Lightning's callback writes it.
        contents[CURRENT_MODEL_STATE] = state.current_model
    contents["optimizer_states"] = [rekey_by_position(optimizer) for optimizer in state.optimizers]
    return contents


def _save_safetensors(weights: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    # safetensors refuses views and shared storage; the copies read from disk are neither, contiguous() is cheap
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(path), metadata={"format": "pt"})
