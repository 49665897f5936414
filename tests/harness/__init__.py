"""Test harness: a persistent pool of gloo ranks for multi-process tests (``rank_pool``)."""

from tests.harness.rank_pool import RankFailure, RankPool, RankPools, RankTimeout, current_rank, current_world_size

__all__ = ["RankFailure", "RankPool", "RankPools", "RankTimeout", "current_rank", "current_world_size"]
