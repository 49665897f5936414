"""Byte accounting of model state, the model-state formula per training mode, and the statistics of a benchmark.

Nothing here starts a process group or imports Lightning, so all of it is unit-tested in milliseconds.

[Note: counting bytes of real tensors]
A tensor's bytes are the bytes of its storage that it covers. Tensors that share a storage (a tied weight seen
twice, parameters that are views into one flat ZeRO buffer, gradients that alias DDP's buckets) are counted by
the union of the byte ranges they cover, so a weight shared by two modules counts once and a flat buffer counts
its covered part, never its unused padding twice. A non-contiguous view is taken to cover the span from its first
to its last element, an upper bound that is exact for transposes. DTensors (FSDP2, tensor parallel) are counted
by their local shard, which is what this rank holds.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

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
# Byte accounting
# ---------------------------------------------------------------------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, otherwise the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local) and type(tensor).__name__ == "DTensor":
        return to_local()
    return tensor


def covered_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of storage covered by ``tensors``, each shared byte counted once (see the module Note).

    Raises:
        ValueError: a tensor lives on the meta device, so it has no bytes to count.
    """
    ranges_by_storage: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta":
            raise ValueError("Cannot count the bytes of a meta tensor; measure after the model is materialised.")
        if local.numel() == 0:
            continue
        element_size = local.element_size()
        span_elements = 1 + sum(
            int(size - 1) * abs(int(stride)) for size, stride in zip(local.shape, local.stride(), strict=True)
        )
        start = int(local.storage_offset()) * element_size
        storage_key = (str(local.device), local.untyped_storage().data_ptr())
        ranges_by_storage.setdefault(storage_key, []).append((start, start + span_elements * element_size))
    total = 0
    for ranges in ranges_by_storage.values():
        ranges.sort()
        current_start, current_end = ranges[0]
        for start, end in ranges[1:]:
            if start > current_end:
                total += current_end - current_start
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        total += current_end - current_start
    return total


def parameter_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the parameters this rank holds; tied or aliased parameters count once."""
    return covered_bytes(parameters)


def gradient_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the ``.grad`` tensors present on ``parameters`` now; parameters without a gradient add nothing."""
    return covered_bytes(parameter.grad for parameter in parameters if parameter.grad is not None)


def _tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside a (nested) optimizer-state value."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[int, dict[str, int]]:
    """Bytes of every tensor in the optimizers' ``state``, in total and per state key (``exp_avg``, ``step``, ...).

    The total de-duplicates shared storage across all keys; the per-key figures de-duplicate within a key.
    """
    tensors_by_key: dict[str, list[torch.Tensor]] = {}
    for optimizer in optimizers:
        for parameter_state in optimizer.state.values():
            for key, value in parameter_state.items():
                tensors_by_key.setdefault(str(key), []).extend(_tensors_in(value))
    by_key = {key: covered_bytes(tensors) for key, tensors in sorted(tensors_by_key.items())}
    total = covered_bytes(tensor for tensors in tensors_by_key.values() for tensor in tensors)
    return total, by_key


def gemini_model_state_bytes(memory_report: Mapping[str, Any]) -> dict[str, int]:
    """Per-rank model-state bytes of a Gemini rank, from its engine's ``memory_report()`` as a JSON-able mapping.

    The engine detaches its parameters from their values: between uses a parameter is an empty placeholder and its
    rows live in the chunk shards, so walking ``module.parameters()`` would find no bytes. The report counts the
    real chunk tensors instead. Its categories map onto the formula's as follows:

    - parameters: the working shards, the fp32 masters when they are separate tensors (they alias an fp32 shard on
      the same device, and then count 0), and the parameters kept whole outside chunks (frozen ones);
    - gradients: the fp32 shard gradients (kept allocated between steps);
    - optimizer state: every tensor of the optimizer's state on the masters (Adam's ``step`` scalars included).

    The gathered chunks and their full gradients are left out: they are working memory that exists only while
    modules run, like FSDP2's unsharded blocks, and no formula counts them (the harness reports their peak apart).

    Args:
        memory_report: ``{"chunks": {"shard", "master", "gradient", "optimizer_state", ...}, "replicated_bytes",
            ...}`` (``GeminiMemoryReport`` with its ``ChunkBytes`` as dicts).
    """
    chunks = memory_report["chunks"]
    return {
        "parameters": chunks["shard"] + chunks["master"] + memory_report["replicated_bytes"],
        "gradients": chunks["gradient"],
        "optimizer_state": chunks["optimizer_state"],
    }


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
