"""Turning a sharded checkpoint directory into one file.

This is the one place that deliberately holds a whole model in one process: it runs offline, after training, on
a machine with enough host memory. Outputs:

- ``*.safetensors``: the model weights by parameter name (what Hugging Face and other tools load);
- any other name with ``weights_only=True``: a ``torch.save`` of the weights ``{name: tensor}``;
- any other name: a full Lightning checkpoint (``state_dict``, ``optimizer_states`` by position, loops, callbacks,
  schedulers, precision state) that ``Trainer.fit(ckpt_path=...)`` of any strategy, including Lightning's own,
  and ``LightningModule.load_from_checkpoint`` can read.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_colossal.checkpoint import atomic
from lightning_colossal.checkpoint.layout import (
    FORMAT_KEY,
    MODEL_KEY,
    CheckpointKind,
    checkpoint_kind,
    optimizer_key,
)
from lightning_colossal.checkpoint.optimizer_state import rekey_by_position
from lightning_colossal.checkpoint.sharded import load_metadata


def read_sharded(path: str | Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Load a sharded checkpoint's items (all, or the top-level ``keys``) as full tensors in this process."""
    state: dict[str, Any] = {}
    # The public dcp.load works on a copy of the dict it is given, so a planner that builds the state from the
    # checkpoint's own index never reaches the caller; torch's dcp_to_torch_save uses this same entry point.
    _load_state_dict(
        state, storage_reader=FileSystemReader(str(path)), planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True
    )
    return state


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
    """Write the sharded checkpoint directory ``checkpoint`` as the single file ``output``.

    Args:
        checkpoint: a sharded checkpoint directory written by any lightning_colossal strategy.
        output: the file to write; a ``.safetensors`` suffix selects safetensors (weights only).
        weights_only: write only ``{name: tensor}`` instead of a full Lightning checkpoint.
        strip_prefix: drop this prefix from parameter names (weights-only outputs only).

    Returns:
        The path written.
    """
    checkpoint = Path(checkpoint)
    output = Path(output)
    if checkpoint_kind(checkpoint) is not CheckpointKind.SHARDED:
        raise ValueError(f"{checkpoint} is already a single-file checkpoint; there is nothing to consolidate.")
    as_safetensors = output.suffix == ".safetensors"
    weights_only = weights_only or as_safetensors
    if strip_prefix and not weights_only:
        raise ValueError(
            "--strip-prefix renames parameters, which a Lightning checkpoint cannot load back: add --weights-only"
            " or write a .safetensors file."
        )
    if output.exists() and output.is_dir():
        raise IsADirectoryError(f"{output} is a directory: pass a file name such as model.safetensors or full.ckpt.")

    state = read_sharded(checkpoint, keys={MODEL_KEY} if weights_only else None)
    weights: dict[str, torch.Tensor] = state.get(MODEL_KEY, {})
    if strip_prefix:
        weights = strip_name_prefix(weights, strip_prefix)
    output.parent.mkdir(parents=True, exist_ok=True)
    if as_safetensors:
        from safetensors.torch import save as safetensors_save

        # safetensors refuses views and shared storage; the copies read from disk are neither, contiguous() is cheap
        payload = safetensors_save(
            {name: tensor.contiguous() for name, tensor in weights.items()}, metadata={"format": "pt"}
        )
        atomic.write_file_atomically(output, payload)
        return output
    if weights_only:
        contents: dict[str, Any] = weights
    else:
        contents = load_metadata(checkpoint)
        contents.pop(FORMAT_KEY, None)
        contents["state_dict"] = weights
        optimizers = []
        index = 0
        while optimizer_key(index) in state:
            optimizers.append(rekey_by_position(state[optimizer_key(index)]))
            index += 1
        contents["optimizer_states"] = optimizers
    buffer = io.BytesIO()
    torch.save(contents, buffer)
    atomic.write_file_atomically(output, buffer.getvalue())
    return output
