"""Benchmark study: the training time a checkpoint save costs, synchronous against background (``async_checkpoint``)."""
