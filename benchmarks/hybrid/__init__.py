"""Benchmark study: pipeline bubbles, tensor-parallel bytes and sequence-parallel memory of colossal_hybrid."""
