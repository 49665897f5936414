"""Sequence parallelism's memory: activation bytes per rank against sequence length (``activation_memory``)."""
