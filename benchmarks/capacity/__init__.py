"""Benchmark study: the largest model each strategy trains under a device-memory budget."""
