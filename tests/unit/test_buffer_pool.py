"""``engine_parts/buffer_pool.py``: host buffers handed out again only once nothing but the pool holds them."""

from __future__ import annotations

import torch

from lightning_colossal.engine_parts.buffer_pool import SMALLEST_POOLED_BYTES, BufferPool

CPU = torch.device("cpu")
NUMEL = SMALLEST_POOLED_BYTES // 4  # float32: just at the floor


def test_a_buffer_still_viewed_elsewhere_is_not_handed_out_again():
    pool = BufferPool()
    gathered = pool.take(NUMEL, torch.float32, CPU, zeroed=False)
    gathered.fill_(3.0)
    saved_by_autograd = gathered[:10].view(2, 5)  # a view that outlives the engine's own reference
    pool.give_back(gathered)
    del gathered
    other = pool.take(NUMEL, torch.float32, CPU, zeroed=True)
    assert pool.reused == 0 and torch.equal(saved_by_autograd, torch.full((2, 5), 3.0))
    del other
    # Once the view is gone the buffer is reused, zeroed when asked.
    del saved_by_autograd
    again = pool.take(NUMEL, torch.float32, CPU, zeroed=True)
    assert pool.reused == 1 and not again.any()


def test_views_given_back_keep_the_flat_buffer_and_sizes_and_devices_outside_the_pool_are_not_kept():
    pool = BufferPool(kept_per_size=2)
    staging = pool.take(2 * NUMEL, torch.float32, CPU, zeroed=False).view(2, NUMEL)
    pool.give_back(staging)
    del staging
    flat = pool.take(2 * NUMEL, torch.float32, CPU, zeroed=False)
    assert pool.reused == 1 and flat.shape == (2 * NUMEL,)
    small = pool.take(16, torch.float32, CPU, zeroed=True)
    pool.give_back(small)
    assert pool._kept.get((16, torch.float32)) is None
    # At most kept_per_size per size: a third buffer is not kept while the two kept ones are free.
    buffers = [pool.take(NUMEL, torch.float32, CPU, zeroed=False) for _ in range(3)]
    for buffer in buffers:
        pool.give_back(buffer)
    assert len(pool._kept[(NUMEL, torch.float32)]) == 2
    pool.clear()
    assert not pool._kept
