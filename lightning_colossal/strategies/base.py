"""The Lightning strategy base shared by every lightning_colossal mode.

It owns what all modes have in common: process-group setup with a collective timeout, the device mesh, Lightning's
launchers (popen for scripts/torchrun/SLURM, spawn, fork for notebooks), the distributed sampler, collectives for
``self.log(sync_dist=True)``, the precision plugin translation, string-name registration and the portable
checkpoint format. A mode subclasses it, implements Lightning's ``setup`` (wrap the model with its engine, build the
optimizers) and fills in the hooks that depend on how it holds weights: ``model_state_for_checkpoint`` and
``_load_full_model_state``, plus ``optimizer_names_and_state`` / ``_load_optimizer_state`` when its optimizer state
is sharded, and ``_build_parallel_dims`` when it splits the world into more than data parallelism.

[Note: who loads checkpoints]
Sharded strategies must load into the *wrapped* model and the *real* optimizers, so ``restore_checkpoint_after_setup``
is True and ``load_checkpoint`` itself fills weights, optimizer state and RNG state in place (DCP reshards on the way).
Lightning's ``load_model_state_dict`` / ``load_optimizer_state_dict`` are then no-ops; Lightning still restores loops,
callbacks, LR schedulers and the precision plugin (loss scaler) from the entries ``load_checkpoint`` returns.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device, _init_dist_connection
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states, reset_seed
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import Tensor
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.checkpoint.huggingface import HUGGINGFACE_KEY, describe_huggingface_model
from lightning_colossal.checkpoint.layout import (
    FORMAT_KEY,
    FORMAT_VERSION,
    MODEL_KEY,
    RNG_KEY,
    CheckpointFiles,
    CheckpointKind,
    locate_checkpoint,
    optimizer_key,
    rng_key,
)
from lightning_colossal.checkpoint.optimizer_state import rekey_by_name
from lightning_colossal.checkpoint.sharded import (
    load_file_weights,
    load_metadata,
    load_sharded,
    remove_checkpoint,
    save_sharded,
    saved_keys,
)
from lightning_colossal.config import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    LossScalerConfig,
    NonFiniteAction,
    StartMethod,
    validate_nonfinite_action,
    validate_start_method,
)
from lightning_colossal.distributed import ParallelDims, build_device_mesh, collectives
from lightning_colossal.distributed.meta_init import has_meta_tensors
from lightning_colossal.distributed.watchdog import HeartbeatWatchdog, next_generation
from lightning_colossal.precision import ColossalPrecision, to_colossal_precision
from lightning_colossal.strategies.docstrings import complete_argument_docs
from lightning_colossal.strategies.launcher import FullWeightsMultiProcessingLauncher


class ColossalStrategy(ParallelStrategy):
    """Base of every lightning_colossal strategy; not registered itself.

    Args:
        accelerator: the accelerator (normally chosen by the ``Trainer``).
        parallel_devices: devices of this node (normally chosen by the ``Trainer``).
        cluster_environment: how ranks are found (normally detected: torchrun, SLURM, Lightning's own launcher).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default gloo on CPU and nccl on CUDA.
        timeout: how long a collective may wait before failing instead of hanging.
        start_method: ``"popen"`` (scripts, torchrun, SLURM), ``"spawn"``, or ``"fork"`` (notebooks).
        loss_scaler: dynamic loss scaling settings used by ``precision="16-mixed"``.
        heartbeat_timeout: stop this rank when a peer's heartbeat has been silent this long (a dead or frozen
            process), instead of waiting for ``timeout``; ``None`` turns the watchdog off
            (``distributed/watchdog.py`` [Note: why a watchdog]). Also settable as ``strategy.heartbeat_timeout``.
        on_nonfinite: ``"raise"``, ``"skip"`` or ``"warn"`` on a non-finite loss or gradient without a loss scaler
            (``precision.py`` [Note: non-finite values without a loss scaler]); ``None`` keeps the precision
            plugin's setting (``"raise"`` unless a ``ColossalPrecision`` says otherwise).
    """

    #: Registered string name of the strategy (``*_notebook`` is registered too, with ``start_method="fork"``).
    strategy_name: ClassVar[str] = ""
    #: The engine builds models larger than one rank from the meta device (``Trainer.init_module(empty_init=True)``
    #: or ``torch.device("meta")`` in ``configure_model``): such a model is materialised shard by shard by the engine,
    #: never moved whole to the device.
    materialises_meta_models: ClassVar[bool] = False
    #: Classes describing constructor arguments the strategy forwards (a config); with this base's own docstring
    #: they complete every subclass's ``Args:`` section (``strategies/docstrings.py``).
    argument_doc_sources: ClassVar[tuple[type, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        complete_argument_docs(cls, (*cls.argument_doc_sources, ColossalStrategy))

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
        start_method: StartMethod = "popen",
        loss_scaler: LossScalerConfig | None = None,
        heartbeat_timeout: timedelta | None = DEFAULT_HEARTBEAT_TIMEOUT,
        on_nonfinite: NonFiniteAction | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=None,
            precision_plugin=None,
        )
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = validate_start_method(start_method)
        self._loss_scaler_config = loss_scaler
        self.heartbeat_timeout = heartbeat_timeout
        self._on_nonfinite = None if on_nonfinite is None else validate_nonfinite_action(on_nonfinite)
        self._watchdog: HeartbeatWatchdog | None = None
        self._num_nodes = 1
        self._device_mesh: DeviceMesh | None = None
        self._parallel_dims: ParallelDims | None = None
        # The plugin used when Lightning never hands one over (e.g. the strategy used outside a Trainer).
        self._fallback_precision = ColossalPrecision("32-true", loss_scaler)

    # ---------------------------------------------------------------------------------------------- properties
    @property
    def is_distributed(self) -> bool:
        # Lightning adds the DistributedSampler and makes sync_dist reduce only when this is True.
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "parallel_devices are set by the Trainer before use"
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh of all parallel axes (``pp``, ``dp``, ``sp``, ``tp``); exists after ``setup_environment``."""
        if self._device_mesh is None:
            raise RuntimeError(
                "The device mesh exists only after the Trainer set up the processes (in or after `setup`)."
            )
        return self._device_mesh

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("Parallel sizes are known only after the Trainer set up the processes.")
        return self._parallel_dims

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that hold the same data-parallel replica (tensor/sequence/pipeline peers) must read the same batches.
        data_parallel = self.device_mesh["dp"]
        return {"num_replicas": data_parallel.size(), "rank": data_parallel.get_local_rank()}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False

    # ---------------------------------------------------------------------------------------------- precision
    @property
    def precision_plugin(self) -> ColossalPrecision:  # type: ignore[override]
        plugin = self._precision_plugin
        return plugin if isinstance(plugin, ColossalPrecision) else self._fallback_precision

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        # None must stay None: Lightning treats a plugin already on the strategy as the user's choice and would then
        # ignore Trainer(precision=...). Anything else is translated (never silently dropped).
        self._precision_plugin = (
            None if plugin is None else to_colossal_precision(plugin, getattr(self, "_loss_scaler_config", None))
        )

    # ---------------------------------------------------------------------------------------------- processes
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = FullWeightsMultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # rank_zero_only is a decorated function carrying a `rank` attribute that mypy cannot see.
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        self._validate_devices()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        self._validate_world_size()
        self._parallel_dims = self._build_parallel_dims()
        self._device_mesh = build_device_mesh(self._parallel_dims, self.root_device, self._timeout)
        if self.lightning_module is not None:
            # LightningModule.device_mesh: lets configure_model() parallelise against our mesh.
            self.lightning_module._device_mesh = self._device_mesh
        self._start_watchdog()

    def _start_watchdog(self) -> None:
        """Heartbeat to the other ranks through the process group's store (``distributed/watchdog.py``)."""
        self._stop_watchdog(clean=True)  # a watchdog left by an earlier Trainer call in this process
        # Counted on every rank, so all ranks use the same keys even when this one runs without a watchdog.
        generation = next_generation()
        if self.heartbeat_timeout is None or collectives.world_size() < 2:
            return
        from torch.distributed.distributed_c10d import _get_default_store

        self._watchdog = HeartbeatWatchdog(
            _get_default_store(),
            rank=self.global_rank,
            world_size=collectives.world_size(),
            timeout=self.heartbeat_timeout,
            current_step=self._current_global_step,
            prefix=f"lightning_colossal/watchdog/{generation}",
        ).start()

    def _stop_watchdog(self, clean: bool, wait_for_failure: float = 0.0) -> str | None:
        watchdog, self._watchdog = self._watchdog, None
        return None if watchdog is None else watchdog.stop(clean=clean, wait_for_failure=wait_for_failure)

    def _current_global_step(self) -> int | None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        return None if trainer is None else trainer.global_step

    def teardown(self) -> None:
        self._finish_watchdog()
        super().teardown()

    def _failure_being_torn_down(self) -> BaseException | None:
        """The error that ended this run, when teardown follows a failed run (else ``None``).

        Lightning tears down inside its ``except`` block after a failed run, so the error is at hand here even in
        modes whose ``on_exception`` does not call this class's (ddp, fsdp). After a failure other ranks may never
        reach a collective, so teardown must not start one.
        """
        failure = sys.exc_info()[1]
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        interrupted = trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED
        # (an error the caller was handling around a successful run is not this run's failure)
        return failure if failure is not None and interrupted else None

    def _finish_watchdog(self) -> None:
        """Stop the watchdog; after a failed run, first let it name a lost peer in the error (teardown calls this)."""
        failure = self._failure_being_torn_down()
        if failure is None:
            self._stop_watchdog(clean=True)
        else:
            self._annotate_failure(failure)

    def _annotate_failure(self, exception: BaseException) -> None:
        """Say where an error left this rank's run, so a collective timeout or a peer's crash reads with its step.

        When the error looks like a lost peer, the watchdog gets a moment to name the rank that stopped (one heartbeat
        interval finds a dead process on this host) before the error propagates.
        """
        watchdog = self._watchdog
        wait = 2 * watchdog.interval + 0.5 if watchdog is not None and _looks_like_lost_peer(exception) else 0.0
        report = self._stop_watchdog(clean=False, wait_for_failure=wait)
        exception.add_note(
            f"lightning_colossal: raised on rank {self.global_rank} at global step {self._current_global_step()}."
        )
        if report is not None:
            exception.add_note(f"lightning_colossal watchdog: {report}.")

    def _build_parallel_dims(self) -> ParallelDims:
        """The parallel layout of this mode; data parallel over every rank unless a subclass says otherwise."""
        return ParallelDims(world_size=self.world_size)

    def _validate_devices(self) -> None:
        assert self.parallel_devices is not None
        if self.local_rank >= len(self.parallel_devices):
            raise ValueError(
                f"This process has local rank {self.local_rank} but the Trainer was given {len(self.parallel_devices)}"
                " device(s) per node: set `Trainer(devices=...)` to the number of processes per node that your"
                " launcher (torchrun --nproc-per-node, SLURM --ntasks-per-node) starts."
            )
        device = self.root_device
        if device.type == "cpu" and self.local_rank == 0:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            if self.num_processes > cores:
                # Not an error: oversubscribing is how multi-rank code is tested on small machines.
                rank_zero_warn(
                    f"Trainer(devices={self.num_processes}) starts {self.num_processes} CPU processes on {cores} cores:"
                    f" they share cores and train slower than devices={cores} would."
                )
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(
                f"Trainer(devices={len(self.parallel_devices)}) asks for GPU {device.index} but this machine has"
                f" {torch.cuda.device_count()}: pass `devices` <= {torch.cuda.device_count()}."
            )

    def _validate_world_size(self) -> None:
        actual = collectives.world_size()
        if actual != self.world_size:
            raise ValueError(
                f"The process group has {actual} processes but the Trainer expects num_nodes * devices ="
                f" {self.num_nodes} * {self.num_processes} = {self.world_size}: make `Trainer(devices=..., num_nodes=...)`"
                " match the number of processes you launched."
            )

    def _prepare_module(self, trainer: Any) -> bool:
        """The start every mode's ``setup`` shares: accelerator, SyncBatchNorm (when fitting), precision, device.

        Returns:
            Whether the Trainer is fitting (engines wrap the model and build optimizers only then).
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        return fitting

    def _setup_single_optimizer(self, trainer: Any, manual_reason: str, manual_alternatives: str) -> Optimizer:
        """Build the one optimizer a sharding engine takes over; refuse manual optimization and several optimizers.

        Args:
            manual_reason: why the engine cannot leave the step to the user (what it owns).
            manual_alternatives: the strategy names to use instead for manual optimization.
        """
        assert self.lightning_module is not None
        name = type(self).__name__
        several_optimizers = (
            f"{name} shards exactly one optimizer, and manual optimization (which Lightning suggests for several"
            f" optimizers) is not supported either ({manual_reason}). Put all parameters into one optimizer with one"
            " param group per setting, e.g. `torch.optim.AdamW([{'params': self.encoder.parameters()}, {'params':"
            f" self.head.parameters(), 'lr': 1e-3}}])`, or train with {manual_alternatives}, which take several"
            " optimizers under manual optimization."
        )
        automatic = self.lightning_module.automatic_optimization
        try:
            # Under manual optimization Lightning accepts several optimizers, so count them before refusing: a user
            # with two optimizers must hear about both limits at once, not be sent from one refusal to the other.
            self.setup_optimizers(trainer)
        except RuntimeError as error:
            # Lightning refuses several optimizers under automatic optimization by telling the user to switch to
            # manual optimization, which this strategy refuses next: replace that advice with the fix that works.
            if automatic and "multiple optimizers" in str(error):
                raise ValueError(several_optimizers) from error
            raise
        if len(self.optimizers) != 1:
            raise ValueError(f"`configure_optimizers` returned {len(self.optimizers)} optimizers. {several_optimizers}")
        if not automatic:
            raise ValueError(
                f"{name} does not support manual optimization ({manual_reason}). Use automatic optimization, or"
                f" {manual_alternatives} for manual optimization."
            )
        return _unwrap_optimizer(self.optimizers[0])

    def _drop_optimizers_of_earlier_fit(self) -> None:
        """Forget optimizers left over from an earlier ``fit`` when this stage (validate/test/predict) builds none.

        Their parameter lists point at the earlier engine's shards, which this stage no longer drives, so their state
        can neither be saved by name nor resumed: ``trainer.save_checkpoint`` now writes the weights only.
        """
        self.optimizers = []
        self.lr_scheduler_configs = []

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        plugin = self.precision_plugin
        plugin.device_type = self.root_device.type
        plugin.process_group = None  # every rank takes part in the overflow vote (see precision.py)
        if self._on_nonfinite is not None:
            plugin.on_nonfinite = self._on_nonfinite

    # ---------------------------------------------------------------------------------------------- collectives
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor):
            return tensor
        if isinstance(tensor, DTensor):
            # e.g. a loss computed under tensor parallelism's loss_parallel (replicated over the tp ranks)
            tensor = tensor.full_tensor()
        op = reduce_op if isinstance(reduce_op, str) else _reduce_op_name(reduce_op)
        return collectives.all_reduce(tensor.clone(), op=op or "mean", group=group)

    def barrier(self, name: str | None = None) -> None:
        collectives.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return collectives.broadcast_object(obj, source_rank=src)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return collectives.all_gather_tensor(tensor, group=group, sync_grads=sync_grads)

    def model_to_device(self) -> None:
        assert self.model is not None
        if self.materialises_meta_models and has_meta_tensors(self.model):
            return  # the engine materialises this rank's shards on the device
        self.model.to(self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        if not self.materialises_meta_models:
            with super().tensor_init_context(empty_init):
                yield
            return
        # empty_init=True: shapes only, on the meta device; the engine gives each rank's shards their values.
        device = torch.device("meta") if empty_init else self.root_device
        with device, self.precision_plugin.tensor_init_context():
            yield

    # ---------------------------------------------------------------------------------------------- registration
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``strategy_name`` (popen) and ``strategy_name + "_notebook"`` (fork), once per process."""
        for name, init_params in cls.registry_entries():
            for suffix, start_method in (("", "popen"), ("_notebook", "fork")):
                full_name = name + suffix
                if full_name in strategy_registry:
                    continue  # importing lightning_colossal twice (or in every popen child) must be harmless
                strategy_registry.register(
                    full_name,
                    cls,
                    description=f"lightning_colossal {cls.__name__} ({start_method} launcher)",
                    start_method=start_method,
                    **init_params,
                )

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        """Names this class is registered under, with the constructor arguments each name implies."""
        return [(cls.strategy_name, {})] if cls.strategy_name else []

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        """This rank's model tensors by LightningModule parameter name (full, or shards the engine describes).

        Loading fills these same tensors in place, so they must alias the live parameters.
        """
        raise NotImplementedError(f"{type(self).__name__} must say how its weights map to names.")

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
        return get_optimizer_state_dict(self.lightning_module, _unwrap_optimizer(optimizer))

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        assert self.lightning_module is not None
        set_optimizer_state_dict(self.lightning_module, _unwrap_optimizer(optimizer), state)

    def full_model_state_dict(self) -> dict[str, Tensor]:
        """The full, unsharded weights as CPU tensors, on every rank (a collective when weights are sharded)."""
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        gathered = {name: value.full_tensor() if isinstance(value, DTensor) else value for name, value in state.items()}
        return {name: value.detach().cpu() for name, value in gathered.items()}

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
        path = Path(self.broadcast(str(filepath)))
        tensor_state: dict[str, Any] = {MODEL_KEY: checkpoint.pop("state_dict")}
        optimizer_states = checkpoint.pop("optimizer_states", None)
        for index, state in enumerate(optimizer_states or []):
            tensor_state[optimizer_key(index)] = state
        tensor_state[RNG_KEY] = {rng_key(self.global_rank): _collect_rng_states(include_cuda=torch.cuda.is_available())}
        checkpoint[FORMAT_KEY] = {
            "format_version": FORMAT_VERSION,
            "strategy": type(self).__name__,
            "world_size": self.world_size,
            "num_optimizers": len(optimizer_states or []),
            "parallel_dims": self.parallel_dims.axis_sizes() if self._parallel_dims is not None else None,
        }
        huggingface = describe_huggingface_model(self.lightning_module) if self.lightning_module is not None else None
        if huggingface is not None:
            # What `consolidate --format huggingface` needs to write a from_pretrained directory.
            checkpoint[FORMAT_KEY][HUGGINGFACE_KEY] = huggingface
        save_sharded(path, tensor_state, checkpoint)

    def remove_checkpoint(self, filepath: str | Path) -> None:
        # A checkpoint is its file and its shards directory (see checkpoint/layout.py); Lightning would delete the file.
        if self.is_global_zero:
            remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        trainer = self.lightning_module._trainer
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        strict = self.lightning_module.strict_loading
        files = locate_checkpoint(path)
        if files.kind is CheckpointKind.FULL:
            return self._load_full_checkpoint(path, weights_only, fitting, strict)
        if not files.has_shards:
            return self._load_checkpoint_file_without_shards(files, weights_only, fitting, strict)
        return self._load_sharded_checkpoint(files, weights_only, fitting, strict)

    def _load_checkpoint_file_without_shards(
        self, files: CheckpointFiles, weights_only: bool | None, fitting: bool, strict: bool
    ) -> dict[str, Any]:
        """A checkpoint file copied without its shards: its full weights serve validate/test/predict, not resuming."""
        if fitting:
            raise FileNotFoundError(
                f"{files.path} holds the full weights, but its sharded training state (optimizer, random state) is"
                f" missing: expected at {files.shards}. Copy that directory next to the file to resume, or start a new"
                " run from these weights: `Module.load_from_checkpoint(path)`, then `trainer.fit(module)` without"
                " ckpt_path."
            )
        self._load_full_model_state(load_file_weights(files), strict)
        metadata = load_metadata(files, weights_only)
        metadata.pop(FORMAT_KEY, None)
        return metadata

    def _load_sharded_checkpoint(
        self, files: CheckpointFiles, weights_only: bool | None, fitting: bool, strict: bool
    ) -> dict[str, Any]:
        path, shards = files.path, files.shards
        assert shards is not None
        available = saved_keys(shards)
        model_state = self.model_state_for_checkpoint()
        _check_model_keys(
            path, {f"{MODEL_KEY}.{name}" for name in self.whole_model_keys(model_state)}, available, strict
        )
        metadata = load_metadata(files, weights_only)
        tensor_state: dict[str, Any] = {MODEL_KEY: model_state}
        optimizers = self.optimizers if fitting else []
        if optimizers:
            saved_count = metadata.get(FORMAT_KEY, {}).get("num_optimizers", 0)
            _check_optimizer_count(path, saved_count, len(optimizers))
            for index, optimizer in enumerate(optimizers):
                tensor_state[optimizer_key(index)] = self.optimizer_names_and_state(optimizer)
        own_rng = rng_key(self.global_rank)
        restores_rng = any(key.startswith(f"{RNG_KEY}.{own_rng}.") for key in available)
        if restores_rng:
            tensor_state[RNG_KEY] = {own_rng: _collect_rng_states(include_cuda=torch.cuda.is_available())}
        load_sharded(shards, tensor_state, allow_partial=not strict)
        self._on_model_state_loaded()
        for index, optimizer in enumerate(optimizers):
            self._load_optimizer_state(optimizer, tensor_state[optimizer_key(index)])
        if restores_rng:
            _set_rng_states(tensor_state[RNG_KEY][own_rng])
        elif fitting:
            rank_zero_warn(
                f"{path} was saved at world size {metadata.get(FORMAT_KEY, {}).get('world_size')} and holds no random"
                " state for some ranks of this run: those ranks continue from their seeded random state."
            )
        return metadata

    def _load_full_checkpoint(
        self, path: Path, weights_only: bool | None, fitting: bool, strict: bool
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
        optimizers = self.optimizers if fitting else []
        if optimizers:
            _check_optimizer_count(path, len(optimizer_states or []), len(optimizers))
            for optimizer, saved in zip(optimizers, optimizer_states or [], strict=True):
                names = [group["params"] for group in self.optimizer_names_and_state(optimizer)["param_groups"]]
                self._load_optimizer_state(optimizer, rekey_by_name(saved, names))
        return checkpoint


def _looks_like_lost_peer(exception: BaseException) -> bool:
    # Gloo: "Connection reset by peer", "Connection closed by peer"; NCCL and c10d: DistError subclasses, timeouts.
    if isinstance(exception, torch.distributed.DistError):
        return True
    text = str(exception)
    return isinstance(exception, RuntimeError) and any(
        marker in text for marker in ("by peer", "Connection refused", "Broken pipe", "Timed out", "timed out")
    )


def _unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _reduce_op_name(reduce_op: Any) -> str | None:
    if reduce_op is None:
        return None
    name = str(reduce_op).split(".")[-1].lower()
    return {"avg": "mean", "sum": "sum", "max": "max", "min": "min", "product": "product"}.get(name, name)


def _check_model_keys(path: Path, expected: set[str], available: set[str], strict: bool) -> None:
    saved_model_keys = {key for key in available if key.startswith(f"{MODEL_KEY}.")}
    missing = sorted(expected - saved_model_keys)
    unexpected = sorted(saved_model_keys - expected)
    if not saved_model_keys:
        raise ValueError(f"{path} holds no model weights: it is not a lightning_colossal training checkpoint.")
    if strict and (missing or unexpected):
        prefix = len(MODEL_KEY) + 1
        raise RuntimeError(
            f"Error loading {path}: missing keys {[key[prefix:] for key in missing[:10]]}"
            f"{' ...' if len(missing) > 10 else ''}, unexpected keys {[key[prefix:] for key in unexpected[:10]]}"
            f"{' ...' if len(unexpected) > 10 else ''}. The model differs from the one that was saved; set"
            " `self.strict_loading = False` in your LightningModule to load the matching weights only."
        )


def _check_optimizer_count(path: Path, saved: int, expected: int) -> None:
    if saved == 0:
        raise KeyError(
            f"{path} holds no optimizer state (saved with weights_only=True?), so training cannot resume from it. Load"
            " the weights with `LightningModule.load_state_dict` (or consolidate the checkpoint first) and call"
            " `fit` without ckpt_path."
        )
    if saved != expected:
        raise ValueError(
            f"{path} holds {saved} optimizer(s) but `configure_optimizers` returned {expected}: return the same"
            " optimizers as the run that saved the checkpoint."
        )
