"""How the ZeRO engine groups parameters into communication buckets (pure logic, no process group).

Which rows of a parameter each rank owns is shared with Gemini and lives in ``lightning_colossal.engine_parts.rows``
([Note: sharding along dim 0]).
"""

from __future__ import annotations

__all__ = ["plan_buckets"]


def plan_buckets(numels: list[int], bucket_numel: int) -> list[list[int]]:
    """Group consecutive items (indices into ``numels``) into buckets of at least ``bucket_numel`` elements.

    A bucket closes as soon as it reaches the size; an item larger than the size gets a bucket of its own.
    """
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be at least one element, got {bucket_numel}.")
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for index, numel in enumerate(numels):
        current.append(index)
        filled += numel
        if filled >= bucket_numel:
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets
