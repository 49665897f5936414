"""torch FSDP2 (``fully_shard``) applied per block and per root, and undone at the end of a run; no Lightning here."""

from lightning_colossal.fsdp.exchange import drop_kept_buffers
from lightning_colossal.fsdp.gradients import UnusedGradientTracker, include_unused_parameters_in_reduction
from lightning_colossal.fsdp.initialise import initialise_shards, storage_free_template
from lightning_colossal.fsdp.whole import full_tensor, full_tensors
from lightning_colossal.fsdp.wrap import (
    detect_block_classes,
    shard_model,
    sharded_roots,
    unshard_model,
)

__all__ = [
    "UnusedGradientTracker",
    "drop_kept_buffers",
    "include_unused_parameters_in_reduction",
    "detect_block_classes",
    "full_tensor",
    "full_tensors",
    "initialise_shards",
    "storage_free_template",
    "shard_model",
    "sharded_roots",
    "unshard_model",
]
