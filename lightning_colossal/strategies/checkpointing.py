"""Saving and loading the portable checkpoint format (``checkpoint/``) through Lightning's strategy interface.

A part of ``ColossalStrategy`` (``strategies/base.py``), split out by what it owns; not used on its own. A mode says
how its weights and optimizer state map to names by overriding the hooks at the top of ``CheckpointingMixin``
(``model_state_for_checkpoint``, ``_load_full_model_state``, and ``optimizer_names_and_state`` /
``_load_optimizer_state`` when its optimizer state is sharded); saving, resharding on load, random state and the
checks with their messages are shared.

[Note: who loads checkpoints]
Sharded strategies must load into the *wrapped* model and the *real* optimizers, so ``restore_checkpoint_after_setup``
is True and ``load_checkpoint`` itself fills weights, optimizer state and RNG state in place (DCP reshards on the way).
Lightning's ``load_model_state_dict`` / ``load_optimizer_state_dict`` are then no-ops; Lightning still restores loops,
callbacks, LR schedulers and the precision plugin (loss scaler) from the entries ``load_checkpoint`` returns.

[Note: when saves run in the background]
With ``async_checkpoint=True`` or Lightning's ``AsyncCheckpointIO`` plugin, a save made inside the fit loop (from
``on_train_start`` to ``on_train_end``: ``ModelCheckpoint``, ``trainer.save_checkpoint`` from a callback) is staged
and written in the background (``checkpoint/async_save.py``); saves outside it (after ``fit``, from ``on_fit_end``)
are synchronous, since nothing would wait for them and their error would go unseen. Every save, every load and
``on_train_end`` first wait for the save in flight and raise its error; teardown waits too (after a failed run the
save's error becomes a note of the run's error). ``remove_checkpoint`` deletes a checkpoint only after the save in
flight committed, so ``ModelCheckpoint(save_top_k=k)`` never holds fewer than it would with synchronous saves.
The plugin's own thread is not used: these strategies write their own format, not through ``checkpoint_io``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.checkpoint import async_save
from lightning_colossal.checkpoint.format import (
    CURRENT_MODEL_STATE,
    CheckpointDescription,
    FabricObjects,
    SavedItems,
    TrainingTensors,
)
from lightning_colossal.checkpoint.huggingface import describe_huggingface_model
from lightning_colossal.checkpoint.layout import CheckpointFiles, CheckpointKind, locate_checkpoint
from lightning_colossal.checkpoint.optimizer_state import rekey_by_name
from lightning_colossal.checkpoint.sharded import (
    load_file_weights,
    load_metadata,
    load_sharded,
    remove_checkpoint,
    save_sharded,
    saved_shapes,
)
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices
from lightning_colossal.strategies._lightning_private import _collect_rng_states, _set_rng_states, lightning_load
from lightning_colossal.strategies.optimizers import unwrap_optimizer
from lightning_colossal.strategies.processes import ProcessGroupMixin
from lightning_colossal.strategies.weight_averaging import active_average


class CheckpointingMixin(ProcessGroupMixin):
    """Checkpoint save and load of ``ColossalStrategy`` (see the module docstring); it needs the processes' ranks."""

    #: Write checkpoints saved inside the fit loop in the background ([Note: when saves run in the background]).
    async_checkpoint: bool = False
    _in_fit_loop = False

    # ---------------------------------------------------------------------------------------------- a mode's hooks
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model tensors by LightningModule parameter name (full, or shards the engine describes).

        Loading fills these same tensors in place, so they must alias the live parameters. By default the module's
        own ``state_dict()``: its tensors alias the parameters (whole ones under DDP, FSDP2's DTensor shards), so DCP
        saves them and loads straight into the live model.
        """
        assert self.lightning_module is not None
        return self.lightning_module.state_dict()

    def whole_model_keys(self, model_state: dict[str, Any]) -> set[str]:
        """Names of the whole model a checkpoint must hold; more than this rank's when ranks hold different parts
        (pipeline stages)."""
        return set(model_state)

    def _on_model_state_loaded(self) -> None:
        """Called after a sharded checkpoint filled ``model_state_for_checkpoint()`` in place (engines re-sync here)."""

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        """Load full (unsharded) weights by name into the live, set-up model."""
        raise NotImplementedError(f"{type(self).__name__} must say how to load full weights.")

    def optimizer_names_and_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The name-keyed state of ``optimizer`` (initialised if it never stepped); tensors alias the live state."""
        assert self.lightning_module is not None
        return get_optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer))

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        # strict=False: a parameter no gradient has reached has no state in the checkpoint, as in the optimizer that
        # saved it; torch's strict check would refuse that (the count of optimizers is checked before this).
        options = StateDictOptions(strict=False)
        set_optimizer_state_dict(self.lightning_module, unwrap_optimizer(optimizer), state, options=options)

    def full_model_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded weights as CPU tensors, on every rank (a collective when weights are sharded)."""
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        gathered = {name: value.full_tensor() if isinstance(value, DTensor) else value for name, value in state.items()}
        return {name: value.detach().cpu() for name, value in gathered.items()}

    # ---------------------------------------------------------------------------------------------- Lightning's side
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # see [Note: who loads checkpoints]

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.model_state_for_checkpoint()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return self.optimizer_names_and_state(optimizer)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done by load_checkpoint, see [Note: who loads checkpoints]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done by load_checkpoint, see [Note: who loads checkpoints]

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...) is not supported: lightning_colossal writes"
                " its own sharded format. Drop storage_options."
            )
        self.save_portable_checkpoint(checkpoint, filepath)

    def save_portable_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, fabric_objects: FabricObjects | None = None
    ) -> None:
        """Write ``checkpoint`` (Lightning's dict: ``state_dict``, ``optimizer_states`` and the rest) in the portable
        format; every rank calls it. The Trainer's ``save_checkpoint`` and the Fabric strategies both come here;
        ``fabric_objects`` names the user's keys of a Fabric save (the file then holds the full weights under the
        module's key too)."""
        async_save.wait_for_background_save()  # one save at a time; a failed one raises here, naming its path
        path = Path(self.broadcast(str(filepath)))
        # With a weight-averaging callback `state_dict` is the average and the weights being trained come apart
        # (strategies/weight_averaging.py [Note: averaging callbacks adopted by the strategy]).
        current_model = checkpoint.pop(CURRENT_MODEL_STATE, None)
        tensors = TrainingTensors(
            model=self._with_first_replica_buffers(checkpoint.pop("state_dict")),
            optimizers=list(checkpoint.pop("optimizer_states", None) or []),
            rng_by_rank={self.global_rank: _collect_rng_states(include_cuda=devices.device_count("cuda") > 0)},
            current_model=None if current_model is None else self._with_first_replica_buffers(current_model),
        )
        description = CheckpointDescription(
            strategy=type(self).__name__,
            world_size=self.world_size,
            num_optimizers=len(tensors.optimizers),
            parallel_dims=self.parallel_dims.axis_sizes() if self._parallel_dims is not None else None,
            # What `consolidate --format huggingface` needs to write a from_pretrained directory.
            huggingface=(
                describe_huggingface_model(self.lightning_module) if self.lightning_module is not None else None
            ),
            fabric=fabric_objects,
        )
        if self.saves_in_background():
            async_save.save_in_background(
                path, tensors.to_state(), checkpoint, description, self._timeout, ranks_per_node=self.num_processes
            )
        else:
            save_sharded(path, tensors.to_state(), checkpoint, description=description)

    def saves_in_background(self) -> bool:
        """Whether a save now would be written in the background ([Note: when saves run in the background])."""
        wanted = self.async_checkpoint or isinstance(self.checkpoint_io, AsyncCheckpointIO)
        return wanted and self._in_fit_loop

    def on_train_start(self) -> None:
        super().on_train_start()
        self._in_fit_loop = True
        if self.saves_in_background():
            # Made here rather than at the first save, which would wait for it (a collective of every rank).
            async_save.prepare_background_saves(self._timeout)

    def on_train_end(self) -> None:
        self._in_fit_loop = False
        async_save.finish_background_saves()  # the fit's last save is complete when fit returns, or its error raised
        super().on_train_end()

    def _finish_background_save(self, failure: BaseException | None) -> BaseException | None:
        """Wait for the save in flight at teardown; its error is returned to raise, or, after a failed run
        (``failure``), added to that run's error as a note."""
        self._in_fit_loop = False
        try:
            async_save.finish_background_saves()
        except async_save.BackgroundSaveError as error:
            if failure is None:
                return error
            failure.add_note(f"lightning_colossal: {error}")
        return None

    def _with_first_replica_buffers(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """``model_state`` with every buffer replaced by a copy of the first data-parallel replica's value.

        [Note: buffers in checkpoints]
        Buffers such as BatchNorm's running statistics are updated from each rank's own batches, so replicas hold
        different values. DCP writes each replicated tensor once, from whichever rank its planner picks, so without
        this a checkpoint could hold one layer's mean from rank 1 and its variance from rank 0. Lightning's ddp saves
        rank 0's module; so do these strategies, per pipeline stage. The live buffers are not touched.
        """
        assert self.lightning_module is not None
        group = self.device_mesh["dp"].get_group() if self.world_size > 1 else None
        if group is None or collectives.world_size(group) == 1:
            return model_state
        buffer_names = {name for name, _ in self.lightning_module.named_buffers()}
        # Sorted, so every rank of the group broadcasts the same buffers in the same order.
        copies = {
            name: model_state[name].detach().clone()
            for name in sorted(buffer_names.intersection(model_state))
            if isinstance(model_state[name], Tensor) and not isinstance(model_state[name], DTensor)
        }
        collectives.broadcast_tensors(list(copies.values()), source_rank=0, group=group)
        return {**model_state, **copies}

    def remove_checkpoint(self, filepath: str | Path) -> None:
        # A checkpoint is its file and its shards directory (see checkpoint/layout.py); Lightning would delete the file.
        if self.is_global_zero:
            # Not before the save in flight committed: a crash until then keeps this checkpoint as the latest one.
            async_save.remove_after_background_save(lambda: remove_checkpoint(filepath))

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        assert self.lightning_module is not None
        trainer = self.lightning_module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        return self.load_portable_checkpoint(
            checkpoint_path,
            weights_only,
            optimizers=self.optimizers if fitting else [],
            strict=self.lightning_module.strict_loading,
            average=active_average(trainer.callbacks) if fitting and trainer is not None else None,
            resuming=fitting,
        )

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


def parameters_by_state_key(module: Any) -> dict[str, str]:
    """For each key of ``module.state_dict()`` that holds a parameter, that parameter's name in
    ``module.named_parameters()``.

    [Note: a module's own state_dict names]
    A checkpoint holds exactly the keys ``module.state_dict()`` gives, which are the parameter names unless the module
    overrides ``state_dict`` (litgpt's ``LLM`` drops a level: ``llm.transformer...`` for the parameter
    ``llm.model.transformer...``). Engines name their masters and chunks by parameter name; a strategy that puts them
    into the checkpoint maps them onto the module's own keys by identity, through this, rather than adding the
    parameter names beside them (a strict load of the checkpoint would then find unexpected keys).
    """
    names = {id(parameter): name for name, parameter in module.named_parameters(remove_duplicate=False)}
    return {
        key: names[id(value)] for key, value in module.state_dict(keep_vars=True).items() if id(value) in names
    }


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
