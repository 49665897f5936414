"""Hugging Face models larger than one rank: built on the meta device, each rank reading only its pieces.

``AutoModelForCausalLM.from_pretrained(directory)`` in ``configure_model`` works under every strategy, but every rank
reads and holds the whole model. ``pretrained_on_meta`` builds the same model from its configuration on the meta
device (shapes only) and records where each tensor's values are in the directory's safetensors files; nothing is
read yet. The strategy's engine then reads what each rank keeps (``engine_parts/pretrained.py`` [Note: pretrained
weights on the meta device]): its rows of each chunk (Gemini), its shard (FSDP), its tensor-parallel pieces
(hybrid), or the whole model (colossal_ddp, ZeRO, which hold it whole on every rank)::

    def configure_model(self):
        if self.model is None:
            self.model = pretrained_on_meta(self.hparams.directory, AutoModelForCausalLM)

Checkpoint keys are matched to the model's names as ``from_pretrained`` does in the common cases: the same name, the
base model's prefix present or absent (``model.``), a ``key_mapping`` of regular expressions (checkpoint key ->
model name) or the model's own ``_checkpoint_conversion_mapping``, and tied weights stored once. A parameter the
files lack is drawn by the model's own initialiser with a warning naming it, as ``from_pretrained`` reports "newly
initialized" weights (``strict=True`` refuses instead); checkpoint keys the model does not use are named in a
warning. Non-persistent buffers (rotary ``inv_freq``) come from the model's initialiser, as for any meta model.

Nothing here imports Lightning; ``transformers`` is imported when called.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_colossal.engine_parts.pretrained import PretrainedWeights, record_pretrained

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def pretrained_on_meta(
    directory: str | Path,
    model_class: Any = None,
    *,
    dtype: torch.dtype | str = "auto",
    key_mapping: Mapping[str, str] | None = None,
    strict: bool = False,
    **config_overrides: Any,
) -> nn.Module:
    """The model ``model_class.from_pretrained(directory)`` would give, built on the meta device with a record of
    where its weights are; the strategy's engine reads each rank's pieces when it materialises the model.

    Args:
        directory: a local ``save_pretrained`` directory with ``config.json`` and safetensors weights
            (``model.safetensors``, or shards listed in ``model.safetensors.index.json``).
        model_class: an ``AutoModelFor...`` class or a concrete model class (default ``AutoModelForCausalLM``).
        dtype: the parameters' dtype; ``"auto"`` takes the configuration's (what ``from_pretrained`` does by
            default), a ``torch.dtype`` or its name overrides it. File values are converted to it when read.
        key_mapping: regular expressions rewriting checkpoint keys into the model's names, as ``from_pretrained``'s
            ``key_mapping``.
        strict: refuse (``ValueError``) a model whose parameters the files lack, or files with keys the model does
            not use, instead of warning.
        config_overrides: passed to ``AutoConfig.from_pretrained`` (e.g. ``attn_implementation="eager"``).

    Raises:
        FileNotFoundError: no safetensors weights in ``directory``.
        ValueError: none of the model's tensors are in the files (another model class or architecture), or, with
            ``strict``, some are missing or unused.
    """
    import transformers

    model_class = model_class or transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.from_pretrained(str(directory), **config_overrides)
    options = {} if dtype == "auto" else {"dtype": getattr(torch, dtype) if isinstance(dtype, str) else dtype}
    with torch.device("meta"):
        # Auto classes build through from_config; concrete classes through _from_config (it applies dtype the same way).
        build = getattr(model_class, "from_config", None) or model_class._from_config
        model = build(config, **options)
    weights = locate_weights(Path(directory), model, key_mapping, strict)
    record_pretrained(model, weights)
    return model


def stored_keys(directory: Path) -> dict[str, str]:
    """Checkpoint key -> safetensors file name, from the index or the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / SINGLE_FILE
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), framework="pt") as handle:
            return dict.fromkeys(handle.keys(), SINGLE_FILE)
    raise FileNotFoundError(
        f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}: pretrained_on_meta reads safetensors weights only."
        " Save the model with save_pretrained(directory) (safetensors is its default), or convert a .bin checkpoint"
        " by loading it once with from_pretrained and saving it again."
    )


def locate_weights(
    directory: Path, model: nn.Module, key_mapping: Mapping[str, str] | None, strict: bool
) -> PretrainedWeights:
    """Match every tensor of ``model`` with its key in the files (see the module docstring for the rules)."""
    stored = stored_keys(directory)
    by_model_name = _candidate_names(stored, model, key_mapping)
    locations: dict[str, tuple[str, str]] = {}
    absent: list[str] = []
    persistent = set(model.state_dict())
    parameters = {id(parameter) for parameter in model.parameters()}
    for names, tensor in _tensors_with_names(model):
        found = next((by_model_name[name] for name in names if name in by_model_name), None)
        if found is not None:
            locations.update(dict.fromkeys(names, found))
        elif id(tensor) in parameters or any(name in persistent for name in names):
            absent.append(names[0])
    used = {key for _, key in locations.values()}
    unused = sorted(set(stored) - used)
    source = directory / (INDEX_FILE if (directory / INDEX_FILE).is_file() else SINGLE_FILE)
    _report(source, type(model).__name__, absent, unused, not locations, strict)
    absent_parameters = tuple(name for name, parameter in model.named_parameters() if name in absent)
    return PretrainedWeights(str(directory), locations, absent_parameters)


def _candidate_names(
    stored: Mapping[str, str], model: nn.Module, key_mapping: Mapping[str, str] | None
) -> dict[str, tuple[str, str]]:
    """Model name -> (file, checkpoint key), for every name a stored key may stand for."""
    mapping = dict(getattr(model, "_checkpoint_conversion_mapping", None) or {})
    mapping.update(key_mapping or {})
    prefix = getattr(model, "base_model_prefix", "")
    # A task model (``model.`` + base) loading a base model's checkpoint, or the reverse.
    has_prefix = bool(prefix) and any(name.startswith(f"{prefix}.") for name, _ in model.named_parameters())
    candidates: dict[str, tuple[str, str]] = {}
    for key, file_name in stored.items():
        name = key
        for pattern, replacement in mapping.items():
            name = re.sub(pattern, replacement, name)
        candidates.setdefault(name, (file_name, key))
        if has_prefix and not name.startswith(f"{prefix}."):
            candidates.setdefault(f"{prefix}.{name}", (file_name, key))
        elif prefix and not has_prefix and name.startswith(f"{prefix}."):
            candidates.setdefault(name[len(prefix) + 1 :], (file_name, key))
    return candidates


def _tensors_with_names(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    named: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        named.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(named.values())


def _report(source: Path, model_name: str, absent: list[str], unused: list[str], nothing: bool, strict: bool) -> None:
    if nothing:
        raise ValueError(
            f"None of {model_name}'s tensors are in {source} (it has {unused[:5]}...): the directory holds another"
            " architecture, or its keys need a key_mapping={checkpoint pattern: model name} to match"
            f" {model_name}'s names."
        )
    messages = []
    if absent:
        messages.append(
            f"{model_name} has tensors {source} does not hold, drawn by the model's initialiser instead (newly"
            f" initialized, as from_pretrained says; train them before use): {absent}"
        )
    if unused:
        messages.append(f"{source} holds keys {model_name} does not use (ignored): {unused}")
    if messages and strict:
        raise ValueError(
            " ".join(messages) + ". Pass key_mapping to match renamed keys, or strict=False to accept the difference."
        )
    for message in messages:
        warnings.warn(message, stacklevel=3)
