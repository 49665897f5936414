"""What an engine that takes over the optimizer offers a strategy; plain typing, no Lightning.

``ZeroEngine`` (``zero/``), ``GeminiEngine`` (``gemini/``) and ``HybridEngine`` (``parallel/``) each take the model
and the user's optimizer, own the gradients between backward and the optimizer step, and need to hear when a step
happened. The strategies drive all three through the same few calls (``strategies/engine_strategy.py``); these
protocols name those calls, split by which engines have them, so an adapter asks for what it uses and a type checker
(or ``tests/unit/test_engine_protocol.py``) tells an engine that drifted from it.

=====================================  ============  ============  ============
protocol                               ZeroEngine    GeminiEngine  HybridEngine
=====================================  ============  ============  ============
``StepEngine``                         yes           yes           yes
``SkipsGradientSync``                  yes           no            yes
``NameKeyedOptimizerState``            yes           yes           no (its ``zero`` has it)
``MemoryReporting``                    yes           yes           no (its ``zero`` has it)
=====================================  ============  ============  ============

The protocols describe the engines; the engines do not import them (they stay independent of each other, and a
structural protocol needs no base class).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from torch import Tensor
from torch.optim import Optimizer


@runtime_checkable
class StepEngine(Protocol):
    """An engine that took over the user's optimizer: it clips the gradients it owns and finishes every step.

    The engine is built with the optimizer (or given it later, as hybrid's ``attach_optimizer``) and replaces or
    hooks what the optimizer steps on, so clipping and the work after a step must go through it. It is also the
    precision plugin's gradient clipper (``precision.GradientClipper``), whose three methods it shares.
    """

    def after_step(self, stepped: bool) -> None:
        """Called after every optimizer step; ``stepped`` is False when the loss scaler skipped it (overflow)."""

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip every gradient the optimizer steps on by their global L2 norm over all ranks; returns the norm."""
        ...

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp every gradient element the optimizer steps on to ``[-clip_value, clip_value]``."""

    def gradient_norm(self, optimizer: Optimizer, norm_type: float) -> Tensor:
        """The ``norm_type`` norm of the whole gradient the optimizer steps on, over all ranks (a collective)."""
        ...

    def remove(self) -> None:
        """Remove the hooks the engine installed on the model (it stops driving it)."""


@runtime_checkable
class SkipsGradientSync(Protocol):
    """An engine that can skip gradient communication on non-final micro-batches of gradient accumulation."""

    def no_sync(self) -> AbstractContextManager[None]:
        """Inside: a non-final micro-batch (what communication is skipped depends on the engine)."""
        ...


@runtime_checkable
class NameKeyedOptimizerState(Protocol):
    """An engine whose optimizer steps on shards: its state is saved and loaded by parameter name through it."""

    def optimizer_state_by_name(self) -> dict[str, Any]:
        """``{"state": {name: {key: tensor}}, "param_groups": [...]}``; shards as DTensors aliasing the live state."""
        ...

    def load_optimizer_state_by_name(self, loaded: dict[str, Any]) -> None:
        """Apply a state in that form: shards already filled in place (sharded checkpoints) or full tensors."""


@runtime_checkable
class StepsOptimizer(Protocol):
    """An engine that runs the optimizer step itself (the disk tier streams the state through it:
    ``disk/optimizer_state.py`` [Note: streaming the optimizer step])."""

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """What ``optimizer.step(**kwargs)`` does, however the engine keeps the optimizer's state."""
        ...

    def close_disk_tier(self) -> None:
        """Remove the optimizer state the engine keeps on disk (the engine is being dropped)."""
        ...

    def release_checkpoint_copies(self) -> None:
        """After a checkpoint was written: drop the host copies of on-disk state that ``optimizer_state_by_name`` read."""
        ...


@runtime_checkable
class MemoryReporting(Protocol):
    """An engine that accounts for the bytes it holds (``callbacks/memory.py`` reads it)."""

    def memory_report(self) -> tuple[Any, ...]:
        """A ``NamedTuple`` of this rank's byte counts (``._asdict()`` gives the mapping)."""
        ...


__all__ = ["MemoryReporting", "NameKeyedOptimizerState", "SkipsGradientSync", "StepEngine", "StepsOptimizer"]
