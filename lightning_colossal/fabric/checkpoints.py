"""``fabric.save`` / ``fabric.load`` / ``fabric.load_raw`` in the portable checkpoint format.

[Note: a Fabric checkpoint]
``fabric.save(path, {"model": model, "optimizer": optimizer, "step": 100, "scheduler": scheduler})`` writes what the
Trainer writes (``checkpoint/format.py``): the module's weights by parameter name (fp32 masters where the engine keeps
them), each optimizer's state by parameter name, each rank's random state, all resharded on load; the loss scaler's
state under the Trainer's key for it. Plain entries, and the ``state_dict()`` of other stateful objects (a
scheduler), go into the checkpoint file under the user's keys. The file also holds the full weights under the
module's key (one object under two keys, written once), so tools that read ``torch.load(path)["model"]`` (litgpt's
``lit_model.pth``) find plain weights. The description records which keys held the module and the optimizers
(``FabricObjects``), so ``fabric.load`` puts each back where it came from.

Checkpoints move between front doors: ``fabric.load`` reads a Trainer checkpoint (its weights into the state's module,
its optimizers in order; Lightning's loop entries are returned with the rest), Lightning's own single-file
checkpoints, and a file of Fabric's own strategies (``torch.save`` of the state, optimizer state by position); the
Trainer resumes from a Fabric checkpoint (weights and optimizers; its loops start anew).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning
import torch
from torch.nn import Module
from torch.optim import Optimizer

from lightning_colossal.checkpoint.format import CURRENT_MODEL_STATE, FORMAT_KEY, CheckpointDescription, FabricObjects
from lightning_colossal.checkpoint.layout import CheckpointKind, locate_checkpoint, read_checkpoint_file
from lightning_colossal.checkpoint.optimizer_state import rekey_by_name
from lightning_colossal.checkpoint.sharded import load_file_weights, load_metadata

if TYPE_CHECKING:
    from lightning_colossal.fabric.strategy import ColossalFabricStrategy

#: The Trainer's key of the precision plugin's state (``type(plugin).__qualname__`` of the Trainer's plugin), so both
#: front doors resume the same loss scaler.
PRECISION_KEY = "ColossalPrecision"
#: Lightning's key of the version that wrote a checkpoint.
LIGHTNING_VERSION_KEY = "pytorch-lightning_version"
#: Lightning's key of the LR schedulers' states, in the order the Trainer's `configure_optimizers` returns them.
LR_SCHEDULERS_KEY = "lr_schedulers"
#: Keys of the checkpoint file that the format owns; a user's entry may not use them.
RESERVED_KEYS = frozenset(
    {
        "state_dict",
        "optimizer_states",
        FORMAT_KEY,
        CURRENT_MODEL_STATE,
        PRECISION_KEY,
        LIGHTNING_VERSION_KEY,
        LR_SCHEDULERS_KEY,
    }
)


def save(
    strategy: ColossalFabricStrategy,
    path: str | Path,
    state: Mapping[str, Any],
    filters: Mapping[str, Callable[[str, Any], bool]],
) -> None:
    """Write ``state`` at ``path`` ([Note: a Fabric checkpoint]); every rank calls it."""
    mode = strategy.mode
    module_key = _module_key(strategy, state)
    optimizer_keys = [key for key, value in state.items() if isinstance(value, Optimizer)]
    for key in optimizer_keys:
        if key in filters:
            raise ValueError(
                f"fabric.save(filter={{{key!r}: ...}}): optimizer state cannot be filtered (it is saved by parameter"
                " name, whole or not at all). Filter the model's entries, or leave the optimizer out of the state."
            )
    model_state = mode.model_state_for_checkpoint() if module_key is not None else {}
    if module_key in filters:
        keep = filters[module_key]
        model_state = {name: value for name, value in model_state.items() if keep(name, value)}
    checkpoint: dict[str, Any] = {
        "state_dict": model_state,
        "optimizer_states": [mode.optimizer_names_and_state(state[key]) for key in optimizer_keys],
    }
    # What Lightning's own checkpoint readers need to resume from it (Trainer(...).fit(ckpt_path=...)): the version
    # they migrate from and the LR schedulers' states (also under the user's keys), in the order of the state.
    checkpoint[LIGHTNING_VERSION_KEY] = lightning.__version__
    checkpoint[LR_SCHEDULERS_KEY] = [
        value.state_dict() for value in state.values() if isinstance(value, torch.optim.lr_scheduler.LRScheduler)
    ]
    precision_state = strategy.precision.state_dict()
    if precision_state:
        checkpoint[PRECISION_KEY] = precision_state
    for key, value in state.items():
        if key == module_key or key in optimizer_keys:
            continue
        if key in RESERVED_KEYS:
            raise ValueError(
                f"fabric.save: the key {key!r} is one the checkpoint format uses itself; rename that entry of the state."
            )
        converted = value.state_dict() if _is_stateful(value) else value
        if key in filters and isinstance(converted, Mapping):
            converted = {name: entry for name, entry in converted.items() if filters[key](name, entry)}
        checkpoint[key] = converted
    objects = FabricObjects(module=module_key or "state_dict", optimizers=tuple(optimizer_keys))
    mode.save_portable_checkpoint(checkpoint, path, objects)


def load(
    strategy: ColossalFabricStrategy,
    path: str | Path,
    state: Module | Optimizer | dict[str, Any] | None,
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """Fill ``state``'s objects from ``path`` in place; returns the entries ``state`` did not ask for."""
    mode = strategy.mode
    path = Path(mode.broadcast(str(path)))
    files = locate_checkpoint(path)
    ours = files.kind is not CheckpointKind.FULL
    if not state:
        # The checkpoint in full: its entries and, under the module's key, the whole weights.
        if not ours:
            return read_checkpoint_file(path, weights_only)
        contents = load_metadata(files, weights_only)
        description = CheckpointDescription.remove_from(contents) or CheckpointDescription()
        _drop_entries_for_the_trainer(contents, description)
        key = description.fabric.module if description.fabric is not None else "state_dict"
        return {**contents, key: load_file_weights(files)}
    if isinstance(state, Optimizer):
        raise TypeError(
            "fabric.load_raw(path, optimizer) is not supported: the engines keep optimizer state by parameter name."
            " Save and load it with the model: `fabric.load(path, {'model': model, 'optimizer': optimizer})`."
        )
    if isinstance(state, Module):
        _check_set_up(strategy, state)
        if ours:
            mode.load_portable_checkpoint(path, weights_only, optimizers=[], strict=strict)
        else:
            contents = read_checkpoint_file(path, weights_only)
            # A raw state dict (litgpt's `lit_model.pth`), or one under "state_dict" (a Lightning checkpoint).
            weights = contents["state_dict"] if isinstance(contents.get("state_dict"), Mapping) else contents
            mode._load_full_model_state(weights, strict)
        return {}
    module_key = _module_key(strategy, state)
    optimizer_keys = [key for key, value in state.items() if isinstance(value, Optimizer)]
    if ours:
        remainder = _load_ours(strategy, files, state, module_key, optimizer_keys, strict, weights_only)
    else:
        remainder = _load_plain(strategy, path, state, module_key, optimizer_keys, strict, weights_only)
    precision_state = remainder.pop(PRECISION_KEY, None)
    if precision_state:
        strategy.precision.load_state_dict(precision_state)
    missing = [key for key in state if key != module_key and key not in optimizer_keys and key not in remainder]
    if missing and strict:
        raise KeyError(
            f"{path} holds no {missing}: it was saved with other keys in the state. Ask for the keys it holds, or"
            " pass `strict=False` to `fabric.load` to leave these as they are."
        )
    for key, value in list(state.items()):
        if key == module_key or key in optimizer_keys or key not in remainder:
            continue
        if _is_stateful(value):
            value.load_state_dict(remainder.pop(key))
        else:
            state[key] = remainder.pop(key)
    return remainder


def _load_ours(
    strategy: ColossalFabricStrategy,
    files: Any,
    state: dict[str, Any],
    module_key: str | None,
    optimizer_keys: list[str],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """A checkpoint of this package, written by either front door."""
    mode = strategy.mode
    description = CheckpointDescription.from_contents(load_metadata(files, weights_only)) or CheckpointDescription()
    saved_keys = description.fabric.optimizers if description.fabric is not None else ()
    if optimizer_keys and saved_keys:
        absent = [key for key in saved_keys if key not in optimizer_keys]
        if absent:
            raise KeyError(
                f"{files.path} holds the optimizers {list(saved_keys)}, and the state to load asks for"
                f" {optimizer_keys}: pass every optimizer it holds, under the same keys ({absent} missing)."
            )
        ordered = [state[key] for key in saved_keys]
    else:
        ordered = [state[key] for key in optimizer_keys]  # a Trainer checkpoint: its optimizers in order
    if module_key is None:
        if ordered:
            raise ValueError("fabric.load: restoring an optimizer needs the model it steps in the state too.")
        contents = load_metadata(files, weights_only)
    else:
        contents = mode.load_portable_checkpoint(
            files.path, weights_only, optimizers=ordered, strict=strict, resuming=bool(ordered)
        )
    CheckpointDescription.remove_from(contents)
    _drop_entries_for_the_trainer(contents, description)
    return contents


def _drop_entries_for_the_trainer(contents: dict[str, Any], description: CheckpointDescription) -> None:
    """A Fabric save's entries written for the Trainer's readers only (a Fabric loop restores its schedulers from
    its own keys); a Trainer checkpoint keeps them, as Lightning's entries handed back."""
    if description.fabric is not None:
        contents.pop(LIGHTNING_VERSION_KEY, None)
        contents.pop(LR_SCHEDULERS_KEY, None)


def _load_plain(
    strategy: ColossalFabricStrategy,
    path: Path,
    state: dict[str, Any],
    module_key: str | None,
    optimizer_keys: list[str],
    strict: bool,
    weights_only: bool | None,
) -> dict[str, Any]:
    """A single file: Fabric's own strategies' (``torch.save`` of the state) or Lightning's (``state_dict``)."""
    mode = strategy.mode
    contents = read_checkpoint_file(path, weights_only)
    lightning = isinstance(contents.get("state_dict"), Mapping) and (module_key not in contents)
    if module_key is not None:
        weights_key = "state_dict" if lightning else module_key
        if weights_key not in contents:
            raise KeyError(f"{path} holds no {module_key!r} entry: pass the key its model was saved under.")
        mode._load_full_model_state(contents.pop(weights_key), strict)
    saved_optimizers = (
        contents.pop("optimizer_states", []) if lightning else [contents.pop(k, None) for k in optimizer_keys]
    )
    for key, saved in zip(optimizer_keys, saved_optimizers, strict=False):
        if saved is None:
            raise KeyError(f"{path} holds no optimizer state under {key!r}.")
        optimizer = state[key]
        names = [group["params"] for group in mode.optimizer_names_and_state(optimizer)["param_groups"]]
        mode._load_optimizer_state(optimizer, rekey_by_name(saved, names))
    if len(saved_optimizers) < len(optimizer_keys):
        raise KeyError(f"{path} holds {len(saved_optimizers)} optimizer(s), the state asks for {len(optimizer_keys)}.")
    return contents


def _module_key(strategy: ColossalFabricStrategy, state: Mapping[str, Any]) -> str | None:
    """The key of the one set-up module in ``state`` (``None``: none there)."""
    keys = [key for key, value in state.items() if isinstance(value, Module)]
    if len(keys) > 1:
        raise ValueError(
            f"The state holds {len(keys)} modules ({keys}): {type(strategy).__name__} sets up one model, so a checkpoint"
            " holds one. Save the set-up model only."
        )
    for key in keys:
        _check_set_up(strategy, state[key])
    return keys[0] if keys else None


def _check_set_up(strategy: ColossalFabricStrategy, module: Module) -> None:
    if not strategy.is_set_up(module):
        raise ValueError(
            f"The module given to fabric.save/load was not set up by this {type(strategy).__name__}: pass the model"
            " `fabric.setup` returned."
        )


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


__all__ = ["load", "save"]
