"""Benchmark study: bytes and time of every exchange of each strategy."""
