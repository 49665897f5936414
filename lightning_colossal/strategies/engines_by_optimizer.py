"""One engine per optimizer: finding the engine that took over an optimizer, and the precision plugin's clipper and
stepper that go to it.

[Note: one engine per optimizer]
A ZeRO strategy whose ``configure_optimizers`` returns several optimizers (manual optimization: a generator and a
discriminator, say) builds one ``ZeroEngine`` per optimizer, each over that optimizer's parameters only, all on the
same data-parallel group. Each engine hooks its own parameters' gradients, so a backward pass reaches exactly the
engines whose parameters it gave a gradient; an engine none of whose parameters got one (``toggle_optimizer`` froze
them) does nothing in it. Stepping, clipping, the step's aftermath and the optimizer's checkpoint state go to the
engine that took over the optimizer being stepped, clipped or saved; what concerns the model's weights (checkpoint
masters, reloads, memory, norms over the whole gradient) goes through every engine. With one optimizer the engine
itself is the precision plugin's clipper and stepper, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.engine_protocol import StepEngine, StepsOptimizer
from lightning_colossal.precision import plain_step
from lightning_colossal.strategies.optimizers import unwrap_optimizer

EngineT = TypeVar("EngineT", bound=StepEngine)


def engine_of(optimizer: Optimizer, engines: Sequence[EngineT]) -> EngineT:
    """The engine among ``engines`` that took over ``optimizer`` (or the optimizer a ``LightningOptimizer`` wraps).

    Raises:
        ValueError: no engine took it over (an optimizer ``configure_optimizers`` did not return).
    """
    if len(engines) == 1:
        return engines[0]
    user_optimizer = unwrap_optimizer(optimizer)
    for engine in engines:
        if getattr(engine, "optimizer", None) is user_optimizer:
            return engine
    raise ValueError(
        f"{type(user_optimizer).__name__} is none of the {len(engines)} optimizers this run's engines took over: step,"
        " clip and save only the optimizers `configure_optimizers` returned, as `self.optimizers()` hands them out."
    )


class EnginesByOptimizer:
    """The precision plugin's gradient clipper and optimizer stepper when a strategy runs one engine per optimizer:
    each call goes to the engine that took over the optimizer it names ([Note: one engine per optimizer]; precision.py
    [Note: clipping belongs to the engine])."""

    def __init__(self, engines: Sequence[StepEngine]) -> None:
        self.engines = list(engines)

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        user_optimizer = unwrap_optimizer(optimizer)
        return engine_of(user_optimizer, self.engines).clip_by_norm(user_optimizer, max_norm)

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        user_optimizer = unwrap_optimizer(optimizer)
        engine_of(user_optimizer, self.engines).clip_by_value(user_optimizer, clip_value)

    def gradient_norm(self, optimizer: Optimizer, norm_type: float) -> Tensor:
        user_optimizer = unwrap_optimizer(optimizer)
        return engine_of(user_optimizer, self.engines).gradient_norm(user_optimizer, norm_type)

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        user_optimizer = unwrap_optimizer(optimizer)
        engine = engine_of(user_optimizer, self.engines)
        if isinstance(engine, StepsOptimizer):
            return engine.step_optimizer(user_optimizer, **kwargs)
        return plain_step(user_optimizer, **kwargs)
