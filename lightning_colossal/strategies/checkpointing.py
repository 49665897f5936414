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
    TrainingTensors,
)
from lightning_colossal.checkpoint.huggingface import describe_huggingface_model
from lightning_colossal.checkpoint.sharded import (
    remove_checkpoint,
    save_sharded,
)
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices
from lightning_colossal.strategies._lightning_private import _collect_rng_states
from lightning_colossal.strategies.checkpoint_loading import CheckpointLoadingMixin
from lightning_colossal.strategies.optimizers import unwrap_optimizer
from lightning_colossal.strategies.weight_averaging import active_average


class CheckpointingMixin(CheckpointLoadingMixin):
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
    return {key: names[id(value)] for key, value in module.state_dict(keep_vars=True).items() if id(value) in names}
