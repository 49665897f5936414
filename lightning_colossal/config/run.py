"""Settings every strategy shares: precision, start method, timeouts, non-finite values, the fp16 loss scaler."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
SUPPORTED_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=30)

#: How long a peer's heartbeat may stop before the watchdog stops this rank (``lightning_colossal/distributed/
#: watchdog.py``). 60 s: long enough that a busy but live process (a long checkpoint write, a compile) never trips it,
#: since its heartbeat thread keeps beating; short enough that a dead rank costs a minute, not the 30-minute
#: collective timeout. A peer on the same host whose process is gone is found within one heartbeat interval (1 s).
DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=60)

NonFiniteAction = Literal["raise", "skip", "warn"]
NONFINITE_ACTIONS: tuple[str, ...] = ("raise", "skip", "warn")


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """Dynamic loss scaling for ``16-mixed`` (fp16) training.

    The semantics follow ColossalAI's ``DynamicGradScaler``: an overflow increments a hysteresis counter and the
    scale backs off once the counter reaches ``hysteresis``; the counter resets only when the scale grows, so
    later overflows back off at once. ``growth_interval`` clean steps in a row grow the scale.

    Args:
        initial_scale: scale applied to the loss before the first step.
        growth_factor: multiplier applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplier applied on overflow (in (0, 1)).
        growth_interval: number of consecutive clean steps before the scale grows.
        hysteresis: number of overflows tolerated before the scale backs off.
        min_scale: lower bound of the scale.
        max_scale: upper bound of the scale.
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**32

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial_scale) and self.initial_scale > 0):
            raise ValueError(
                f"LossScalerConfig(initial_scale={self.initial_scale}): pass a finite value > 0, e.g. 2**16."
            )
        if not self.growth_factor > 1:
            raise ValueError(f"LossScalerConfig(growth_factor={self.growth_factor}): pass a value > 1, e.g. 2.0.")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"LossScalerConfig(backoff_factor={self.backoff_factor}): pass a value in (0, 1), e.g. 0.5."
            )
        if self.growth_interval < 1:
            raise ValueError(f"LossScalerConfig(growth_interval={self.growth_interval}): pass an integer >= 1.")
        if self.hysteresis < 1:
            raise ValueError(f"LossScalerConfig(hysteresis={self.hysteresis}): pass an integer >= 1.")
        if not 0 < self.min_scale <= self.max_scale:
            raise ValueError(
                f"LossScalerConfig(min_scale={self.min_scale}, max_scale={self.max_scale}): pass 0 < min_scale <= max_scale."
            )
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"LossScalerConfig(initial_scale={self.initial_scale}) lies outside [min_scale, max_scale] ="
                f" [{self.min_scale}, {self.max_scale}]: move initial_scale inside or widen the bounds."
            )


def validate_precision(precision: str) -> PrecisionName:
    """Return ``precision`` if lightning_colossal supports it, else raise a ``ValueError`` naming the choices."""
    if precision not in SUPPORTED_PRECISIONS:
        hint = ""
        if precision == "16-true":
            hint = " Pure fp16 weights need fp32 master copies: use '16-mixed' (fp16 compute, fp32 weights)."
        elif precision == "64-true":
            hint = " Double precision is not a training mode of this library: use '32-true'."
        raise ValueError(
            f"precision={precision!r} is not supported by lightning_colossal. Choose one of"
            f" {', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}.{hint}"
        )
    return precision  # type: ignore[return-value]


def validate_nonfinite_action(action: str) -> NonFiniteAction:
    """Check ``on_nonfinite``; see ``precision.py`` [Note: non-finite values without a loss scaler]."""
    if action not in NONFINITE_ACTIONS:
        raise ValueError(
            f"on_nonfinite={action!r} is not supported: use 'raise' (stop every rank), 'skip' (skip the step on every"
            " rank) or 'warn' (report and step anyway)."
        )
    return action  # type: ignore[return-value]


def validate_start_method(start_method: str) -> StartMethod:
    """Return ``start_method`` if Lightning can launch with it, else raise a ``ValueError`` naming the choices."""
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method={start_method!r}: choose 'popen' (scripts, torchrun, SLURM), 'spawn', or 'fork' (notebooks)."
        )
    return start_method  # type: ignore[return-value]
