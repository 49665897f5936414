"""Benchmark study: tokens/s, MFU and peak memory per strategy on a GPU."""
