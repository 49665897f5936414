"""Working memory on top of model state: buffers that exist while a step runs (estimates, not exact).

- ``colossal_ddp``: nothing beyond the gradients: ``ColossalDDPStrategy`` passes ``gradient_as_bucket_view=True`` by
  default, so each ``.grad`` is a view into DDP's buckets (with ``False``, torch's own default, the reducer would keep
  a second copy of every gradient, which ``MemoryMonitor`` does not see as it counts ``.grad`` only).
- ZeRO: pooled communication buffers (``zero/stages.py`` [Note: bounded staging]): stage 2 keeps up to two buckets in
  flight, each staged rank-major as ``world_size`` slots of a bucket, plus one for the parameter exchange; stage 1
  reduces in the gradients themselves and needs about two buckets for the exchange.
- Gemini: the gathered chunks in use (about two: the one computing and the one whose gradients are being reduced) and
  one chunk's fp32 full gradient (``gemini/manager.py``; ``max_prefetch`` adds more, 0 by default). Without
  activation checkpointing and without autocast, autograd keeps views of every chunk's gathered weights from its
  forward to its backward (``gemini/manager.py`` [Note: weights autograd saved]), so at the start of backward every
  chunk is gathered once: that is the peak then.
- The disk tier: a step streams the records on disk through 3 host buffers of the largest record
  (``disk/optimizer_state.py``: one being read, one stepped, one written); exact, as ``disk_staging_bytes``.
- FSDP2: the root unit (everything outside the blocks: embeddings, final norm, head) stays gathered for the whole step
  with its unsharded gradient, plus two blocks' gathered parameters (the one running and the prefetched one) and one
  block's unsharded gradient; mixed precision gathers in the compute dtype and reduces in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_colossal.engine_parts.rows import shard_spec
from lightning_colossal.planning.chunks import chunk_layout
from lightning_colossal.planning.disk_tier import DiskRecords
from lightning_colossal.planning.model_shape import ModelShape
from lightning_colossal.planning.model_state import FP32, Placed, Training, disk_records_of
from lightning_colossal.planning.settings import Setting

__all__ = ["Working", "working_memory"]

# Mirror MAX_STAGE2_BUCKETS_IN_FLIGHT in lightning_colossal/zero/stages.py and MAX_EXCHANGES_IN_FLIGHT in
# lightning_colossal/zero/exchange.py (tests/unit/test_plan.py checks both).
STAGE2_BUCKETS_IN_FLIGHT = 2
EXCHANGES_IN_FLIGHT = 2


@dataclass(frozen=True)
class Working:
    """Working memory of one rank and what it is."""

    placed: Placed
    what: str
    #: The rank's records in the disk tier, whose staging buffers ``placed`` counts (none without the tier).
    disk_records: DiskRecords = DiskRecords()


def _zero_buffers(shapes: Sequence[tuple[int, ...]], training: Training, stage: int, world_size: int) -> Working:
    from lightning_colossal.config import ZeroConfig, bucket_numel

    bucket = bucket_numel(ZeroConfig().bucket_size_mb)  # as the ZeRO engine buckets
    width = training.parameter_bytes
    if stage == 1:
        # Each exchange in flight holds this rank's rows of a bucket and the bucket gathered from every rank.
        filled = min(bucket + max(math.prod(shape) for shape in shapes), sum(math.prod(shape) for shape in shapes))
        exchange = EXCHANGES_IN_FLIGHT * (filled + math.ceil(filled / world_size)) * width
        return Working(Placed(device=exchange), f"{EXCHANGES_IN_FLIGHT} bucket exchanges in flight after the step")
    slots = [shard_spec(shape, world_size, 0).slot_numel for shape in shapes]
    filled = min(bucket + max(slots), sum(slots))
    # The exchanges' gathered buckets reuse the staging buckets; their rows to send are extra.
    staging = ((STAGE2_BUCKETS_IN_FLIGHT + 1) * world_size + EXCHANGES_IN_FLIGHT) * filled * width
    return Working(
        Placed(device=staging),
        f"{STAGE2_BUCKETS_IN_FLIGHT + 1} rank-major staging buckets + the rows of {EXCHANGES_IN_FLIGHT} exchanges",
    )


def _gemini_buffers(
    shapes: Sequence[tuple[int, ...]],
    training: Training,
    setting: Setting,
    world_size: int,
    activation_checkpointing: bool,
) -> Working:
    chunks = chunk_layout(shapes, training.parameter_bytes, setting, world_size, 0)
    largest = max(chunk.numel for chunk in chunks)
    if not activation_checkpointing and not training.mixed:
        # Autograd holds every chunk's gathered weights until its backward (see the module docstring).
        gathered = max(sum(chunk.numel for chunk in chunks), 2 * largest)
        size = gathered * training.parameter_bytes + FP32 * largest
        return Working(
            Placed(device=size),
            f"every chunk gathered ({len(chunks)}: autograd keeps the weights for backward) + 1 fp32 full gradient",
        )
    size = 2 * largest * training.parameter_bytes + FP32 * largest
    return Working(Placed(device=size), f"2 gathered chunks of {largest:,} elements + 1 fp32 full gradient")


def _fsdp_buffers(model: ModelShape, training: Training) -> Working:
    gathered = 2 if training.mixed else training.parameter_bytes
    reduced = FP32 if training.mixed else training.parameter_bytes
    blocks = model.block_numels()
    root = model.numel - sum(blocks)
    block = max(blocks, default=0)
    size = root * (gathered + reduced) + 2 * block * gathered + block * reduced
    return Working(Placed(device=size), "root unit gathered + 2 blocks gathered + 1 block's gradient")


def working_memory(
    model: ModelShape, setting: Setting, training: Training, world_size: int, activation_checkpointing: bool = False
) -> Working:
    """Estimated working memory of the fullest rank under ``setting`` (``world_size``: data-parallel ranks)."""
    working = _buffers(model, setting, training, world_size, activation_checkpointing)
    records = disk_records_of(model.shapes, setting, training, world_size, 0)
    if not records.staging_bytes:
        return working
    return Working(
        working.placed + Placed(host=records.staging_bytes),
        f"{working.what} + up to 3 staging records of the disk tier on the host",
        records,
    )


def _buffers(
    model: ModelShape, setting: Setting, training: Training, world_size: int, activation_checkpointing: bool
) -> Working:
    if setting.family == "ddp":
        # colossal_ddp's default gradient_as_bucket_view=True: the gradients counted above are DDP's buckets.
        return Working(Placed(), "none: gradients are views into DDP's buckets (gradient_as_bucket_view=True)")
    if setting.family == "zero":
        return _zero_buffers(model.shapes, training, setting.zero_stage, world_size)
    if setting.family == "hybrid":
        return _zero_buffers(model.tensor_parallel_shapes(setting.tp_size), training, setting.zero_stage, world_size)
    if setting.family == "gemini":
        return _gemini_buffers(model.shapes, training, setting, world_size, activation_checkpointing)
    return _fsdp_buffers(model, training)
