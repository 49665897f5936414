"""User-facing monitoring callbacks."""

from lightning_colossal.callbacks.memory import MemoryMonitor
from lightning_colossal.callbacks.throughput import TokenThroughput

__all__ = ["MemoryMonitor", "TokenThroughput"]
