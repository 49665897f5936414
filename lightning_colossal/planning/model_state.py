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
- The disk tier (``lightning_colossal/disk``: ``ZeroConfig(disk_fraction=...)``, ``StaticPlacement(disk_fraction=...)``)
  keeps the optimizer state shaped like the parameters (Adam's two moments, SGD's momentum) on disk between steps; the
  gradient shards and Adam's ``step`` scalars stay in host memory. Gemini counts its share in chunk bytes from the
  first chunk (``static_plan``, as ``offload_optim_frac``), one record per chunk; ZeRO counts it over this rank's rows
  in parameter order from the first, in records of about one gradient bucket. The disk bytes are the tier's records as
  it lays them out (``disk_tier.disk_records``: each tensor aligned to 64 bytes, each record to 4 KiB), which each
  optimizer step reads and writes once.
- Masters on disk (``masters_on_disk``; ``disk/optimizer_state.py`` [Note: masters on disk]): the fp32 masters of the
  shards whose state is on disk move into the same records, ahead of the state, and leave host memory. Only a master
  that is a separate tensor moves: ZeRO's always are under ``cpu_offload`` (which the disk tier needs); a Gemini chunk
  whose fp32 shard is its own master (``shard_is_master``) keeps it, and its record holds the state alone. The moved
  masters' own bytes (4 per element) are counted as parameters on disk, the rest of the records (state and alignment)
  as optimizer state on disk, so the two add up to the tier's file.
- Automatic placement with a host budget (``AutoPlacement(host_memory_budget=...)``, ``host_budget.py``): counted like
  the fully offloaded Gemini, except that on a GPU every fp32 master is a copy apart from its shard (the shard moves to
  the device when a module needs it), and the chunks on disk are the last ones the engine's budget sends there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from lightning_colossal.engine_parts.rows import shard_spec
from lightning_colossal.planning.disk_tier import DiskRecords, disk_records
from lightning_colossal.planning.settings import Setting

if TYPE_CHECKING:
    from lightning_colossal.planning.chunks import ChunkShape

__all__ = [
    "OPTIMIZERS",
    "ModelState",
    "OptimizerShape",
    "Placed",
    "Training",
    "disk_records_of",
    "model_state",
    "owned_numel",
    "shard_is_master",
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
    """Bytes on the compute device, in host memory and on disk (the disk tier: between optimizer steps only)."""

    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def total(self) -> int:
        """Every byte, wherever it lives."""
        return self.device + self.host + self.disk

    @property
    def in_memory(self) -> int:
        """The bytes in memory (device and host): what ``MemoryMonitor`` counts, which leaves out the disk tier's."""
        return self.device + self.host

    def __add__(self, other: Placed) -> Placed:
        return Placed(self.device + other.device, self.host + other.host, self.disk + other.disk)


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


def _disk_tier(groups: Sequence[Sequence[int]], masters: Sequence[bool], training: Training) -> tuple[Placed, Placed]:
    """The masters in ``groups`` (one record each, elements per master) in the disk tier, ``masters`` flagging the
    records that hold the masters' values too: (the moved masters' bytes, the rest of the records' bytes), both on
    disk; together they are the tier's file. What the tier leaves in memory between steps is a placeholder per state
    tensor and per moved master, a view of one shared zero, which the engines' reports count as 0 bytes
    (``disk/optimizer_state.py`` ``is_placeholder``)."""
    records = disk_records(groups, training.optimizer.moments, FP32, masters)
    moved = FP32 * sum(sum(group) for group, here in zip(groups, masters, strict=True) if here)
    return Placed(disk=moved), Placed(disk=records.file_bytes - moved)


def _zero_disk_groups(owned_each: Sequence[int], disk_fraction: float) -> list[list[int]]:
    """``ZeroEngine._open_disk_tier``: the first masters (this rank's rows, in parameter order) whose elements add up
    to at most ``disk_fraction`` of them, in records of about one gradient bucket of masters each."""
    if disk_fraction <= 0:
        return []
    from lightning_colossal.config import ZeroConfig, bucket_numel

    record_numel = bucket_numel(ZeroConfig().bucket_size_mb)
    limit = disk_fraction * sum(owned_each) * (1 + 1e-9)
    groups: list[list[int]] = []
    counted = 0
    for numel in owned_each:
        if counted + numel > limit:
            break
        counted += numel
        if not groups or sum(groups[-1]) >= record_numel:
            groups.append([])
        groups[-1].append(numel)
    return groups


def ddp_state(shapes: Sequence[Shape], training: Training) -> ModelState:
    """``colossal_ddp``: everything whole on every rank, in the parameters' dtype."""
    size, width = _numel(shapes), training.parameter_bytes
    return ModelState(
        parameters=Placed(device=width * size),
        gradients=Placed(device=width * size),
        optimizer_state=_optimizer_state(size, width, len(shapes), training, on_host=False),
    )


def zero_state(
    shapes: Sequence[Shape],
    training: Training,
    stage: int,
    offload: bool,
    world_size: int,
    rank: int,
    disk_fraction: float = 0.0,
    masters_on_disk: bool = False,
) -> ModelState:
    """``colossal_zero1/2`` (and their ``_offload``), as ``ZeroEngine.memory_report`` counts them.

    Whole parameters on the device; fp32 masters of the own rows unless fp32 parameters on the device serve as their
    own (``ZeroEngine.masters_alias_parameters``); gradients: stage 1 whole in the parameters' dtype (the reduction
    buckets), stage 2 the own rows in an fp32 accumulator, plus an fp32 master-gradient shard next to separate masters.
    ``disk_fraction`` (with ``offload``): the moments of the first parameters whose own rows add up to at most that
    share of this rank's rows live on disk, in the tier's records (``disk_tier.disk_records``); with
    ``masters_on_disk`` their fp32 masters too (``ZeroEngine`` allocates its flat master buffer for the rest only).
    """
    if disk_fraction > 0 and not offload:
        raise ValueError(f"disk_fraction={disk_fraction} needs offload: optimizer state on disk is stepped on the CPU.")
    if masters_on_disk and disk_fraction <= 0:
        raise ValueError("masters_on_disk needs disk_fraction > 0: the masters go to disk beside their shards' state.")
    size, width = _numel(shapes), training.parameter_bytes
    owned_each = [shard_spec(shape, world_size, rank).local_numel for shape in shapes]
    owned = sum(owned_each)
    on_disk = _zero_disk_groups(owned_each, disk_fraction)
    on_disk_numel = sum(map(sum, on_disk))
    separate_masters = offload or width != FP32
    # Under cpu_offload (which the disk tier needs) every master is a separate fp32 copy, so each one on disk leaves.
    resident_masters = owned - on_disk_numel if masters_on_disk else owned
    master = _at(FP32 * resident_masters, offload) if separate_masters else Placed()
    compute_gradients = Placed(device=width * size if stage == 1 else FP32 * owned)
    master_gradients = _at(FP32 * owned, offload) if separate_masters else Placed()
    optimizer_state = _optimizer_state(owned - on_disk_numel, FP32, len(shapes), training, on_host=offload)
    masters_moved, records = _disk_tier(on_disk, [masters_on_disk] * len(on_disk), training)
    return ModelState(
        parameters=Placed(device=width * size) + master + masters_moved,
        gradients=compute_gradients + master_gradients,
        optimizer_state=optimizer_state + records,
    )


def fsdp_state(shapes: Sequence[Shape], training: Training, offload: bool, world_size: int, rank: int) -> ModelState:
    """``colossal_fsdp`` (FSDP2): own rows of everything in the parameters' dtype; all on the host when offloaded."""
    owned, width = owned_numel(shapes, world_size, rank), training.parameter_bytes
    return ModelState(
        parameters=_at(width * owned, offload),
        gradients=_at(width * owned, offload),
        optimizer_state=_optimizer_state(owned, width, len(shapes), training, on_host=offload),
    )


def shard_is_master(chunk: ChunkShape, training: Training) -> bool:
    """Whether ``chunk``'s working shard is its own fp32 master (``ChunkManager``: both fp32 on the same device, and
    the shard not bound to move to the GPU under automatic placement; on CPU ranks the host is both), so there is no
    second copy, in memory or on disk."""
    shard_on_host, master_on_host = chunk.parameters_offloaded, chunk.optimizer_offloaded
    same_device = shard_on_host == master_on_host and not chunk.shard_moves
    return training.parameter_bytes == FP32 and (same_device or training.device_type == "cpu")


def _gemini_masters_on_disk(chunks: Sequence[ChunkShape], setting: Setting, training: Training) -> list[bool]:
    """Per chunk whose state is on disk, whether its master is in its record too: ``masters_on_disk`` moves only a
    master that is a separate tensor from the shard."""
    return [
        setting.masters_on_disk and not shard_is_master(chunk, training) for chunk in chunks if chunk.optimizer_on_disk
    ]


def gemini_state(
    shapes: Sequence[Shape], training: Training, setting: Setting, world_size: int, rank: int
) -> ModelState:
    """``colossal_gemini`` with a static placement (or automatic, with a host budget), chunk by chunk as ``ChunkManager``
    allocates them.

    Per chunk: the working shard (parameters' dtype) where the placement parks parameters; the fp32 master, fp32
    gradient shard and optimizer state where it puts the optimizer. The master is the shard itself when the shard is
    fp32 and on the same device (always on CPU ranks). Under ``setting.disk_fraction`` the first chunks' moments
    live on disk, one record per chunk (their gradient shards stay in host memory), and with
    ``setting.masters_on_disk`` their separate masters too; under a host budget, those of ``setting.disk_chunks``.
    """
    from lightning_colossal.planning.chunks import chunk_layout

    if setting.masters_on_disk and not setting.uses_disk:
        raise ValueError("masters_on_disk needs disk_fraction > 0: the masters go to disk beside their chunks' state.")
    width = training.parameter_bytes
    total = ModelState(Placed(), Placed(), Placed())
    chunks = chunk_layout(shapes, width, setting, world_size, rank)
    for chunk in chunks:
        shard_on_host, master_on_host = chunk.parameters_offloaded, chunk.optimizer_offloaded
        master_on_disk = setting.masters_on_disk and chunk.optimizer_on_disk
        # A master on disk is counted with its record below; a shard that is its own master has none apart.
        separate = not shard_is_master(chunk, training) and not master_on_disk
        master = _at(FP32 * chunk.shard_numel, master_on_host) if separate else Placed()
        total = ModelState(
            parameters=total.parameters + _at(width * chunk.shard_numel, shard_on_host) + master,
            gradients=total.gradients + _at(FP32 * chunk.shard_numel, master_on_host),
            optimizer_state=total.optimizer_state
            + _optimizer_state(
                0 if chunk.optimizer_on_disk else chunk.shard_numel, FP32, chunk.tensors, training, master_on_host
            ),
        )
    on_disk = [list(chunk.member_numels) for chunk in chunks if chunk.optimizer_on_disk]
    masters_moved, records = _disk_tier(on_disk, _gemini_masters_on_disk(chunks, setting, training), training)
    return ModelState(
        parameters=total.parameters + masters_moved,
        gradients=total.gradients,
        optimizer_state=total.optimizer_state + records,
    )


def disk_records_of(
    shapes: Sequence[Shape], setting: Setting, training: Training, world_size: int, rank: int
) -> DiskRecords:
    """One rank's records in the disk tier under ``setting`` (none without ``disk_fraction``)."""
    if not setting.uses_disk:
        return DiskRecords()
    if setting.family == "zero":
        owned_each = [shard_spec(shape, world_size, rank).local_numel for shape in shapes]
        groups = _zero_disk_groups(owned_each, setting.disk_fraction)
        masters = [setting.masters_on_disk] * len(groups)
    else:
        from lightning_colossal.planning.chunks import chunk_layout

        chunks = chunk_layout(shapes, training.parameter_bytes, setting, world_size, rank)
        groups = [list(chunk.member_numels) for chunk in chunks if chunk.optimizer_on_disk]
        masters = _gemini_masters_on_disk(chunks, setting, training)
    return disk_records(groups, training.optimizer.moments, FP32, masters)


def model_state(
    shapes: Sequence[Shape], setting: Setting, training: Training, world_size: int, rank: int
) -> ModelState:
    """One rank's model state under ``setting``: ``shapes`` are the whole trainable parameters, except for hybrid,
    where they are one tensor-parallel rank's pieces and ``world_size`` is the data-parallel size."""
    if setting.family == "ddp":
        return ddp_state(shapes, training)
    if setting.family in ("zero", "hybrid"):
        return zero_state(
            shapes,
            training,
            setting.zero_stage,
            setting.offload,
            world_size,
            rank,
            setting.disk_fraction,
            setting.masters_on_disk,
        )
    if setting.family == "fsdp":
        return fsdp_state(shapes, training, setting.offload, world_size, rank)
    return gemini_state(shapes, training, setting, world_size, rank)
