"""The model-state formula per training mode and the statistics of a benchmark; re-exports the byte accounting.

The byte accounting of real tensors ([Note: counting bytes of real tensors]) lives in the package, in
``lightning_colossal/callbacks/memory_accounting.py``, which ``MemoryMonitor`` shares; it is re-exported here.
Nothing here starts a process group, so all of it is unit-tested in milliseconds (importing the package loads
Lightning, which registers the strategy names).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lightning_colossal.callbacks.memory_accounting import (
    covered_bytes,
    gemini_model_state_bytes,
    gradient_bytes,
    optimizer_state_bytes,
    parameter_bytes,
)

__all__ = [
    "MODEL_STATE_FORMULAS",
    "STEP_TIME_STATISTICS",
    "STRATEGY_MODES",
    "ModelStateBytes",
    "ModelStateFormula",
    "Summary",
    "covered_bytes",
    "gemini_model_state_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
    "paired_ratios",
    "parameter_bytes",
    "percentile",
    "run_step_time",
    "summarize",
]


# ---------------------------------------------------------------------------------------------------------------
# Model-state formulas
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-rank bytes of parameters, gradients and optimizer state."""

    parameters: float
    gradients: float
    optimizer_state: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state


@dataclass(frozen=True)
class ModelStateFormula:
    """Per-rank model-state bytes of one training mode with fp32 Adam, as bytes per parameter.

    Each category is ``(replicated, sharded)``: it costs ``replicated * Ψ + sharded * Ψ / N`` bytes on a rank,
    where Ψ is the parameter count of the whole model and N the number of ranks the state is sharded over.

    Tensor parallelism (``tensor_parallel=True``) splits only some parameters (the linear layers, embedding and head
    of a transformer) and keeps the others (norms, some biases, position embeddings) whole on every rank, so its
    coefficients apply to two counts instead: ``replicated * (Ψ − Ψₜ) + sharded * Ψₜ / N``, Ψₜ being the parameters
    the plan splits (counted whole) and N the tensor-parallel ranks (all ranks: no data parallelism).
    """

    mode: str
    parameters: tuple[int, int]
    gradients: tuple[int, int]
    optimizer_state: tuple[int, int]
    tensor_parallel: bool = False

    def bytes(self, parameter_count: int, world_size: int, tensor_parallel_count: int | None = None) -> ModelStateBytes:
        """The formula evaluated for ``parameter_count`` (Ψ), ``world_size`` (N) and, for tensor parallelism,
        ``tensor_parallel_count`` (Ψₜ).

        Raises:
            ValueError: a tensor-parallel formula without Ψₜ, or Ψₜ outside [0, Ψ].
        """
        whole, split = parameter_count, parameter_count
        if self.tensor_parallel:
            if tensor_parallel_count is None or not 0 <= tensor_parallel_count <= parameter_count:
                raise ValueError(
                    f"The {self.mode} formula needs the count of tensor-parallel parameters (0..{parameter_count}),"
                    f" got {tensor_parallel_count}."
                )
            whole, split = parameter_count - tensor_parallel_count, tensor_parallel_count

        def evaluate(coefficients: tuple[int, int]) -> float:
            replicated, sharded = coefficients
            return replicated * whole + sharded * split / world_size

        return ModelStateBytes(evaluate(self.parameters), evaluate(self.gradients), evaluate(self.optimizer_state))

    def expression(self) -> str:
        """The total as text, e.g. ``16Ψ``, ``4Ψ + 12Ψ/N`` or ``16(Ψ − Ψₜ) + 16Ψₜ/N``."""
        categories = (self.parameters, self.gradients, self.optimizer_state)
        replicated = sum(category[0] for category in categories)
        sharded = sum(category[1] for category in categories)
        whole, split = ("(Ψ − Ψₜ)", "Ψₜ") if self.tensor_parallel else ("Ψ", "Ψ")
        terms = ([f"{replicated}{whole}"] if replicated else []) + ([f"{sharded}{split}/N"] if sharded else [])
        return " + ".join(terms) or "0"


# fp32 parameters (4 bytes), fp32 gradients (4 bytes), Adam's exp_avg + exp_avg_sq (8 bytes) per parameter.
# A new mode is one more row. Adam's per-tensor ``step`` scalars are not in any formula: the measured bytes show
# them as the small excess over it.
MODEL_STATE_FORMULAS: dict[str, ModelStateFormula] = {
    formula.mode: formula
    for formula in (
        ModelStateFormula("ddp", parameters=(4, 0), gradients=(4, 0), optimizer_state=(8, 0)),
        ModelStateFormula("zero1", parameters=(4, 0), gradients=(4, 0), optimizer_state=(0, 8)),
        ModelStateFormula("zero2", parameters=(4, 0), gradients=(0, 4), optimizer_state=(0, 8)),
        ModelStateFormula("zero3", parameters=(0, 4), gradients=(0, 4), optimizer_state=(0, 8)),
        # Tensor parallelism over all N ranks without ZeRO: every rank holds its shard of the split parameters and
        # the other parameters whole, each with its gradient and Adam state.
        ModelStateFormula("tp", parameters=(4, 4), gradients=(4, 4), optimizer_state=(8, 8), tensor_parallel=True),
    )
}

# The mode a strategy name trains in, so ``--strategies NAME`` finds its formula without being told. A name not
# listed here (e.g. ``colossal_hybrid``, whose formula depends on its layout) gets no formula unless its
# configuration names its mode explicitly (``mode=...``).
STRATEGY_MODES: dict[str, str] = {
    "ddp": "ddp",
    "ddp_find_unused_parameters_true": "ddp",
    "colossal_ddp": "ddp",
    "colossal_ddp_notebook": "ddp",
    "colossal_zero1": "zero1",
    "colossal_zero2": "zero2",
    # Gemini shards parameters, gradients and optimizer state over the ranks: ZeRO-3. Placement only decides where
    # the bytes live; on an accelerator, offloading adds a separate fp32 master in CPU memory (4Ψ/N), which shows as
    # excess over the formula. On CPU ranks the masters alias the shards, so every placement measures 16Ψ/N.
    "colossal_gemini": "zero3",
    "colossal_gemini_auto": "zero3",
    "colossal_gemini_offload": "zero3",
    "colossal_fsdp": "zero3",
    "fsdp": "zero3",
    # DeepSpeed's own engine (benchmarks/deepspeed_worker.py). Measured departures from these formulas: stages 1 and
    # 2 keep their fp32 master partition as a copy even in fp32 (+4Ψ/N), and stage 1 has already freed the full
    # gradients when AdamW steps (4Ψ/N left); stage 3 keeps parameters under its persistence threshold whole.
    "deepspeed_zero1": "zero1",
    "deepspeed_zero2": "zero2",
    "deepspeed_zero3": "zero3",
}


# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile (0 = min, 1 = max) with linear interpolation between order statistics.

    Raises:
        ValueError: ``values`` is empty or ``fraction`` is outside [0, 1].
    """
    if not values:
        raise ValueError("percentile() needs at least one value.")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction}.")
    ordered = sorted(values)
    position = fraction * (len(ordered) - 1)
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)


# Per-run statistic of the measured step times: low quantiles, because noise on a shared machine only ever
# makes a step slower, so the fast end is the steadiest estimate of what the code costs.
STEP_TIME_STATISTICS: dict[str, float] = {"min": 0.0, "p20": 0.2, "median": 0.5}


def run_step_time(step_times_per_rank: Sequence[Sequence[float]], statistic: str = "p20") -> float:
    """One run's step time: per step the slowest rank (a step ends when every rank is done), then ``statistic``.

    Raises:
        ValueError: an unknown statistic, no ranks, or ranks that measured different numbers of steps.
    """
    if statistic not in STEP_TIME_STATISTICS:
        raise ValueError(f"Unknown statistic {statistic!r}; choose one of {sorted(STEP_TIME_STATISTICS)}.")
    if not step_times_per_rank or not step_times_per_rank[0]:
        raise ValueError("run_step_time() needs at least one rank with at least one step.")
    lengths = {len(times) for times in step_times_per_rank}
    if len(lengths) != 1:
        raise ValueError(f"Ranks measured different numbers of steps: {sorted(lengths)}.")
    slowest = [max(times) for times in zip(*step_times_per_rank, strict=True)]
    return percentile(slowest, STEP_TIME_STATISTICS[statistic])


def paired_ratios(ours: Mapping[int, float], peer: Mapping[int, float]) -> list[float]:
    """``ours[r] / peer[r]`` for every repeat ``r`` present in both, in repeat order.

    Pairing within a repeat cancels the slow drift of a shared machine: both runs of a pair ran minutes apart
    at most, in random order.
    """
    return [ours[repeat] / peer[repeat] for repeat in sorted(ours.keys() & peer.keys())]


@dataclass(frozen=True)
class Summary:
    """Median and range of a list of measurements."""

    median: float
    minimum: float
    maximum: float
    count: int


def summarize(values: Sequence[float]) -> Summary:
    """Median, minimum, maximum and count of ``values``.

    Raises:
        ValueError: ``values`` is empty.
    """
    if not values:
        raise ValueError("summarize() needs at least one value.")
    return Summary(statistics.median(values), min(values), max(values), len(values))
