"""ZeRO-1/2 (ColossalAI's LowLevelZero): sharded optimizer state and gradients. Knows nothing of Lightning."""

from lightning_colossal.zero.engine import ZeroEngine, ZeroMemoryReport
from lightning_colossal.zero.layout import ShardSpec, owned_rows, plan_buckets, shard_spec

__all__ = ["ShardSpec", "ZeroEngine", "ZeroMemoryReport", "owned_rows", "plan_buckets", "shard_spec"]
