"""Automatic placement at run time: before a module runs, move chunks off the compute device until its chunks fit.

The decision itself is pure logic in ``placement.py`` (``choose_evictions``: Belady's rule over the warm-up trace);
this module gathers its inputs from the live chunks and the trace, and carries it out through the manager.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lightning_colossal.config import AutoPlacement
from lightning_colossal.distributed import device as devices
from lightning_colossal.gemini.chunk import Chunk, ChunkState, Location
from lightning_colossal.gemini.manager import ChunkManager
from lightning_colossal.gemini.placement import BudgetTooSmall, NextUse, choose_evictions
from lightning_colossal.gemini.tracer import MemoryTracer


class Evictor:
    """Keeps the model's bytes on the compute device within ``placement``'s budget.

    Args:
        manager: every chunk of this rank.
        tracer: the warm-up trace (non-model memory per op, and the op order eviction looks ahead in).
        placement: the automatic placement settings.
        compute_device: where modules run (its memory is the budget when ``placement`` names none).
        resident_bytes: model bytes on the compute device now (chunks and optimizer state).
    """

    def __init__(
        self,
        manager: ChunkManager,
        tracer: MemoryTracer,
        placement: AutoPlacement,
        compute_device: torch.device,
        resident_bytes: Callable[[], int],
    ) -> None:
        self.manager = manager
        self.tracer = tracer
        self.placement = placement
        self.resident_bytes = resident_bytes
        self.budget = compute_budget(placement, compute_device)
        self.evictions = 0  # chunks moved off the compute device so far
        self._next_use: NextUse | None = None

    def make_room(self, needed: frozenset[int], position: int) -> None:
        """Move chunks off the compute device until the chunks ``needed`` by the op at ``position`` fit the budget."""
        if math.isinf(self.budget):
            return
        placement = self.placement
        needed_bytes = self._bytes_to_bring(needed)
        resident = self.resident_bytes()
        if self.tracer.finished:
            budget = int(self.budget * placement.steady_compute_cap_ratio)
            non_model = self.tracer.expected_non_model_bytes(position)
            if budget - non_model - resident >= needed_bytes:
                return  # fits as it is (choose_evictions would choose nothing): no candidates, no distances
            evictable = self._evictable(needed)
            if self._next_use is None:  # the trace is fixed once finished
                self._next_use = NextUse(self.tracer.sequence)
            next_use = {index: self._next_use.distance(position, index) for index in evictable}
        else:
            evictable = self._evictable(needed)
            budget = int(self.budget)
            non_model = int(self.budget * placement.warmup_non_model_data_ratio)
            next_use = {}
        try:
            victims = choose_evictions(evictable, needed_bytes, resident, non_model, budget, next_use)
        except BudgetTooSmall as error:
            if not self.tracer.finished:
                # Warm-up works from a guess of activation memory; evict all it can and learn the real figure.
                victims = list(evictable)
            else:
                raise BudgetTooSmall(
                    f"{error} (AutoPlacement(compute_memory_budget={placement.compute_memory_budget}) times"
                    f" steady_compute_cap_ratio={placement.steady_compute_cap_ratio} leaves {budget} bytes usable.)"
                ) from None
        self.evictions += len(victims)
        for index in victims:
            chunk = self.manager.chunks[index]
            if chunk.state is ChunkState.GATHERED:
                self.manager.release(chunk)
            self.manager.move_shard(chunk, Location.OFFLOAD)

    def _bytes_to_bring(self, needed: frozenset[int]) -> int:
        """Compute-device bytes the ``needed`` chunks still have to take: gathered buffers, and evicted shards."""
        total = 0
        for index in needed:
            chunk = self.manager.chunks[index]
            if not chunk.is_gathered and chunk.state is not ChunkState.GATHERING:
                total += _full_bytes(chunk)
                if chunk.shard_location is Location.OFFLOAD:
                    total += chunk.shard.numel() * chunk.shard.element_size()
        return total

    def _evictable(self, needed: frozenset[int]) -> dict[int, int]:
        """Chunks that may leave the compute device now, with the bytes each would free there."""
        evictable: dict[int, int] = {}
        for chunk in self.manager.chunks:
            if chunk.index in needed or chunk.state not in (ChunkState.SHARDED, ChunkState.GATHERED):
                continue
            freed = _full_bytes(chunk) if chunk.state is ChunkState.GATHERED else 0
            if chunk.shard_location is Location.COMPUTE and chunk.index not in self.manager.plan.offload_parameters:
                freed += chunk.shard.numel() * chunk.shard.element_size()
            if freed:
                evictable[chunk.index] = freed
        return evictable


def _full_bytes(chunk: Chunk) -> int:
    """Bytes of the chunk's gathered buffer."""
    return chunk.spec.numel * chunk.shard.element_size()


def compute_budget(placement: AutoPlacement, compute_device: torch.device) -> float:
    """Bytes of compute memory the model may use: the placement's budget, else the whole device (none on CPU)."""
    if placement.compute_memory_budget is not None:
        return float(placement.compute_memory_budget)
    capacity = devices.total_memory(compute_device)
    return math.inf if capacity is None else float(capacity)
