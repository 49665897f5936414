"""Gemini's automatic placement with a host-memory budget and the disk tier, as the planner weighs it.

``GeminiStrategy(placement=AutoPlacement(host_memory_budget=H), offload_dir=...)`` keeps every chunk's optimizer
(fp32 master, gradient shard, optimizer state) in host memory, and under a compute budget (a GPU always has one: its
memory, unless ``compute_memory_budget`` says less) it starts every parameter shard there too. ``GeminiEngine.
_open_disk_tier`` then sends the optimizer state of the *last* chunks to disk, one chunk at a time, until this rank's
host bytes, the tier's staging buffers included, fit H (``gemini/placement.py`` ``disk_by_host_budget``); when even
every chunk's state on disk does not fit, it refuses the budget (``HostBudgetTooSmall``). The planner calls the same
function on the same per-chunk bytes, with the chunks laid out as the engine lays them out (``chunks.chunk_layout``),
so its row puts on disk exactly the chunks the engine would: no 25% steps, as many chunks as the budget needs.

The budget counts chunk tensors only; the planner counts more in host memory: Adam's ``step`` scalars (4 bytes per
parameter tensor, kept on the CPU) and, on CPU ranks, the activations and working memory that share the host. So the
budget the planner names is the rank's share of the node's host memory less those bytes (``outside_budget_bytes``),
rounded down to whole MiB (``budget_from``); what the engine then keeps in host memory, plus those bytes, stays within
the share.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_colossal.planning.chunks import ChunkShape, chunk_layout
from lightning_colossal.planning.disk_tier import disk_records
from lightning_colossal.planning.model_state import FP32, ModelState, Shape, Training, shard_is_master
from lightning_colossal.planning.settings import Setting
from lightning_colossal.planning.units import MIB, format_bytes

__all__ = [
    "budget_from",
    "budget_note",
    "disk_chunks_for_budget",
    "engine_host_bytes",
    "outside_budget_bytes",
]


def engine_host_bytes(chunks: Sequence[ChunkShape], training: Training) -> tuple[list[int], list[int]]:
    """Per chunk, (every byte it keeps in host memory with its optimizer state there, that state's bytes), as
    ``GeminiEngine._open_disk_tier`` counts them: the shard (automatic placement may park any shard on the host), the
    fp32 master unless the shard is it, the fp32 gradient shard, and the record its state would take on disk (the
    tensors aligned as the tier lays them out, ``disk/optimizer_state.py`` ``record_bytes``)."""
    host, state = [], []
    for chunk in chunks:
        records = disk_records([chunk.member_numels], training.optimizer.moments, FP32).record_bytes
        record = records[0] if records else 0  # a rank with no rows of this chunk keeps no state for it
        master = 0 if shard_is_master(chunk, training) else FP32 * chunk.shard_numel
        host.append(training.parameter_bytes * chunk.shard_numel + master + FP32 * chunk.shard_numel + record)
        state.append(record)
    return host, state


def disk_chunks_for_budget(
    shapes: Sequence[Shape], training: Training, setting: Setting, world_size: int, rank: int
) -> frozenset[int] | None:
    """The chunks whose optimizer state ``GeminiEngine`` on ``rank`` sends to disk under ``setting``'s
    ``host_memory_budget`` (a ``host_budget_setting``); ``None`` where the engine refuses the budget
    (``HostBudgetTooSmall``: this rank's host bytes exceed it even with every chunk's state on disk)."""
    from lightning_colossal.disk.optimizer_state import staging_bytes_for
    from lightning_colossal.gemini.placement import HostBudgetTooSmall, disk_by_host_budget

    assert setting.host_memory_budget is not None, "pass a host_budget_setting"
    host, state = engine_host_bytes(chunk_layout(shapes, training.parameter_bytes, setting, world_size, rank), training)
    try:
        return disk_by_host_budget(
            host, state, setting.host_memory_budget, has_disk=True, staging_bytes=staging_bytes_for
        )
    except HostBudgetTooSmall:
        return None


def outside_budget_bytes(host_bytes_per_rank: int, state: ModelState, training: Training, tensors: int) -> int:
    """Of the host bytes the planner counts for one rank with nothing on disk (``host_bytes_per_rank``, ``state``),
    those ``host_memory_budget`` does not: Adam's ``step`` scalars (``tensors`` of them) and whatever is not model
    state (on CPU ranks the activations and working memory; on a GPU nothing, as Gemini's working memory is there)."""
    steps = training.optimizer.step_bytes * tensors
    return host_bytes_per_rank - (state.placed.host - steps)


def budget_from(usable_bytes: int) -> int:
    """A ``host_memory_budget`` of ``usable_bytes`` rounded down to whole MiB, and one MiB at least (``AutoPlacement``
    takes positive budgets only; one that small is refused for any real model)."""
    return max(MIB, usable_bytes // MIB * MIB)


def budget_note(setting: Setting, share: float, outside: int, training: Training, chunks: int, refused: bool) -> str:
    """The host-budget row's note: its budget (``share`` of the rank's share of the node's host memory, less
    ``outside`` bytes it does not count), and what the engine does under it: the last of ``chunks`` chunks' state on
    disk, or (``refused``) a refusal."""
    assert setting.host_memory_budget is not None
    uncounted = "the optimizer's step scalars"
    if training.device_type == "cpu":
        uncounted += ", the activations and working memory"
    budget = f"host_memory_budget={format_bytes(setting.host_memory_budget)}"
    chosen = f"{share:.0%} of the rank's share of the node's host memory"
    if outside:
        chosen += f", less {format_bytes(outside)} it does not count ({uncounted})"
    if refused:
        return (
            f"{setting.label} does not fit: the engine refuses {budget} (HostBudgetTooSmall), as this rank's host"
            f" bytes exceed it even with every chunk's optimizer state on disk; the budget is {chosen}"
        )
    on_disk = len(setting.disk_chunks)
    what = f"the optimizer state of the last {on_disk} of {chunks} chunks on disk" if on_disk else "nothing on disk"
    note = f"{setting.label}: {budget} is {chosen}; under it the engine puts {what}"
    if training.device_type == "cuda":
        note += (
            "; the GPU figure has every shard in host memory, as automatic placement starts them, and it keeps chunks"
            " on the GPU as its compute budget allows"
        )
    return note
