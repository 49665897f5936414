"""Checkpoints out to Hugging Face: a directory ``AutoModelFor...from_pretrained`` loads.

At save time a strategy records the Hugging Face model the LightningModule holds, if any: where it sits in the
module (the name prefix of its weights) and its configuration as JSON (``describe_huggingface_model``). The export
then writes ``config.json`` (and ``generation_config.json``), and the weights under the model's own names in
safetensors files of at most ``max_shard_bytes`` each, with ``model.safetensors.index.json`` when there are several.

The weights are read from the checkpoint's shards one output file at a time (DCP reads only the items asked for), so
the export holds about one output file in memory, never the whole model: it works for models larger than the
machine's memory, as long as one output file fits.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_colossal.checkpoint import atomic
from lightning_colossal.checkpoint.format import TrainingTensors, model_item, model_name
from lightning_colossal.checkpoint.layout import CheckpointKind, locate_checkpoint
from lightning_colossal.checkpoint.sharded import load_description

DEFAULT_MAX_SHARD_BYTES = 5 * 1000**3  # what transformers' save_pretrained uses
_SIZE_UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3}


def describe_huggingface_model(module: torch.nn.Module) -> dict[str, Any] | None:
    """Where the first ``transformers.PreTrainedModel`` inside ``module`` sits and its configuration, or ``None``.

    Only looks when ``transformers`` was imported already (a model from it cannot exist otherwise), so a run without
    Hugging Face never pays its import.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    for name, submodule in module.named_modules():
        if isinstance(submodule, transformers.PreTrainedModel):
            config = submodule.config.to_dict()
            config["architectures"] = [type(submodule).__name__]
            description: dict[str, Any] = {
                "prefix": f"{name}." if name else "",
                "config": json.dumps(config, default=str),
            }
            generation = getattr(submodule, "generation_config", None)
            if generation is not None:
                description["generation_config"] = generation.to_json_string()
            return description
    return None


def parse_size(size: str | int) -> int:
    """``"2GB"``, ``"500MiB"`` or a number of bytes, as bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B)?\s*", size.upper())
    if match is None:
        raise ValueError(f"Cannot read the size {size!r}: write it like 5GB, 500MB, 2GiB or a number of bytes.")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2) or "B"])


def export_huggingface(
    checkpoint: str | Path,
    output_dir: str | Path,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config_dir: str | Path | None = None,
) -> Path:
    """Write the checkpoint's Hugging Face model as a ``from_pretrained`` directory at ``output_dir``.

    Args:
        checkpoint: a checkpoint written by any lightning_colossal strategy while the module held a
            ``transformers.PreTrainedModel``.
        output_dir: the directory to write (created; files already in it are replaced).
        max_shard_bytes: the largest safetensors file to write.
        config_dir: a directory with the model's ``config.json`` (e.g. the one it was loaded from), for checkpoints
            that recorded no configuration.

    Returns:
        ``output_dir``.
    """
    files = locate_checkpoint(checkpoint)
    if files.kind is CheckpointKind.FULL or not files.has_shards:
        raise ValueError(
            f"{checkpoint} has no sharded weights to export (a single-file checkpoint, or a checkpoint file copied"
            " without its .shards directory): load it with `Module.load_from_checkpoint` and call the Hugging Face"
            " model's `save_pretrained` instead."
        )
    output = Path(output_dir)
    if output.exists() and not output.is_dir():
        raise NotADirectoryError(f"{output} is a file: --format huggingface writes a directory; pass a new path.")
    description = load_description(files).huggingface
    config_json = _config_json(checkpoint, description, config_dir)
    reader = FileSystemReader(str(files.shards))
    items = reader.read_metadata().state_dict_metadata
    prefix = description["prefix"] if description is not None else _common_prefix(items)
    names = _weight_names(checkpoint, items, prefix)
    _refuse_adapter_layers(checkpoint, names)
    output.mkdir(parents=True, exist_ok=True)
    atomic.write_file_atomically(output / "config.json", config_json.encode())
    if description is not None and "generation_config" in description:
        atomic.write_file_atomically(output / "generation_config.json", description["generation_config"].encode())
    _write_weight_files(reader, items, _group_by_size(names, items, max_shard_bytes), prefix, output)
    return output


def _weight_names(checkpoint: str | Path, items: dict[str, Any], prefix: str) -> list[str]:
    """The model names of the tensors below ``prefix``: the Hugging Face model's weights."""
    names = [
        name
        for name, item in ((model_name(key), item) for key, item in items.items())
        if name is not None and name.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    ]
    if not names:
        raise ValueError(f"{checkpoint} holds no weights under {prefix!r}: it is not a checkpoint of this model.")
    return names


def _refuse_adapter_layers(checkpoint: str | Path, names: list[str]) -> None:
    """Refuse a model whose layers a PEFT adapter (LoRA) replaced: ``from_pretrained`` of the base class would find
    ``q_proj.base_layer.weight`` and ``q_proj.lora_A.default.weight`` where it looks for ``q_proj.weight``, and
    initialise those layers at random with only a warning."""
    adapted = [name for name in names if ".base_layer." in name or ".lora_" in name]
    if adapted:
        raise ValueError(
            f"{checkpoint} holds a model with PEFT adapter layers ({adapted[0]}, {len(adapted)} such tensors):"
            " a Hugging Face directory of it would not load into the base model class. Load the module with"
            " `Module.load_from_checkpoint(path)`, then either save the adapter alone (`peft_model.save_pretrained"
            "(directory)`) or merge it into the base weights first (`peft_model.merge_and_unload().save_pretrained"
            "(directory)`)."
        )


def _write_weight_files(
    reader: FileSystemReader, items: dict[str, Any], groups: list[list[str]], prefix: str, output: Path
) -> None:
    """One safetensors file per group of names, under the model's own names (``prefix`` dropped), reading one
    group's tensors at a time; with several files, the index that maps each name to its file."""
    from safetensors.torch import save_file

    weight_map: dict[str, str] = {}
    total_bytes = 0
    for index, group in enumerate(groups):
        filename = (
            "model.safetensors" if len(groups) == 1 else f"model-{index + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        tensors = _read_items(reader, items, group)
        renamed = {name[len(prefix) :]: tensor for name, tensor in tensors.items()}
        with atomic.replacing(output / filename) as temporary:
            save_file(renamed, str(temporary), metadata={"format": "pt"})
        for name, tensor in renamed.items():
            weight_map[name] = filename
            total_bytes += tensor.numel() * tensor.element_size()
        del tensors, renamed  # one output file in memory at a time
    if len(groups) > 1:
        index_json = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        atomic.write_file_atomically(output / "model.safetensors.index.json", json.dumps(index_json, indent=2).encode())


def _config_json(checkpoint: str | Path, description: dict[str, Any] | None, config_dir: str | Path | None) -> str:
    if config_dir is not None:
        path = Path(config_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"No config.json in {config_dir}: pass the directory the model was loaded from.")
        return path.read_text()
    if description is None:
        raise ValueError(
            f"{checkpoint} recorded no Hugging Face model (the LightningModule held no `transformers.PreTrainedModel`"
            " when it was saved). Pass --config-dir DIR with the model's config.json."
        )
    return json.dumps(json.loads(description["config"]), indent=2, sort_keys=True)


def _common_prefix(items: dict[str, Any]) -> str:
    """Without a recorded prefix, the common first ``name.`` part of all weight names (often ``model.``)."""
    names = [name for name in map(model_name, items) if name is not None]
    first_parts = {name.split(".", 1)[0] for name in names}
    return f"{first_parts.pop()}." if len(first_parts) == 1 else ""


def _group_by_size(names: list[str], items: dict[str, Any], max_shard_bytes: int) -> list[list[str]]:
    """Consecutive names packed into groups of at most ``max_shard_bytes`` (one larger tensor gets its own)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        item = items[model_item(name)]
        nbytes = item.size.numel() * torch.empty((), dtype=item.properties.dtype).element_size()
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def _read_items(reader: FileSystemReader, items: dict[str, Any], names: list[str]) -> dict[str, torch.Tensor]:
    """Read only ``names`` from the checkpoint's shards into fresh full tensors."""
    destinations = TrainingTensors(
        model={
            name: torch.empty(tuple(items[model_item(name)].size), dtype=items[model_item(name)].properties.dtype)
            for name in names
        }
    )
    state = destinations.to_state()
    _load_state_dict(state, storage_reader=reader, planner=DefaultLoadPlanner(allow_partial_load=True), no_dist=True)
    return TrainingTensors.from_state(state).model
