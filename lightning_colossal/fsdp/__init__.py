"""torch FSDP2 (``fully_shard``) applied per block and per root; no Lightning here."""

from lightning_colossal.fsdp.wrap import detect_block_classes, materialize_meta_parameters, shard_model

__all__ = ["detect_block_classes", "materialize_meta_parameters", "shard_model"]
