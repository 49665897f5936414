"""``EngineStrategy``: the adapter base of the modes whose engine takes over the optimizer (ZeRO, Gemini; hybrid).

Such an engine (``engine_protocol.StepEngine``) is built with one of the user's optimizers and owns the gradients
between backward and the optimizer step. A mode takes exactly one optimizer (Gemini, hybrid), or every optimizer
``configure_optimizers`` returns with one engine each (``takes_several_optimizers``: ZeRO, manual optimization
included; engines_by_optimizer.py [Note: one engine per optimizer]). The Lightning side is the same for all of them
and written once here:

- ``setup``: prepare the module (``_prepare_module``), then ``_setup_engines`` (by default: release the engines of an
  earlier stage, build the optimizers when fitting (outside fitting the last fit's optimizers and engines stay for
  checkpoints), and build a new engine over each with the mode's ``_build_engine``), then the precision plugin, whose
  gradient clipper and optimizer stepper become the engine, or with several engines the one that took over the
  optimizer at hand (a global norm over every shard; precision.py [Note: clipping belongs to the engine]);
- ``block_backward_sync`` (the non-final micro-batches of gradient accumulation) enters the engines' ``no_sync()``
  when they have one (``SkipsGradientSync``);
- ``optimizer_step`` tells the optimizer's engine whether the step happened: ``after_step(stepped=False)`` when the
  loss scaler skipped it;
- the optimizer state is saved and loaded by name through the optimizer's engine (``NameKeyedOptimizerState``), also
  after the fit that built it ([Note: a fit's optimizer outlives the evaluation after it]);
- ``teardown`` releases the engines (``_release_engine``), unless the release is a collective and the run failed.

A mode names its engine type, implements ``_build_engine`` and, unless it takes several optimizers, says why the
engine refuses manual optimization (``manual_optimization_refusal``). A mode that keeps one engine across stages
overrides ``_setup_engines`` (build once, then attach each fit's optimizer) and ``_release_engine``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.checkpoint.format import FabricObjects
from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_protocol import NameKeyedOptimizerState, SkipsGradientSync, StepEngine, StepsOptimizer
from lightning_colossal.precision import plain_step
from lightning_colossal.strategies.base import ColossalStrategy
from lightning_colossal.strategies.callback_refusals import refuse_finetuning_callbacks
from lightning_colossal.strategies.engines_by_optimizer import EnginesByOptimizer, engine_of
from lightning_colossal.strategies.joined_parameters import JoinedParametersMixin
from lightning_colossal.strategies.optimizer_toggling import unwrap_toggling, wrap_toggling

EngineT = TypeVar("EngineT", bound=StepEngine)


class EngineStrategy(JoinedParametersMixin, ColossalStrategy, Generic[EngineT]):
    """A strategy driving an engine that took over the optimizer (see the module docstring); not registered itself.

    Its constructor takes the arguments every strategy shares (``ColossalStrategy``) and forwards them.
    """

    #: Whether the mode takes every optimizer ``configure_optimizers`` returns, one engine each, and manual
    #: optimization ([Note: one engine per optimizer]); otherwise exactly one optimizer, automatically stepped.
    takes_several_optimizers: ClassVar[bool] = False
    #: Why the engine cannot leave the optimizer step to the user (what it owns); said when manual optimization or
    #: several optimizers are refused.
    manual_optimization_refusal: ClassVar[str] = "the engine owns the gradients and the optimizer step"
    #: The strategy names that do take manual optimization and several optimizers.
    manual_optimization_alternatives: ClassVar[str] = (
        "`colossal_zero1` / `colossal_zero2` (and their `_offload` variants), `colossal_ddp` or `colossal_fsdp`"
    )
    #: Releasing the engine is a collective (e.g. gathering whole parameters): skipped at the teardown of a failed
    #: run, whose other ranks may never reach it.
    release_is_collective: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: This stage's engines, in the order of the optimizers they took over (one outside fitting, or none).
        self.engines: list[EngineT] = []
        #: The engines of the last ``fit``, while they hold the optimizer state of the module's weights
        #: ([Note: a fit's optimizer outlives the evaluation after it]).
        self._fitted_engines: list[EngineT] = []
        self._group_counts: list[int] = []
        self._held_frozen: list[Tensor] = []

    @property
    def engine(self) -> EngineT | None:
        """This stage's engine (``None`` when it runs without one). A run with one engine per optimizer has no single
        engine: read ``engines`` (in the order of the optimizers) or ``engine_of(optimizer)`` there."""
        if len(self.engines) > 1:
            raise RuntimeError(
                f"{self.strategy_name or type(self).__name__} runs {len(self.engines)} engines here, one per optimizer:"
                " use `strategy.engines` (in the order `configure_optimizers` returned the optimizers) or"
                " `strategy.engine_of(optimizer)`."
            )
        return self.engines[0] if self.engines else None

    @engine.setter
    def engine(self, engine: EngineT | None) -> None:
        self.engines = [] if engine is None else [engine]

    def engine_of(self, optimizer: Optimizer) -> EngineT:
        """The engine of this stage that took over ``optimizer`` (or the optimizer a ``LightningOptimizer`` wraps)."""
        return engine_of(optimizer, self.engines)

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._prepare_module(trainer)
        if fitting:
            refuse_finetuning_callbacks(trainer.callbacks, type(self).__name__, self.takes_joining_parameters)
        self.engines = self._setup_engines(trainer, fitting)
        self._group_counts = self._optimizer_group_counts()
        self.setup_precision_plugin()
        self._wire_precision_plugin()

    def _wire_precision_plugin(self) -> None:
        """The precision plugin clips and steps through the engines (precision.py [Note: clipping belongs to the
        engine])."""
        if len(self.engines) > 1:
            by_optimizer = EnginesByOptimizer(self.engines)
            self.precision_plugin.gradient_clipper = by_optimizer
            self.precision_plugin.optimizer_stepper = by_optimizer.step_optimizer
            return
        engine = self.engine
        if engine is not None:
            self.precision_plugin.gradient_clipper = engine
        self.precision_plugin.optimizer_stepper = (
            engine.step_optimizer if isinstance(engine, StepsOptimizer) else plain_step
        )

    def _setup_engines(self, trainer: pl.Trainer, fitting: bool) -> list[EngineT]:
        """The engines this stage runs with; by default new ones from ``_build_engine``, one over each of this stage's
        optimizers, or one over none outside fitting (none when the mode builds none there).

        [Note: a fit's optimizer outlives the evaluation after it]
        Lightning's ``ddp`` keeps the optimizers (and LR schedulers) of the last ``fit`` through ``validate``, ``test``
        and ``predict``, so ``trainer.save_checkpoint`` after ``fit`` then ``validate`` writes a checkpoint that resumes
        exactly. Here the fit's optimizer state lives in its engine (sharded rows, chunks), and an evaluation stage
        builds an engine of its own without an optimizer (Gemini: chunks to hold the model) or none (ZeRO). So the fit's
        engine is kept, released, as ``_fitted_engine``: checkpoints take the optimizer state and the fp32 masters from
        it (``_checkpoint_engine``). It describes the module's weights only while nothing replaces them: an evaluation
        stage that loads a checkpoint (``validate(ckpt_path=...)``) forgets it with the optimizers, and a checkpoint
        saved after that holds the weights only (resuming from it is refused with that reason). Lightning's ``ddp``
        would pair the loaded weights with the fit's optimizer state; a sharded engine cannot, its masters would be
        the fit's, not the loaded weights.
        """
        for earlier in self.engines:
            self._release_engine(earlier)  # an earlier stage's; this stage builds its own
        self.engines = []
        if self.lightning_module is not None:
            unwrap_toggling(self.lightning_module)
        if not fitting:
            engine = self._build_engine(trainer, None)
            return [] if engine is None else [engine]
        self._drop_fitted_engines()
        if self.takes_several_optimizers:
            optimizers = self._setup_engine_optimizers(trainer)
        else:
            optimizers = [
                self._setup_single_optimizer(
                    trainer, self.manual_optimization_refusal, self.manual_optimization_alternatives
                )
            ]
        self._record_held_frozen(optimizers)
        built = [self._build_engine(trainer, optimizer) for optimizer in optimizers]
        engines = [engine for engine in built if engine is not None]
        self._fitted_engines = engines
        assert self.lightning_module is not None
        if not self.lightning_module.automatic_optimization:
            # optimizer_toggling.py [Note: toggling reaches the model's parameters]
            wrap_toggling(self.lightning_module, self._parameters_stepped_by)
        return engines

    def _parameters_stepped_by(self, optimizer: Optimizer) -> Sequence[Tensor]:
        """The model parameters that ``optimizer``'s engine steps (through their masters)."""
        return engine_of(optimizer, self._fitted_engines).stepped_parameters()  # type: ignore[attr-defined]

    def _checkpoint_engines(self) -> list[EngineT]:
        """The engines whose masters and optimizer state a checkpoint holds: the last fit's while they still
        describe the module's weights, otherwise this stage's ([Note: a fit's optimizer outlives the evaluation after
        it])."""
        return self._fitted_engines if self._fitted_engines else self.engines

    def _checkpoint_engine(self) -> EngineT | None:
        """The one engine of ``_checkpoint_engines()`` (``None``: none), for the modes that run one."""
        engines = self._checkpoint_engines()
        if len(engines) > 1:
            raise RuntimeError(f"{type(self).__name__} holds {len(engines)} engines: go through each of them.")
        return engines[0] if engines else None

    def _forget_earlier_fit(self) -> None:
        """The module's weights are being replaced outside ``fit``: the last fit's optimizer state no longer belongs
        to them."""
        if self._fitted_engines and self._fitted_engines != self.engines:
            self._drop_fitted_engines()
            self._drop_optimizers_of_earlier_fit()

    def _drop_fitted_engines(self) -> None:
        """Forget the last fit's engines; optimizer state they keep on disk goes now rather than at exit."""
        for engine in self._fitted_engines:
            if isinstance(engine, StepsOptimizer):
                engine.close_disk_tier()
        self._fitted_engines = []

    def _build_engine(self, trainer: pl.Trainer, optimizer: Optimizer | None) -> EngineT | None:
        """A new engine over the prepared model and ``optimizer`` (``None`` outside fitting); ``None`` when the mode
        runs without one there."""
        raise NotImplementedError(f"{type(self).__name__} must build its engine.")

    def _release_engine(self, engine: EngineT) -> None:
        """Stop ``engine`` driving the model (between stages and at teardown)."""
        engine.remove()

    def teardown(self) -> None:
        # The engines stay referenced: `trainer.save_checkpoint` after `fit` still reads their shards and state.
        if not (self.release_is_collective and self._failure_being_torn_down() is not None):
            for engine in self.engines:
                self._release_engine(engine)
        if self.lightning_module is not None:
            unwrap_toggling(self.lightning_module)
        super().teardown()

    # ---------------------------------------------------------------------------------------------- steps
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if not any(isinstance(engine, SkipsGradientSync) for engine in self.engines):
            with super().block_backward_sync():
                yield
            return
        with ExitStack() as stack:
            for engine in self.engines:
                if isinstance(engine, SkipsGradientSync):
                    stack.enter_context(engine.no_sync())
            yield

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engines:
            self.engine_of(optimizer).after_step(stepped=not self.precision_plugin.last_step_skipped)
        return output

    def gradient_norm(self, norm_type: float = 2.0) -> Tensor:
        """See ``ColossalStrategy.gradient_norm``; with one engine per optimizer, the norm of every optimizer's
        gradients together, as Lightning's ``grad_norm(module)`` takes every parameter's ``.grad`` (one scalar
        all-reduce per engine; [Note: one engine per optimizer]). One optimizer's alone:
        ``strategy.engine_of(optimizer).gradient_norm(optimizer, norm_type)``."""
        if len(self.engines) < 2:
            return super().gradient_norm(norm_type)
        norm_type = float(norm_type)
        if not norm_type >= 1.0:
            raise ValueError(f"norm_type={norm_type} is not a norm: pass 2.0, another p >= 1, or float('inf').")
        self._gradient_norm_asked = True  # the hook logs the norm the way that works here: no warning
        norms = [engine.gradient_norm(engine.optimizer, norm_type) for engine in self.engines]  # type: ignore[attr-defined]
        # The norm of the norms, as gradient_norms() totals its per-parameter ones.
        return torch.stack([norm.float() for norm in norms]).norm(norm_type)

    def _gradient_pieces(self) -> tuple[dict[str, Any], Any]:
        """From the engines' masters: this rank's rows of each gradient (a replicated one counted on rank 0 only),
        summed over the engines' data-parallel group; parameters' own ``.grad`` is empty under ZeRO-2 and Gemini."""
        masters = [getattr(engine, "sharded_masters", None) for engine in self.engines]
        if not masters or any(each is None for each in masters):
            raise ValueError(
                f"gradient_norms() is not available under {self.strategy_name or type(self).__name__}: its engine keeps"
                " no per-parameter record of gradient rows to read them from (tensor- and pipeline-parallel pieces of"
                " each parameter). Log `self.trainer.strategy.gradient_norm()`, the norm of the whole gradient, instead."
            )
        group = self.engines[0].process_group  # type: ignore[attr-defined]  # one data-parallel group for every engine
        rank = collectives.rank(group)
        pieces = {
            entry.name: sharded_state.counted_gradient(entry, rank)
            for entries in masters
            for entry in entries  # type: ignore[union-attr]
            if entry.master.grad is not None
        }
        return pieces, group

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_portable_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, fabric_objects: FabricObjects | None = None
    ) -> None:
        try:
            super().save_portable_checkpoint(checkpoint, filepath, fabric_objects)
        finally:
            # The optimizer state the disk tier read for this checkpoint is written (or staged): host memory goes
            # back to a few records.
            for engine in self._checkpoint_engines():
                if isinstance(engine, StepsOptimizer):
                    engine.release_checkpoint_copies()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        self._forget_earlier_fit()  # an evaluation stage loading other weights (fit's own engine is self.engine)
        return super().load_checkpoint(checkpoint_path, weights_only)

    def optimizer_names_and_state(self, optimizer: Optimizer) -> dict[str, Any]:
        engines = self._checkpoint_engines()
        engine = engine_of(optimizer, engines) if engines else None
        if not isinstance(engine, NameKeyedOptimizerState):
            return super().optimizer_names_and_state(optimizer)
        return engine.optimizer_state_by_name()

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        engine = self.engine_of(optimizer) if self.engines else None
        if not isinstance(engine, NameKeyedOptimizerState):
            super()._load_optimizer_state(optimizer, state)
            return
        engine.load_optimizer_state_by_name(state)
