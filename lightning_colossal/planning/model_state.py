"""Per-rank model-state bytes (parameters, gradients, optimizer state) of each engine, and where they live.

These are the engines' own rules, not textbook ZeRO figures, and they are exact: ``tests/distributed/
test_plan_against_engines.py`` checks them to the byte against what ``MemoryMonitor`` measures on live engines.

- Rows: every sharded engine splits each parameter along dim 0 with ``torch.chunk`` semantics (``shard_spec`` in
  ``lightning_colossal/engine_parts/rows.py``: ceil-sized pieces, the last ranks short or empty), so a rank's "own
  rows" are computed with the engines' own function and uneven splits come out exact. Rank 0 always holds the most.
- Dtypes (``lightning_colossal/precision.py``): ``32-true``, ``bf16-mixed`` and ``16-mixed`` keep fp32 parameters
  (mixed precision is autocast); ``bf16-true`` keeps bf16 parameters. ZeRO and Gemini step fp32 masters; an fp32
  parameter (ZeRO without offload) or an fp32 chunk shard on the same device as its master (Gemini) *is* its master,
  with no second copy. DDP and FSDP step the parameters themselves, so their optimizer state has the parameters' dtype.
- torch's Adam/AdamW keep ``step`` as a 4-byte float32 scalar per parameter tensor, on the CPU (unless fused or
  capturable), so the planner puts it in host memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from lightning_colossal.engine_parts.rows import shard_spec
from lightning_colossal.planning.settings import Setting

__all__ = [
    "OPTIMIZERS",
    "ModelState",
    "OptimizerShape",
    "Placed",
    "Training",
    "model_state",
    "owned_numel",
]

FP32 = 4
DeviceType = Literal["cuda", "cpu"]
Shape = tuple[int, ...]


@dataclass(frozen=True)
class OptimizerShape:
    """What an optimizer keeps per parameter: ``moments`` tensors shaped like it, ``step_bytes`` per tensor."""

    name: str
    moments: int
    step_bytes: int


OPTIMIZERS = {
    "adamw": OptimizerShape("AdamW", moments=2, step_bytes=4),
    "adam": OptimizerShape("Adam", moments=2, step_bytes=4),
    "sgd": OptimizerShape("SGD", moments=0, step_bytes=0),
    "sgd-momentum": OptimizerShape("SGD with momentum", moments=1, step_bytes=0),
}


@dataclass(frozen=True)
class Training:
    """The run settings model-state bytes depend on.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.
        optimizer: what the optimizer keeps.
        device_type: ``"cuda"`` or ``"cpu"``. On CPU ranks "offloaded" memory is the same RAM: the engines still say
            which bytes they offloaded (and the planner reports them as host bytes), but Gemini's fp32 shards then
            stay their own masters.
    """

    precision: str
    optimizer: OptimizerShape
    device_type: DeviceType = "cuda"

    @property
    def parameter_bytes(self) -> int:
        """Bytes per parameter element as stored (``precision.py``: ``parameter_dtype``)."""
        return 2 if self.precision == "bf16-true" else FP32

    @property
    def mixed(self) -> bool:
        return self.precision in ("bf16-mixed", "16-mixed")


@dataclass(frozen=True)
class Placed:
    """Bytes on the compute device and in host memory."""

    device: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host

    def __add__(self, other: Placed) -> Placed:
        return Placed(self.device + other.device, self.host + other.host)


def _at(size: int, on_host: bool) -> Placed:
    return Placed(host=size) if on_host else Placed(device=size)


@dataclass(frozen=True)
class ModelState:
    """One rank's model state, by category (the categories ``MemoryMonitor`` logs)."""

    parameters: Placed
    gradients: Placed
    optimizer_state: Placed

    @property
    def placed(self) -> Placed:
        return self.parameters + self.gradients + self.optimizer_state


def owned_numel(shapes: Sequence[Shape], world_size: int, rank: int) -> int:
    """Elements of ``shapes`` that ``rank`` owns (the engines' ``shard_spec``; a 0-dim tensor is owned whole)."""
    return sum(shard_spec(shape, world_size, rank).local_numel for shape in shapes)


def _numel(shapes: Sequence[Shape]) -> int:
    total = 0
    for shape in shapes:
        size = 1
        for dimension in shape:
            size *= dimension
        total += size
    return total


def _optimizer_state(elements: int, element_bytes: int, tensors: int, training: Training, on_host: bool) -> Placed:
    optimizer = training.optimizer
    return _at(optimizer.moments * element_bytes * elements, on_host) + Placed(host=optimizer.step_bytes * tensors)


def ddp_state(shapes: Sequence[Shape], training: Training) -> ModelState:
    """``colossal_ddp``: everything whole on every rank, in the parameters' dtype."""
    size, width = _numel(shapes), training.parameter_bytes
    return ModelState(
        parameters=Placed(device=width * size),
        gradients=Placed(device=width * size),
        optimizer_state=_optimizer_state(size, width, len(shapes), training, on_host=False),
    )


def zero_state(
    shapes: Sequence[Shape], training: Training, stage: int, offload: bool, world_size: int, rank: int
) -> ModelState:
    """``colossal_zero1/2`` (and their ``_offload``), as ``ZeroEngine.memory_report`` counts them.

    Whole parameters on the device; fp32 masters of the own rows unless fp32 parameters on the device serve as their
    own (``ZeroEngine.masters_alias_parameters``); gradients: stage 1 whole in the parameters' dtype (the reduction
    buckets), stage 2 the own rows in an fp32 accumulator, plus an fp32 master-gradient shard next to separate masters.
    """
    size, owned, width = _numel(shapes), owned_numel(shapes, world_size, rank), training.parameter_bytes
    separate_masters = offload or width != FP32
    master = _at(FP32 * owned, offload) if separate_masters else Placed()
    compute_gradients = Placed(device=width * size if stage == 1 else FP32 * owned)
    master_gradients = _at(FP32 * owned, offload) if separate_masters else Placed()
    return ModelState(
        parameters=Placed(device=width * size) + master,
        gradients=compute_gradients + master_gradients,
        optimizer_state=_optimizer_state(owned, FP32, len(shapes), training, on_host=offload),
    )


def fsdp_state(shapes: Sequence[Shape], training: Training, offload: bool, world_size: int, rank: int) -> ModelState:
    """``colossal_fsdp`` (FSDP2): own rows of everything in the parameters' dtype; all on the host when offloaded."""
    owned, width = owned_numel(shapes, world_size, rank), training.parameter_bytes
    return ModelState(
        parameters=_at(width * owned, offload),
        gradients=_at(width * owned, offload),
        optimizer_state=_optimizer_state(owned, width, len(shapes), training, on_host=offload),
    )


def gemini_state(
    shapes: Sequence[Shape], training: Training, setting: Setting, world_size: int, rank: int
) -> ModelState:
    """``colossal_gemini`` with a static placement, chunk by chunk as ``ChunkManager`` allocates them.

    Per chunk: the working shard (parameters' dtype) where the placement parks parameters; the fp32 master, fp32
    gradient shard and optimizer state where it puts the optimizer. The master is the shard itself when the shard is
    fp32 and on the same device (always on CPU ranks).
    """
    from lightning_colossal.planning.chunks import chunk_layout

    width = training.parameter_bytes
    total = ModelState(Placed(), Placed(), Placed())
    for chunk in chunk_layout(shapes, width, setting, world_size, rank):
        shard_on_host, master_on_host = chunk.parameters_offloaded, chunk.optimizer_offloaded
        # ``ChunkManager``: the master is the shard when both are fp32 on the same device; the CPU is both.
        aliased = width == FP32 and (shard_on_host == master_on_host or training.device_type == "cpu")
        master = Placed() if aliased else _at(FP32 * chunk.shard_numel, master_on_host)
        total = ModelState(
            parameters=total.parameters + _at(width * chunk.shard_numel, shard_on_host) + master,
            gradients=total.gradients + _at(FP32 * chunk.shard_numel, master_on_host),
            optimizer_state=total.optimizer_state
            + _optimizer_state(chunk.shard_numel, FP32, chunk.tensors, training, on_host=master_on_host),
        )
    return total


def model_state(
    shapes: Sequence[Shape], setting: Setting, training: Training, world_size: int, rank: int
) -> ModelState:
    """One rank's model state under ``setting``: ``shapes`` are the whole trainable parameters, except for hybrid,
    where they are one tensor-parallel rank's pieces and ``world_size`` is the data-parallel size."""
    if setting.family == "ddp":
        return ddp_state(shapes, training)
    if setting.family in ("zero", "hybrid"):
        return zero_state(shapes, training, setting.zero_stage, setting.offload, world_size, rank)
    if setting.family == "fsdp":
        return fsdp_state(shapes, training, setting.offload, world_size, rank)
    return gemini_state(shapes, training, setting, world_size, rank)
