"""One portable, sharded checkpoint format for every strategy (see ``layout`` for what is on disk)."""

from lightning_colossal.checkpoint.consolidate import consolidate, read_sharded
from lightning_colossal.checkpoint.layout import (
    CheckpointFiles,
    CheckpointKind,
    checkpoint_kind,
    is_sharded_checkpoint,
    locate_checkpoint,
)

__all__ = [
    "CheckpointFiles",
    "CheckpointKind",
    "checkpoint_kind",
    "consolidate",
    "is_sharded_checkpoint",
    "locate_checkpoint",
    "read_sharded",
]
