"""The Lightning Fabric strategy base: the Trainer strategies' mode logic driven from a hand-written loop.

[Note: one mode, two front doors]
Lightning has two strategy class trees, the Trainer's (``lightning.pytorch``) and Fabric's, and neither inherits from
the other. A mode's logic (how its engine is built over a module and an optimizer, how its weights and optimizer
state map to checkpoint names, how it clips, syncs and re-syncs) lives once, in the Trainer strategy of that mode
(``strategies/``), whose hooks take the module it was connected to and no Trainer. A Fabric strategy holds an
instance of it (``mode``), connects the user's module to it, shares its process group, mesh, watchdog, precision
plugin and checkpoint format, and translates Fabric's calls (``setup_module``, ``setup_optimizer``, ``backward``,
``optimizer_step``, ``clip_gradients_*``, ``no_backward_sync``, ``save``/``load``) into that mode's hooks. Each mode
subclass (``fabric/modes.py``) adds only what Fabric's loop shape needs of it: what wraps the module, when the engine
is built, what runs around a forward and a backward.

Fabric never calls ``teardown()``: the watchdog is stopped at interpreter exit (a clean stop, so a peer that exits
first is not reported as lost), and ``strategy.teardown()`` may be called by hand to release the engine earlier.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.strategies import ParallelStrategy
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_colossal.distributed import group_cache
from lightning_colossal.engine_parts.running_statistics import modules_with_running_statistics
from lightning_colossal.fabric import checkpoints
from lightning_colossal.fabric.launcher import FabricNotebookLauncher, FabricScriptLauncher, watch_this_process
from lightning_colossal.fabric.precision import FabricPrecision, to_fabric_precision
from lightning_colossal.precision import LocalGradientClipper
from lightning_colossal.strategies._lightning_private import _BackwardSyncControl
from lightning_colossal.strategies.base import ColossalStrategy


class ColossalFabricStrategy(ParallelStrategy):
    """Base of the Fabric strategies ([Note: one mode, two front doors]); not registered itself.

    It takes the arguments of its mode's Trainer strategy (``trainer_strategy``), which lists them.
    """

    #: The Trainer strategy whose mode logic this Fabric strategy drives.
    trainer_strategy: ClassVar[type[ColossalStrategy]]

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        **mode_arguments: Any,
    ) -> None:
        if mode_arguments.get("async_checkpoint"):
            raise ValueError(
                f"{type(self).__name__}(async_checkpoint=True): background saves are written under the Trainer only"
                " (where the end of `fit` waits for them); a Fabric loop has no such point. Drop async_checkpoint;"
                " `fabric.save` writes synchronously."
            )
        # First: the properties below (set by Fabric's base constructor) write through to it.
        self.mode = self.trainer_strategy(**mode_arguments)
        self.mode.steps_without_trainer = 0
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._module: Module | None = None  # the user's module, once set up
        self._wrapped: Module | None = None  # what Fabric calls forward on
        self._names_before_setup: dict[int, str] = {}
        self._backward_sync_control = _SkipGradientSync(self)

    # ---------------------------------------------------------------------------------------------- what the mode holds
    @property
    def accelerator(self) -> Any:
        return self.mode.accelerator

    @accelerator.setter
    def accelerator(self, accelerator: Any) -> None:
        self.mode.accelerator = accelerator

    @property
    def cluster_environment(self) -> Any:  # type: ignore[override]
        return self.mode.cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, environment: Any) -> None:
        self.mode.cluster_environment = environment

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        return self.mode.parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        self.mode.parallel_devices = devices

    @property
    def _num_nodes(self) -> int:  # Fabric's connector sets this name
        return self.mode.num_nodes

    @_num_nodes.setter
    def _num_nodes(self, num_nodes: int) -> None:
        self.mode.num_nodes = num_nodes

    @property
    def num_nodes(self) -> int:
        return self.mode.num_nodes

    @property
    def num_processes(self) -> int:
        return self.mode.num_processes

    @property
    def root_device(self) -> torch.device:
        return self.mode.root_device

    @property
    def precision(self) -> FabricPrecision:  # type: ignore[override]
        plugin = self.mode.precision_plugin
        assert isinstance(plugin, FabricPrecision), "the mode's plugin is always set through this property"
        return plugin

    @precision.setter
    def precision(self, plugin: Any) -> None:
        self.mode.precision_plugin = to_fabric_precision(plugin, self.mode._loss_scaler_config)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return self.mode.distributed_sampler_kwargs

    @property
    def engine(self) -> Any:
        """The engine of the one optimizer set up (ZeRO, Gemini), the list of them with several optimizers (ZeRO);
        ``None`` before ``setup_optimizers`` and in modes without one."""
        engines = getattr(self.mode, "engines", [])  # (DDP and FSDP run no engine)
        return engines[0] if len(engines) == 1 else (engines or None)

    # ---------------------------------------------------------------------------------------------- processes
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self.mode._start_method == "popen":
            self._launcher = FabricScriptLauncher(self)
        else:
            self._launcher = FabricNotebookLauncher(self, self.mode._start_method)

    def _set_world_ranks(self) -> None:
        self.mode.set_world_ranks()

    def setup_environment(self) -> None:
        # The process group with the collective timeout, the mesh and the watchdog: the Trainer strategy's own.
        self.mode.setup_environment()
        plugin = self.precision
        plugin.device_type = self.root_device.type
        plugin.process_group = None  # every rank takes part in the overflow vote
        if self.mode._on_nonfinite is not None:
            plugin.on_nonfinite = self.mode._on_nonfinite
        watch_this_process(self)  # fabric/launcher.py [Note: failures in a Fabric loop]

    def report_failure(self, error: Exception) -> None:
        """Add to ``error`` where it left this rank's run, and the watchdog's word on a peer that stopped, once
        (fabric/launcher.py [Note: failures in a Fabric loop])."""
        if getattr(error, "_lightning_colossal_reported", False):
            return
        error._lightning_colossal_reported = True  # type: ignore[attr-defined]
        group_cache.run_ended(cleanly=False)
        self.mode._annotate_failure(error)

    def all_reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        return self.mode.reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return self.mode.all_gather(tensor, group=group, sync_grads=sync_grads)

    def barrier(self, name: str | None = None) -> None:
        self.mode.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self.mode.broadcast(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        votes = self.all_reduce(torch.tensor(int(decision), device=self.root_device), reduce_op="sum")
        return bool(votes == self.world_size) if all else bool(votes)

    # ---------------------------------------------------------------------------------------------- set-up
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        if self.mode.materialises_meta_models and empty_init:
            # Shapes only, on the meta device: the engine gives each rank's shards their values.
            return self.mode.tensor_init_context(empty_init=True)
        return super().module_init_context(empty_init)

    def module_to_device(self, module: Module) -> None:
        if self.is_set_up(module):
            return  # placed by setup_module
        # Fabric moves the model before setting it up: a model on the meta device stays there for the engine.
        self.mode.place_module(module)

    def setup_module_and_optimizers(
        self, module: Module, optimizers: list[Optimizer], scheduler: Any = None
    ) -> tuple[Module, list[Optimizer], Any]:
        wrapped = self.setup_module(module)
        return wrapped, [self._take_optimizer(optimizer) for optimizer in optimizers], scheduler

    def setup_module(self, module: Module) -> Module:
        if self._module is not None:
            raise ValueError(
                f"{type(self).__name__} sets up one model: a second `fabric.setup` / `fabric.setup_module` is not"
                " supported. Hold the models in one nn.Module (e.g. a policy and a frozen reference as two"
                " attributes) and set that up, with one optimizer over the parameters that train."
            )
        module = self.precision.convert_module(module)
        self.mode.connect(module)  # the mode's hooks read the module it was connected to
        self.mode.model_to_device()
        self.mode._running_statistics = (
            [] if self.mode.wrapper_syncs_buffers else modules_with_running_statistics(module)
        )
        self._module = module
        self._names_before_setup = {id(parameter): name for name, parameter in module.named_parameters()}
        # The mode's own wrapper (DDP) or the module itself, as the Trainer strategy holds it (engines name optimizer
        # state and masters after it); Fabric calls forward on the contexts around it.
        self.mode.model = self._prepare_model(module)
        self._wrapped = ForwardContexts(self.mode.model, self)
        return self._wrapped

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return self._take_optimizer(optimizer)

    def _take_optimizer(self, optimizer: Optimizer) -> Optimizer:
        if self._module is None:
            raise RuntimeError("Set up the model before its optimizer: `fabric.setup_module(model)` first.")
        self._point_at_set_up_parameters(optimizer)
        optimizer = self._adopt_optimizer(optimizer)
        self.mode.optimizers = [*self.mode.optimizers, optimizer]
        return optimizer

    def _prepare_model(self, module: Module) -> Module:
        """The model as the mode runs it: its own wrapper (DDP), or the module itself (sharded in place or not)."""
        return module

    def is_set_up(self, module: Module) -> bool:
        """Whether ``module`` is the model this strategy set up (as the user built it, or as a wrapper of it)."""
        return any(module is each for each in (self._module, self.mode.model, self._wrapped))

    def _point_at_set_up_parameters(self, optimizer: Optimizer) -> None:
        """An optimizer made before the model was set up (``fabric.setup(model, optimizer)``) holds the parameters a
        mode that splits or shards the model replaced (FSDP2's DTensors, tensor-parallel pieces): point it at the
        set-up ones, by name, as a Trainer's ``configure_optimizers`` (run after the split) would have."""
        assert self._module is not None
        current = dict(self._module.named_parameters())
        for group in optimizer.param_groups:
            replaced = []
            for parameter in group["params"]:
                name = self._names_before_setup.get(id(parameter))
                if name is not None and name in current and current[name] is not parameter:
                    if optimizer.state.get(parameter):
                        raise ValueError(
                            "The optimizer already holds state for the parameters the model had before set-up: set up"
                            " the model and the optimizer before the first step."
                        )
                    parameter = current[name]
                replaced.append(parameter)
            group["params"] = replaced

    def _adopt_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The optimizer the loop steps, once the mode took it over (by default, as it is)."""
        return optimizer

    # ---------------------------------------------------------------------------------------------- around a forward
    @contextmanager
    def forward_context(self, module: Module) -> Generator[None, None, None]:
        """Around every forward of the set-up model (``ForwardContexts``); by default what the Trainer runs before a
        training step: the first replica's running statistics copied to every replica."""
        if module.training:
            self.mode._follow_first_replica_statistics()
        yield

    def after_forward(self) -> None:
        """After every forward of the set-up model."""

    def convert_output(self, output: Any) -> Any:
        """What the loop gets from a forward of the set-up model (by default what the model returned)."""
        return output

    # ---------------------------------------------------------------------------------------------- steps
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        self.mode._publish_step()
        tensor = self.before_backward(tensor)
        self.precision.backward(tensor, module, *args, **kwargs)
        self.after_backward(tensor)

    def before_backward(self, loss: Tensor) -> Tensor:
        """What the mode does to (or with) the loss before its backward."""
        return loss

    def after_backward(self, loss: Tensor) -> None:
        """What the mode does after a backward."""

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        output = self.precision.optimizer_step(optimizer, **kwargs)
        engines = getattr(self.mode, "engines", [])
        if engines:
            self.mode.engine_of(optimizer).after_step(stepped=not self.precision.last_step_skipped)
        self.mode.steps_without_trainer = (self.mode.steps_without_trainer or 0) + 1
        return output

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        clipper = self.precision.gradient_clipper
        if float(norm_type) == 2.0:
            norm = clipper.clip_by_norm(optimizer, float(max_norm))
        elif isinstance(clipper, LocalGradientClipper) and not self.mode.parameter_pieces():
            # Every rank holds whole reduced gradients: torch's own clipping is exact for any p.
            parameters = self.precision.main_params(optimizer)
            return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite)
        else:
            raise ValueError(
                f"{type(self).__name__} clips by the L2 norm only (norm_type=2.0), computed over every rank's shards;"
                f" norm_type={norm_type} is not supported. Clip with norm_type=2.0, or by value"
                " (`fabric.clip_gradients(model, optimizer, clip_val=...)`)."
            )
        if error_if_nonfinite and not bool(torch.isfinite(norm)):
            raise RuntimeError(
                f"The total norm of the gradients is {norm.item()}: non-finite, so they were not clipped usefully. Do not"
                " step on them (lower the learning rate, check the batch), or pass `error_if_nonfinite=False` to"
                " `fabric.clip_gradients` and let the strategy's `on_nonfinite` setting decide at the step."
            )
        return norm

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        self.precision.unscale_gradients(optimizer)
        self.precision.gradient_clipper.clip_by_value(optimizer, float(clip_val))

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Any] | None = None,
    ) -> None:
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}: `storage_options` is not supported; lightning_colossal writes its own sharded"
                " format. Drop storage_options."
            )
        checkpoints.save(self, path, state, filter or {})

    def load_checkpoint(
        self,
        path: str | Path,
        state: Module | Optimizer | dict[str, Any] | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        return checkpoints.load(self, path, state, strict, weights_only)

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The whole weights on every rank, as plain CPU tensors (a collective when weights are sharded)."""
        return self.mode.full_model_state_dict()

    def load_module_state_dict(self, module: Module, state_dict: dict[str, Any], strict: bool = True) -> None:
        self.mode._load_full_model_state(state_dict, strict)

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name (this rank's shards where the engine shards it)."""
        return self.mode.optimizer_names_and_state(optimizer)

    # ---------------------------------------------------------------------------------------------- teardown
    def teardown(self) -> None:
        """Release the engine, stop the watchdog (Fabric itself never calls this; see the module docstring)."""
        self.mode.teardown()


class ForwardContexts(Module):
    """Runs the strategy's contexts around every forward of the user's module (``ColossalFabricStrategy.
    forward_context`` and ``after_forward``), as the Trainer strategies do around a training step."""

    def __init__(self, module: Module, strategy: ColossalFabricStrategy) -> None:
        super().__init__()
        self.module = module
        # Not a submodule attribute: the strategy is no part of the model.
        object.__setattr__(self, "_strategy", strategy)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        strategy: ColossalFabricStrategy = object.__getattribute__(self, "_strategy")
        with strategy.forward_context(self.module):
            output = self.module(*args, **kwargs)
        strategy.after_forward()
        return strategy.convert_output(output)


class _SkipGradientSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: the mode's own way to skip gradient communication on a non-final
    micro-batch (engines' ``no_sync()``, DDP's, FSDP's ``set_requires_gradient_sync``)."""

    def __init__(self, strategy: ColossalFabricStrategy) -> None:
        self._strategy = strategy

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return self._strategy.mode.block_backward_sync() if enabled else nullcontext()


__all__ = ["ColossalFabricStrategy", "ForwardContexts"]
