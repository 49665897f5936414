"""The Lightning strategy base shared by every lightning_colossal mode.

``ColossalStrategy`` owns what all modes have in common. Its parts live in modules named for what they own:

- ``processes.py``: launchers (popen for scripts/torchrun/SLURM, spawn, fork for notebooks), the process group with
  a collective timeout, ranks, the device mesh, the distributed sampler, and collectives for
  ``self.log(sync_dist=True)``;
- ``failures.py``: the heartbeat watchdog and the notes that say where a failed run stopped;
- ``checkpointing.py``: the portable checkpoint format ([Note: who loads checkpoints] there);
- this module: the constructor arguments every mode shares, the precision plugin translation, the set-up steps the
  modes share, meta-device models and string-name registration.

A mode subclasses it, implements Lightning's ``setup`` (wrap the model with its engine, build the optimizers; the
engines that take over the optimizer do it through ``EngineStrategy`` in ``engine_strategy.py``) and fills in the
hooks that depend on how it holds weights: ``model_state_for_checkpoint`` and ``_load_full_model_state``, plus
``optimizer_names_and_state`` / ``_load_optimizer_state`` when its optimizer state is sharded, and
``_build_parallel_dims`` when it splits the world into more than data parallelism. A mode's constructor takes its own
arguments and forwards ``**kwargs`` to ``super().__init__``: LightningCLI (jsonargparse) follows that call and lists
the base's arguments with their descriptions, and ``docstrings.py`` adds them to the mode's ``Args:`` section.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_colossal.config import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    LossScalerConfig,
    NonFiniteAction,
    StartMethod,
    validate_nonfinite_action,
    validate_start_method,
)
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_parts.meta_init import has_meta_tensors
from lightning_colossal.engine_parts.pretrained import has_pretrained_weights, materialise_whole
from lightning_colossal.engine_parts.running_statistics import follow_first_replica, modules_with_running_statistics
from lightning_colossal.engine_parts.stand_ins import deferred_of
from lightning_colossal.precision import ColossalPrecision, counted_piece, to_colossal_precision
from lightning_colossal.strategies.callback_refusals import refuse_averaging_callbacks
from lightning_colossal.strategies.checkpointing import CheckpointingMixin
from lightning_colossal.strategies.docstrings import complete_argument_docs
from lightning_colossal.strategies.failures import FailureReportingMixin
from lightning_colossal.strategies.optimizers import OptimizerSetupMixin
from lightning_colossal.strategies.optimizers import unwrap_optimizer as _unwrap_optimizer
from lightning_colossal.strategies.weight_averaging import adopt_averaging_callbacks

__all__ = ["ColossalStrategy", "_unwrap_optimizer"]


class ColossalStrategy(FailureReportingMixin, OptimizerSetupMixin, CheckpointingMixin):
    """Base of every lightning_colossal strategy; not registered itself.

    Args:
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
        async_checkpoint: write checkpoints saved during ``fit`` in the background from host copies, while training
            goes on (as ``Trainer(plugins=[AsyncCheckpointIO()])`` does); the next save, a load and the end of
            ``fit`` wait for it and raise its error (``strategies/checkpointing.py`` [Note: when saves run in the
            background]). Also settable as ``strategy.async_checkpoint``.
        accelerator: the accelerator (normally chosen by the ``Trainer``).
        parallel_devices: devices of this node (normally chosen by the ``Trainer``).
        cluster_environment: how ranks are found (normally detected: torchrun, SLURM, Lightning's own launcher).
    """

    #: Registered string name of the strategy (``*_notebook`` is registered too, with ``start_method="fork"``).
    strategy_name: ClassVar[str] = ""
    #: The engine builds models larger than one rank from the meta device (``Trainer.init_module(empty_init=True)``
    #: or ``torch.device("meta")`` in ``configure_model``): such a model is materialised shard by shard by the engine,
    #: never moved whole to the device.
    materialises_meta_models: ClassVar[bool] = False
    #: The mode's own wrapper copies rank 0's buffers before each forward (torch DDP); the others follow
    #: [Note: running statistics follow the first replica] in ``engine_parts/running_statistics.py``.
    wrapper_syncs_buffers: ClassVar[bool] = False
    _running_statistics: Sequence[torch.nn.Module] = ()  # set by ``_prepare_module``
    #: Classes (or functions) describing constructor arguments the strategy forwards (a config); with this base's own
    #: docstring they complete every subclass's ``Args:`` section (``strategies/docstrings.py``).
    argument_doc_sources: ClassVar[tuple[object, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        complete_argument_docs(cls, (*cls.argument_doc_sources, ColossalStrategy))

    def __init__(
        self,
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
        start_method: StartMethod = "popen",
        loss_scaler: LossScalerConfig | None = None,
        heartbeat_timeout: timedelta | None = DEFAULT_HEARTBEAT_TIMEOUT,
        on_nonfinite: NonFiniteAction | None = None,
        async_checkpoint: bool = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
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
        self.async_checkpoint = bool(async_checkpoint)
        self._watchdog = None
        self._num_nodes = 1
        self._device_mesh = None
        self._parallel_dims = None
        # The plugin used when Lightning never hands one over (e.g. the strategy used outside a Trainer).
        self._fallback_precision = ColossalPrecision("32-true", loss_scaler)
        # The one-time grad_norm warning (``_warn_where_grad_norm_cannot_read``).
        self._grad_norm_check_pending = False
        self._gradient_norm_asked = False
        self._warned_about_grad_norm = False

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

    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        plugin = self.precision_plugin
        plugin.device_type = self.root_device.type
        plugin.process_group = None  # every rank takes part in the overflow vote (see precision.py)
        if self._on_nonfinite is not None:
            plugin.on_nonfinite = self._on_nonfinite

    # ---------------------------------------------------------------------------------------------- set-up
    def teardown(self) -> None:
        # First, while the watchdog still runs: the checkpoint still being written in the background (checkpointing.py).
        error = self._finish_background_save(self._failure_being_torn_down())
        super().teardown()
        if error is not None:
            raise error

    def setup_environment(self) -> None:
        super().setup_environment()
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            # Before Lightning calls the callbacks' `setup`, where WeightAveraging would copy the whole model.
            adopt_averaging_callbacks(trainer.callbacks)

    def weights_for_averaging(self) -> dict[str, Any]:
        """This rank's part of the weights a ``WeightAveraging`` callback averages, by name, aliasing the live
        tensors (``engine_parts/weight_average.py`` [Note: the average lives where the weights live]): by default what
        a checkpoint saves."""
        return self._averageable(self.model_state_for_checkpoint())

    def _averageable(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state``, refused when the disk tier holds some of it."""
        if any(deferred_of(value) is not None for value in state.values()):
            raise ValueError(
                f"A weight-averaging callback cannot average weights the disk tier holds (masters_on_disk=True under"
                f" {self.strategy_name or type(self).__name__}): the average would need them in memory at every step."
                " Keep the masters in memory (masters_on_disk=False) or remove the callback."
            )
        return state

    def after_averaged_weights_written(self) -> None:
        """The tensors of ``weights_for_averaging()`` were written in place (an average swapped in or out): re-sync
        the engine's other copies, as after a checkpoint load."""
        self._on_model_state_loaded()

    def _prepare_module(self, trainer: Any) -> bool:
        """The start every mode's ``setup`` shares: accelerator, SyncBatchNorm (when fitting), precision, device.

        Returns:
            Whether the Trainer is fitting (engines wrap the model and build optimizers only then).
        """
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        pieces = self.parameter_pieces()
        if fitting and pieces is not None:
            refuse_averaging_callbacks(trainer.callbacks, self.strategy_name or type(self).__name__, pieces)
        if fitting and self._layer_sync is not None:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._running_statistics = [] if self.wrapper_syncs_buffers else modules_with_running_statistics(self.model)
        if fitting:
            self._warn_where_grad_norm_cannot_read(trainer)
        return fitting

    def grad_norm_limitation(self) -> str | None:
        """What Lightning's ``grad_norm(module)`` meets in ``on_before_optimizer_step`` under this strategy, when the
        parameters' ``.grad`` is not the whole gradient (``None``: it is, and ``grad_norm`` works)."""
        return None

    def _warn_where_grad_norm_cannot_read(self, trainer: Any) -> None:
        """After the first optimizer step of a fit whose module or callbacks hook ``on_before_optimizer_step`` (where
        Lightning's docs log ``grad_norm(module)``) without asking ``gradient_norm``, warn once when ``.grad`` does not
        hold the whole gradient there (``_grad_norm_limitation_message``).

        Per-parameter DTensor views of the reduced shards were tried: ``grad_norm`` then fails in its own
        ``torch.tensor(list_of_norms)``, which cannot read a DTensor (the same failure under Lightning's FSDP).
        """
        self._grad_norm_check_pending = False
        if self.grad_norm_limitation() is None or self._warned_about_grad_norm:
            return
        hook = "on_before_optimizer_step"
        user_callbacks = [
            callback for callback in trainer.callbacks if not type(callback).__module__.startswith("lightning.")
        ]
        self._grad_norm_check_pending = is_overridden(hook, trainer.lightning_module) or any(
            is_overridden(hook, callback, parent=Callback) for callback in user_callbacks
        )
        self._gradient_norm_asked = False

    def _grad_norm_limitation_message(self) -> str:
        return (
            f"{self.strategy_name or type(self).__name__}: in `on_before_optimizer_step`, {self.grad_norm_limitation()}."
            " To log the gradient norm, log `self.trainer.strategy.gradient_norm(norm_type)` there instead: the norm of"
            " the whole gradient, computed over every rank's shard (call it on every rank); for grad_norm's"
            " per-parameter dict, `self.log_dict(self.trainer.strategy.gradient_norms(self, norm_type))`."
        )

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._grad_norm_check_pending:
            self._grad_norm_check_pending = False
            if not self._gradient_norm_asked:
                self._warned_about_grad_norm = True
                rank_zero_warn(self._grad_norm_limitation_message())
        return output

    # ---------------------------------------------------------------------------------------------- steps
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._follow_first_replica_statistics()
        return super().training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        self._follow_first_replica_statistics_while_fitting()
        return super().validation_step(*args, **kwargs)

    def _follow_first_replica_statistics(self) -> None:
        """engine_parts/running_statistics.py [Note: running statistics follow the first replica]."""
        if self._running_statistics:
            # The mesh's dp axis: the ranks holding the same pieces (the same pipeline stage, the same tensor shard).
            follow_first_replica(self._running_statistics, self.device_mesh["dp"].get_group())

    def _follow_first_replica_statistics_while_fitting(self) -> None:
        """As torch DDP: an evaluation step copies the first replica's statistics during ``fit`` only."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._follow_first_replica_statistics()

    def parameter_pieces(self) -> str | None:
        """What a rank holds of each parameter when not all of it (e.g. ``"only its FSDP shards"``), for errors;
        ``None`` when every rank holds every parameter whole ([Note: weight averaging and sharded parameters])."""
        return None

    def gradient_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole gradient the next optimizer step applies, computed over every rank.

        Call it on every rank (a collective) where gradients are complete and not yet clipped: in
        ``on_before_optimizer_step``, or after ``manual_backward`` in manual optimization. It works the same under
        every strategy, where Lightning's ``grad_norm(module)`` reads ``parameter.grad``: ZeRO-2 and Gemini keep no
        whole ``.grad`` (it finds none and logs nothing) and FSDP keeps DTensor shards (it fails)::

            def on_before_optimizer_step(self, optimizer):
                self.log("gradient_norm", self.trainer.strategy.gradient_norm())

        Args:
            norm_type: 2.0 (the norm gradient clipping uses), any other p >= 1, or ``float("inf")`` (the largest
                element).

        Returns:
            A 0-dimensional float32 tensor, the same on every rank; after a ``16-mixed`` loss scaler has unscaled.
        """
        norm_type = float(norm_type)
        if not norm_type >= 1.0:
            raise ValueError(f"norm_type={norm_type} is not a norm: pass 2.0, another p >= 1, or float('inf').")
        if not self.optimizers:
            raise RuntimeError(
                "gradient_norm() measures the gradients an optimizer will step on, and this run has no optimizer yet:"
                " call it during fit, from on_before_optimizer_step (or after manual_backward)."
            )
        self._gradient_norm_asked = True  # the hook logs the norm the way that works here: no warning
        return self.precision_plugin.gradient_clipper.gradient_norm(_unwrap_optimizer(self.optimizers[0]), norm_type)

    def gradient_norms(
        self, module: torch.nn.Module | None = None, norm_type: float | str = 2.0, group_separator: str = "/"
    ) -> dict[str, torch.Tensor]:
        """Lightning's ``grad_norm(module, norm_type)``, the same keys and values as under ``ddp``, computed from every
        rank's gradient shards: where ``grad_norm`` itself reads ``parameter.grad``, which ZeRO-2 and Gemini leave
        empty and FSDP keeps as DTensor shards. Call it on every rank (one collective), where ``gradient_norm`` can be
        called::

            def on_before_optimizer_step(self, optimizer):
                self.log_dict(self.trainer.strategy.gradient_norms(self, norm_type=2))

        Args:
            module: the LightningModule (default) or one of its submodules; keys name parameters relative to it.
            norm_type: as ``grad_norm``'s: a positive number, or ``"inf"``.
            group_separator: as ``grad_norm``'s, between ``grad_<p>_norm`` and each name.

        Returns:
            ``{"grad_<p>_norm<separator><name>": norm, ..., "grad_<p>_norm_total": norm}`` for the parameters with a
            gradient on any rank, 0-dimensional float32 tensors, the same on every rank.
        """
        norm_type = float(norm_type)
        if not norm_type > 0:
            raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {norm_type}")
        if not self.optimizers:
            raise RuntimeError(
                "gradient_norms() measures the gradients an optimizer will step on, and this run has no optimizer yet:"
                " call it during fit, from on_before_optimizer_step (or after manual_backward)."
            )
        root = self.lightning_module
        assert root is not None
        module = root if module is None else module
        prefix = next((f"{name}." if name else "" for name, each in root.named_modules() if each is module), None)
        if prefix is None:
            raise ValueError(
                "gradient_norms(module) reads the gradients of the LightningModule's parameters: pass the module or one"
                " of its submodules (e.g. self or self.model)."
            )
        names = [name for name, _ in module.named_parameters()]
        pieces, group = self._gradient_pieces()
        self._gradient_norm_asked = True  # the hook logs norms the way that works here: no warning
        norms = sharded_state.norms_by_name(
            [prefix + name for name in names], pieces, group, self.root_device, norm_type
        )
        result = {
            f"grad_{norm_type}_norm{group_separator}{name}": norms[prefix + name]
            for name in names
            if prefix + name in norms
        }
        if result:
            result[f"grad_{norm_type}_norm_total"] = torch.stack(list(result.values())).norm(norm_type)
        return result

    def _gradient_pieces(self) -> tuple[dict[str, torch.Tensor | None], Any]:
        """Per name of a LightningModule parameter with a gradient on this rank, the piece of it this rank counts in
        a sum over all ranks (``precision.counted_piece``), and the group to sum over (the world)."""
        assert self.lightning_module is not None
        pieces = {
            name: counted_piece(parameter.grad)
            for name, parameter in self.lightning_module.named_parameters()
            if parameter.grad is not None
        }
        return pieces, None

    @contextmanager
    def whole_parameters(self) -> Generator[None, None, None]:
        """Read the model's parameters whole inside ``training_step``, outside any forward: for a loss term over
        them (an L2 penalty, a regulariser over some weights), before or after the step's forward::

            def training_step(self, batch, batch_index):
                loss = self.model(batch).loss
                with self.trainer.strategy.whole_parameters():
                    penalty = sum(parameter.pow(2).sum() for parameter in self.parameters())
                return loss + 1e-4 * penalty

        Call it on every rank (under FSDP and Gemini it gathers the parameters: a collective). The term's gradient is
        exact, as under Lightning's ``ddp``. Under ``colossal_ddp``, ZeRO and hybrid data parallelism it does nothing:
        parameters are whole there; hybrid tensor and pipeline parallelism refuse it. Under FSDP parameters are
        DTensor shards outside a forward, and inside the context each reads as its whole tensor; under Gemini every
        chunk is gathered. The gathered
        values stay alive until backward, held by the term's autograd graph: a term over every parameter costs the
        whole model's bytes until then (``engine_parts/whole_parameters.py`` [Note: reading sharded parameters outside
        a forward]).
        """
        yield

    def model_to_device(self) -> None:
        assert self.model is not None
        self.place_module(self.model)

    def place_module(self, module: torch.nn.Module) -> None:
        """Move ``module`` to this rank's device, unless the engine materialises it from the meta device."""
        if self.materialises_meta_models and has_meta_tensors(module):
            return  # the engine materialises this rank's shards on the device
        if has_pretrained_weights(module) and has_meta_tensors(module):
            # Whole-model strategies (colossal_ddp, ZeRO) hold every weight on every rank: read them all here.
            materialise_whole(module, self.root_device)
        module.to(self.root_device)

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
