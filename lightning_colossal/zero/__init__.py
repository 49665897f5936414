"""ZeRO-1/2 (ColossalAI's LowLevelZero): sharded optimizer state and gradients. Knows nothing of Lightning."""

from lightning_colossal.zero.engine import ReducedGradient, ZeroEngine, ZeroMemoryReport
from lightning_colossal.zero.layout import plan_buckets

__all__ = ["ReducedGradient", "ZeroEngine", "ZeroMemoryReport", "plan_buckets"]
