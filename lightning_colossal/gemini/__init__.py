"""Gemini (ColossalAI's ZeRO-3 with chunk-based heterogeneous memory). Knows nothing of Lightning."""

from lightning_colossal.gemini.chunk import ChunkState, Location, check_transition
from lightning_colossal.gemini.engine import GeminiEngine, GeminiMemoryReport
from lightning_colossal.gemini.layout import ChunkSizeChoice, build_layout, pack, search_chunk_numel, wasted_numel

__all__ = [
    "ChunkSizeChoice",
    "ChunkState",
    "GeminiEngine",
    "GeminiMemoryReport",
    "Location",
    "build_layout",
    "check_transition",
    "pack",
    "search_chunk_numel",
    "wasted_numel",
]
