"""Prefetch: which chunks to gather ahead of use, asynchronously, from the op order traced in the warm-up step."""

from __future__ import annotations

from lightning_colossal.gemini.chunk import ChunkState, Location
from lightning_colossal.gemini.manager import ChunkManager
from lightning_colossal.gemini.tracer import MemoryTracer


class Prefetcher:
    """Picks up to ``max_prefetch`` chunks the next ops need; ``prefetched`` holds those started and not used yet."""

    def __init__(self, manager: ChunkManager, tracer: MemoryTracer, max_prefetch: int) -> None:
        self.manager = manager
        self.tracer = tracer
        self.max_prefetch = max_prefetch
        self.prefetched: set[int] = set()

    def candidates(self, position: int) -> set[int]:
        """Chunks of the next ops (in the traced order) to gather without waiting for them, within max_prefetch."""
        candidates: set[int] = set()
        if self.max_prefetch == 0 or not self.tracer.finished:
            return candidates
        chunks = self.manager.chunks
        sequence = self.tracer.sequence
        # Prefetched chunks not yet used count against the limit: the working set stays max_prefetch chunks ahead.
        self.prefetched = {
            index
            for index in self.prefetched
            if chunks[index].is_gathered or chunks[index].state is ChunkState.GATHERING
        }
        started = len(self.prefetched)
        for distance in range(1, len(sequence)):
            for index in sorted(sequence[(position + distance) % len(sequence)]):
                if started >= self.max_prefetch:
                    return candidates
                chunk = chunks[index]
                if (
                    chunk.state is ChunkState.SHARDED
                    and chunk.shard_location is Location.COMPUTE
                    and index not in candidates
                ):
                    candidates.add(index)
                    started += 1
        return candidates
