"""``EngineStrategy``: the adapter base of the modes whose engine takes over the optimizer (ZeRO, Gemini; hybrid).

Such an engine (``engine_protocol.StepEngine``) is built with the user's one optimizer and owns the gradients
between backward and the optimizer step. The Lightning side is the same for all of them and written once here:

- ``setup``: prepare the module (``_prepare_module``), then ``_setup_engine`` (by default: release the engine of an
  earlier stage, build the one optimizer when fitting (outside fitting the last fit's optimizers and engine stay for
  checkpoints), and build a new engine over it with the mode's ``_build_engine``), then the precision plugin, whose
  gradient clipper becomes the engine (a global norm over every shard;
  precision.py [Note: clipping belongs to the engine]);
- ``block_backward_sync`` (the non-final micro-batches of gradient accumulation) enters the engine's ``no_sync()``
  when it has one (``SkipsGradientSync``);
- ``optimizer_step`` tells the engine whether the step happened: ``after_step(stepped=False)`` when the loss scaler
  skipped it;
- the optimizer state is saved and loaded by name through the engine (``NameKeyedOptimizerState``), also after
  the fit that built it ([Note: a fit's optimizer outlives the evaluation after it]);
- ``teardown`` releases the engine (``_release_engine``), unless the release is a collective and the run failed.

A mode names its engine type, implements ``_build_engine`` and says why the engine refuses manual optimization
(``manual_optimization_refusal``). A mode that keeps one engine across stages overrides ``_setup_engine`` (build once,
then attach each fit's optimizer) and ``_release_engine``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import lightning.pytorch as pl
from torch.optim import Optimizer

from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_protocol import NameKeyedOptimizerState, SkipsGradientSync, StepEngine, StepsOptimizer
from lightning_colossal.precision import plain_step
from lightning_colossal.strategies.base import ColossalStrategy
from lightning_colossal.strategies.callback_refusals import refuse_finetuning_callbacks

EngineT = TypeVar("EngineT", bound=StepEngine)


class EngineStrategy(ColossalStrategy, Generic[EngineT]):
    """A strategy driving an engine that took over the optimizer (see the module docstring); not registered itself.

    Its constructor takes the arguments every strategy shares (``ColossalStrategy``) and forwards them.
    """

    #: Why the engine cannot leave the optimizer step to the user (what it owns); said when manual optimization or
    #: several optimizers are refused.
    manual_optimization_refusal: ClassVar[str] = "the engine owns the gradients and the optimizer step"
    #: The strategy names that do take manual optimization and several optimizers.
    manual_optimization_alternatives: ClassVar[str] = "`colossal_ddp` / `colossal_fsdp`"
    #: Releasing the engine is a collective (e.g. gathering whole parameters): skipped at the teardown of a failed
    #: run, whose other ranks may never reach it.
    release_is_collective: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.engine: EngineT | None = None
        #: The engine of the last ``fit``, while it holds the optimizer state of the module's weights
        #: ([Note: a fit's optimizer outlives the evaluation after it]).
        self._fitted_engine: EngineT | None = None

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._prepare_module(trainer)
        if fitting:
            refuse_finetuning_callbacks(trainer.callbacks, type(self).__name__)
        self.engine = self._setup_engine(trainer, fitting)
        self.setup_precision_plugin()
        if self.engine is not None:
            self.precision_plugin.gradient_clipper = self.engine
        self.precision_plugin.optimizer_stepper = (
            self.engine.step_optimizer if isinstance(self.engine, StepsOptimizer) else plain_step
        )

    def _setup_engine(self, trainer: pl.Trainer, fitting: bool) -> EngineT | None:
        """The engine this stage runs with; by default a new one from ``_build_engine`` over this stage's optimizer,
        or over none outside fitting.

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
        if self.engine is not None:
            self._release_engine(self.engine)  # an earlier stage's; this stage builds its own
            self.engine = None
        if not fitting:
            return self._build_engine(trainer, None)
        self._drop_fitted_engine()
        optimizer = self._setup_single_optimizer(
            trainer, self.manual_optimization_refusal, self.manual_optimization_alternatives
        )
        self._fitted_engine = self._build_engine(trainer, optimizer)
        return self._fitted_engine

    def _checkpoint_engine(self) -> EngineT | None:
        """The engine whose masters and optimizer state a checkpoint holds: the last fit's while it still describes
        the module's weights, otherwise this stage's ([Note: a fit's optimizer outlives the evaluation after it])."""
        return self._fitted_engine if self._fitted_engine is not None else self.engine

    def _forget_earlier_fit(self) -> None:
        """The module's weights are being replaced outside ``fit``: the last fit's optimizer state no longer belongs
        to them."""
        if self._fitted_engine is not None and self._fitted_engine is not self.engine:
            self._drop_fitted_engine()
            self._drop_optimizers_of_earlier_fit()

    def _drop_fitted_engine(self) -> None:
        """Forget the last fit's engine; optimizer state it keeps on disk goes now rather than at exit."""
        if isinstance(self._fitted_engine, StepsOptimizer):
            self._fitted_engine.close_disk_tier()
        self._fitted_engine = None

    def _build_engine(self, trainer: pl.Trainer, optimizer: Optimizer | None) -> EngineT | None:
        """A new engine over the prepared model and ``optimizer`` (``None`` outside fitting); ``None`` when the mode
        runs without one there."""
        raise NotImplementedError(f"{type(self).__name__} must build its engine.")

    def _release_engine(self, engine: EngineT) -> None:
        """Stop ``engine`` driving the model (between stages and at teardown)."""
        engine.remove()

    def teardown(self) -> None:
        # The engine stays referenced: `trainer.save_checkpoint` after `fit` still reads its shards and state.
        engine = self.engine
        if engine is not None and not (self.release_is_collective and self._failure_being_torn_down() is not None):
            self._release_engine(engine)
        super().teardown()

    # ---------------------------------------------------------------------------------------------- steps
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if not isinstance(self.engine, SkipsGradientSync):
            with super().block_backward_sync():
                yield
            return
        with self.engine.no_sync():
            yield

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None:
            self.engine.after_step(stepped=not self.precision_plugin.last_step_skipped)
        return output

    def _gradient_pieces(self) -> tuple[dict[str, Any], Any]:
        """From the engine's masters: this rank's rows of each gradient (a replicated one counted on rank 0 only),
        summed over the engine's data-parallel group; parameters' own ``.grad`` is empty under ZeRO-2 and Gemini."""
        masters = getattr(self.engine, "sharded_masters", None)
        if masters is None:
            raise ValueError(
                f"gradient_norms() is not available under {self.strategy_name or type(self).__name__}: its engine keeps"
                " no per-parameter record of gradient rows to read them from (tensor- and pipeline-parallel pieces of"
                " each parameter). Log `self.trainer.strategy.gradient_norm()`, the norm of the whole gradient, instead."
            )
        group = self.engine.process_group  # type: ignore[union-attr]
        rank = collectives.rank(group)
        pieces = {
            entry.name: sharded_state.counted_gradient(entry, rank)
            for entry in masters
            if entry.master.grad is not None
        }
        return pieces, group

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            # The optimizer state the disk tier read for this checkpoint is written (or staged): host memory goes
            # back to a few records.
            engine = self._checkpoint_engine()
            if isinstance(engine, StepsOptimizer):
                engine.release_checkpoint_copies()

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        self._forget_earlier_fit()  # an evaluation stage loading other weights (fit's own engine is self.engine)
        return super().load_checkpoint(checkpoint_path, weights_only)

    def optimizer_names_and_state(self, optimizer: Optimizer) -> dict[str, Any]:
        engine = self._checkpoint_engine()
        if not isinstance(engine, NameKeyedOptimizerState):
            return super().optimizer_names_and_state(optimizer)
        return engine.optimizer_state_by_name()

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        if not isinstance(self.engine, NameKeyedOptimizerState):
            super()._load_optimizer_state(optimizer, state)
            return
        self.engine.load_optimizer_state_by_name(state)
