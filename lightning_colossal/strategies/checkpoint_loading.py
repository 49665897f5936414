"""Loading the portable checkpoint format into a set-up model and its optimizers, in place, and what a load checks
first. A part of ``ColossalStrategy`` (``strategies/base.py``) through ``CheckpointingMixin``, split out by what it
owns: the Trainer's ``load_checkpoint`` and the Fabric strategies (``fabric/checkpoints.py``) both come to
``load_portable_checkpoint``, which reads each kind of checkpoint (``checkpoint/layout.py``) through the mode's hooks
(``model_state_for_checkpoint``, ``_load_full_model_state``, ``optimizer_names_and_state``, ``_load_optimizer_state``,
``_on_model_state_loaded``: ``strategies/checkpointing.py``). [Note: who loads checkpoints] is there too.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.checkpoint import async_save
from lightning_colossal.checkpoint.format import CheckpointDescription, SavedItems, TrainingTensors
from lightning_colossal.checkpoint.layout import CheckpointFiles, CheckpointKind, locate_checkpoint
from lightning_colossal.checkpoint.optimizer_state import rekey_by_name
from lightning_colossal.checkpoint.sharded import load_file_weights, load_metadata, load_sharded, saved_shapes
from lightning_colossal.distributed import device as devices
from lightning_colossal.strategies._lightning_private import _collect_rng_states, _set_rng_states, lightning_load
from lightning_colossal.strategies.processes import ProcessGroupMixin


class CheckpointLoadingMixin(ProcessGroupMixin):
    """Loads checkpoints through the mode's hooks, which ``CheckpointingMixin`` declares (see the module docstring)."""

    def load_portable_checkpoint(
        self,
        checkpoint_path: str | Path,
        weights_only: bool | None,
        optimizers: list[Optimizer],
        strict: bool,
        average: Any = None,
        resuming: bool = False,
    ) -> dict[str, Any]:
        """Fill the set-up model (and ``optimizers``, in the checkpoint's order) from any checkpoint this package
        reads, in place; returns the checkpoint's other entries. The Trainer's ``load_checkpoint`` and the Fabric
        strategies (``fabric/checkpoints.py``) both come here.

        Args:
            optimizers: the optimizers to restore, as many as the checkpoint holds; none to load the weights only.
            strict: refuse a checkpoint whose model names differ from this model's.
            average: the active weight-averaging callback's average, when one trains the run.
            resuming: training goes on from this checkpoint (a file without its shards is refused then).
        """
        async_save.wait_for_background_save()  # the path may be the one being written
        path = Path(self.broadcast(str(checkpoint_path)))
        files = locate_checkpoint(path)
        if files.kind is CheckpointKind.FULL:
            return self._load_full_checkpoint(path, weights_only, optimizers, strict)
        if not files.has_shards:
            return self._load_checkpoint_file_without_shards(files, weights_only, resuming, strict)
        return self._load_sharded_checkpoint(files, weights_only, optimizers, strict, average, resuming)

    # ---------------------------------------------------------------------------------------------- loading
    def _load_checkpoint_file_without_shards(
        self, files: CheckpointFiles, weights_only: bool | None, resuming: bool, strict: bool
    ) -> dict[str, Any]:
        """A checkpoint file copied without its shards: its full weights serve validate/test/predict, not resuming."""
        if resuming:
            raise FileNotFoundError(
                f"{files.path} holds the full weights, but its sharded training state (optimizer, random state) is"
                f" missing: expected at {files.shards}. Copy that directory next to the file to resume, or start a new"
                " run from these weights: `Module.load_from_checkpoint(path)`, then `trainer.fit(module)` without"
                " ckpt_path."
            )
        self._load_full_model_state(load_file_weights(files), strict)
        metadata = load_metadata(files, weights_only)
        CheckpointDescription.remove_from(metadata)
        return metadata

    def _load_sharded_checkpoint(
        self,
        files: CheckpointFiles,
        weights_only: bool | None,
        optimizers: list[Optimizer],
        strict: bool,
        average: Any,
        resuming: bool,
    ) -> dict[str, Any]:
        path, shards = files.path, files.shards
        assert shards is not None
        saved = SavedItems(saved_shapes(shards))
        model_state = self.model_state_for_checkpoint()
        _check_model_keys(path, self.whole_model_keys(model_state), saved, strict)
        _check_model_shapes(path, model_state, saved)
        metadata = load_metadata(files, weights_only)
        description = CheckpointDescription.from_contents(metadata) or CheckpointDescription()
        if average is not None and saved.holds_current_model():
            # The checkpoint's `model` items are the average, `current_model` the weights being trained.
            destinations = TrainingTensors(model=average.state_for_checkpoint(), current_model=model_state)
        else:
            # Without an averaging callback now, a checkpoint with an average resumes from the average, as Lightning
            # loads its `state_dict`.
            destinations = TrainingTensors(model=model_state)
        if optimizers:
            _check_optimizer_count(path, description.num_optimizers, len(optimizers))
            for optimizer in optimizers:
                destinations.optimizers.append(self.optimizer_names_and_state(optimizer))
        held_back = {
            index: _hold_back_unsaved_group_settings(state, index, saved)
            for index, state in enumerate(destinations.optimizers)
        }
        for index, state in enumerate(destinations.optimizers):
            _leave_out_unsaved_parameter_state(state, index, saved)
        own_rank = self.global_rank
        restores_rng = saved.holds_rng_of(own_rank)
        if restores_rng:
            destinations.rng_by_rank[own_rank] = _collect_rng_states(include_cuda=devices.device_count("cuda") > 0)
        tensor_state = destinations.to_state()
        load_sharded(shards, tensor_state, allow_partial=not strict)
        # DCP filled the tensors in place and replaced the other values (param groups, random state) in the dict.
        loaded = TrainingTensors.from_state(tensor_state)
        self._on_model_state_loaded()
        for index, settings in held_back.items():
            for group, missing in zip(loaded.optimizers[index]["param_groups"], settings, strict=True):
                group.update(missing)
        for optimizer, state in zip(optimizers, loaded.optimizers, strict=True):
            self._load_optimizer_state(optimizer, state)
        if restores_rng:
            _set_rng_states(loaded.rng_by_rank[own_rank])
        elif resuming:
            rank_zero_warn(
                f"{path} was saved at world size {description.world_size} and holds no random"
                " state for some ranks of this run: those ranks continue from their seeded random state."
            )
        return metadata

    def _load_full_checkpoint(
        self, path: Path, weights_only: bool | None, optimizers: list[Optimizer], strict: bool
    ) -> dict[str, Any]:
        checkpoint = lightning_load(path, map_location="cpu", weights_only=weights_only)
        if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
            raise ValueError(
                f"{path} is not a Lightning checkpoint (it has no 'state_dict' entry). To start from plain weights,"
                " load them in `configure_model` or with `LightningModule.load_state_dict` before `fit`, and pass no"
                " ckpt_path."
            )
        self._load_full_model_state(checkpoint.pop("state_dict"), strict)
        optimizer_states = checkpoint.pop("optimizer_states", None)
        if optimizers:
            _check_optimizer_count(path, len(optimizer_states or []), len(optimizers))
            for optimizer, saved in zip(optimizers, optimizer_states or [], strict=True):
                names = [group["params"] for group in self.optimizer_names_and_state(optimizer)["param_groups"]]
                self._load_optimizer_state(optimizer, rekey_by_name(saved, names))
        return checkpoint


def _check_model_keys(path: Path, expected: set[str], saved: SavedItems, strict: bool) -> None:
    saved_names = saved.model_names()
    missing = sorted(expected - saved_names)
    unexpected = sorted(saved_names - expected)
    if not saved_names:
        raise ValueError(f"{path} holds no model weights: it is not a lightning_colossal training checkpoint.")
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"Error loading {path}: missing keys {missing[:10]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {unexpected[:10]}"
            f"{' ...' if len(unexpected) > 10 else ''}. The model differs from the one that was saved; set"
            " `self.strict_loading = False` in your LightningModule to load the matching weights only."
        )


def _check_optimizer_count(path: Path, saved: int, expected: int) -> None:
    if saved == 0:
        raise KeyError(
            f"{path} holds no optimizer state, so training cannot resume from it: it was saved with no optimizer"
            " state to save (before any fit, after validate/test/predict loaded other weights into a ZeRO or Gemini"
            " run, or with weights_only=True). Load the weights with `LightningModule.load_state_dict` (or"
            " consolidate the checkpoint first) and call `fit` without ckpt_path."
        )
    if saved != expected:
        raise ValueError(
            f"{path} holds {saved} optimizer(s) but `configure_optimizers` returned {expected}: return the same"
            " optimizers as the run that saved the checkpoint."
        )


def _check_model_shapes(path: Path, model_state: Mapping[str, Any], saved: SavedItems) -> None:
    """Refuse, before any tensor is read, a checkpoint whose tensors have other whole shapes than this model's under
    the same names (DCP would stop inside its load plan with a multi-rank traceback and internal key names)."""
    mismatches = []
    for name, value in model_state.items():
        saved_shape = saved.model_shape(name)
        # A DTensor's shape is the whole tensor's, as the checkpoint records it; plain tensors are whole.
        if isinstance(value, Tensor) and saved_shape is not None and tuple(saved_shape) != tuple(value.shape):
            mismatches.append(f"{name}: {list(saved_shape)} in the checkpoint, {list(value.shape)} in this model")
    if mismatches:
        raise ValueError(
            f"{path} does not fit this model: {'; '.join(mismatches[:5])}{' ...' if len(mismatches) > 5 else ''}."
            " Build the model with the configuration of the run that saved it, or start from the weights that fit:"
            " consolidate the checkpoint (`python -m lightning_colossal.consolidate`), drop the entries whose shapes"
            " differ, load the rest with `LightningModule.load_state_dict(..., strict=False)`, and fit without"
            " ckpt_path."
        )


def _leave_out_unsaved_parameter_state(
    optimizer_state: dict[str, Any], optimizer_index: int, saved: SavedItems
) -> None:
    """Take out of ``optimizer_state`` the parameters the checkpoint holds no state for.

    An optimizer keeps no state for a parameter no gradient has reached (an unused layer); the destination describes
    state for every parameter (``initialise_optimizer_state``), so DCP would refuse the load for the missing keys.
    Those parameters load as having no state, as in the run that saved it (``load_optimizer_state_by_name``).
    """
    for name in [
        name for name in optimizer_state.get("state", {}) if not saved.holds_optimizer_state_of(optimizer_index, name)
    ]:
        del optimizer_state["state"][name]


def _hold_back_unsaved_group_settings(
    optimizer_state: dict[str, Any], optimizer_index: int, saved: SavedItems
) -> list[dict[str, Any]]:
    """Take out of ``optimizer_state``'s param groups the settings the checkpoint does not hold; returns them per group.

    A setting added to a param group after the checkpoint was written (``initial_lr``, which an LR scheduler adds:
    Lightning's learning-rate finder saves a checkpoint, runs with its own scheduler, then restores it) would make
    DCP refuse the load for a missing key. Such a setting keeps its current value, put back after loading; every
    setting the checkpoint holds is loaded. Groups the checkpoint lacks entirely are left for DCP to refuse.
    """
    held_back: list[dict[str, Any]] = []
    for index, group in enumerate(optimizer_state.get("param_groups", [])):
        if not saved.holds_optimizer_group(optimizer_index, index):
            held_back.append({})
            continue
        missing = {
            key: value
            for key, value in group.items()
            if key != "params" and not saved.holds_optimizer_setting(optimizer_index, index, key)
        }
        for key in missing:
            del group[key]
        held_back.append(missing)
    return held_back
