"""Fixtures shared by the whole test suite.

Multi-process tests (see ``tests/harness/rank_pool.py``):

- ``rank_pool_1``, ``rank_pool_2``, ``rank_pool_4``: session-wide pools of 1, 2 and 4 gloo ranks, each started the
  first time a test asks for it. ``pool.run(body, *args, timeout=...)`` runs a module-level ``body`` on every rank and
  returns the per-rank results. The 1-rank pool runs single-rank bodies (e.g. "resume at 1 rank") in a worker
  process, never in the pytest process itself.
- ``rank_pools``: the registry behind them, ``rank_pools.get(world_size)`` for other sizes.

Files: pass ``str(tmp_path)`` to the body as an argument; all ranks share the file system.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.harness.rank_pool import RankPool, RankPools


@pytest.fixture(scope="session")
def rank_pools() -> Iterator[RankPools]:
    """Lazily started rank pools, one per world size, closed at the end of the session."""
    # Imported here so that test runs without multi-process tests never load the harness.
    from tests.harness.rank_pool import RankPools

    pools = RankPools()
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def rank_pool_1(rank_pools: RankPools) -> RankPool:
    """A pool of one gloo rank (a worker process, not the pytest process)."""
    return rank_pools.get(1)


@pytest.fixture(scope="session")
def rank_pool_2(rank_pools: RankPools) -> RankPool:
    """A pool of two gloo ranks."""
    return rank_pools.get(2)


@pytest.fixture(scope="session")
def rank_pool_4(rank_pools: RankPools) -> RankPool:
    """A pool of four gloo ranks."""
    return rank_pools.get(4)
