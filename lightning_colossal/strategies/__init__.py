"""Thin Lightning adapters over the engines; the only package that wires engines into Lightning's Trainer."""

from lightning_colossal.strategies.base import ColossalStrategy
from lightning_colossal.strategies.ddp import ColossalDDPStrategy
from lightning_colossal.strategies.engine_strategy import EngineStrategy
from lightning_colossal.strategies.fsdp import ColossalFSDPStrategy
from lightning_colossal.strategies.gemini import GeminiStrategy
from lightning_colossal.strategies.hybrid import HybridParallelStrategy
from lightning_colossal.strategies.zero import ZeroStrategy

ALL_STRATEGIES: tuple[type[ColossalStrategy], ...] = (
    ColossalDDPStrategy,
    ZeroStrategy,
    ColossalFSDPStrategy,
    GeminiStrategy,
    HybridParallelStrategy,
)

__all__ = [
    "ALL_STRATEGIES",
    "ColossalDDPStrategy",
    "ColossalFSDPStrategy",
    "ColossalStrategy",
    "EngineStrategy",
    "GeminiStrategy",
    "HybridParallelStrategy",
    "ZeroStrategy",
]
