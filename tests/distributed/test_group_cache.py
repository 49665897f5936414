"""The process-group cache ([Note: one set of process groups per process] in ``distributed/group_cache.py``): a group
is made once and reused, and once someone destroys it the cache lets go of it, so its gloo transport thread (which
wakes every 10 ms for as long as anything refers to the group) ends instead of idling for the rest of the process."""

from __future__ import annotations

import gc
import os
from typing import Any

import torch
import torch.distributed as dist

GLOO_TRANSPORT_THREAD = "gloo_tcp_loop"


def _transport_threads() -> int:
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as handle:
                count += handle.read().strip() == GLOO_TRANSPORT_THREAD
        except OSError:
            continue
    return count


def destroyed_group_body() -> dict[str, Any]:
    from lightning_colossal.distributed import group_cache

    key = ("test_group_cache", tuple(range(dist.get_world_size())))
    first = group_cache.reuse_or_create(key, lambda: dist.new_group(backend="gloo"))
    reused = group_cache.reuse_or_create(key, lambda: dist.new_group(backend="gloo"))
    with_group = _transport_threads()
    reused_the_first = reused is first
    dist.destroy_process_group(first)
    del first, reused
    group_cache.forget_destroyed()
    gc.collect()
    after_forgetting = _transport_threads()
    again = group_cache.reuse_or_create(key, lambda: dist.new_group(backend="gloo"))
    total = torch.ones(1)
    dist.all_reduce(total, group=again)
    return {
        "reused_the_first": reused_the_first,
        "same_object": group_cache._cached[key] is again,
        "threads_with_group": with_group,
        "threads_after_forgetting": after_forgetting,
        "sum": total.item(),
    }


def test_a_destroyed_group_is_let_go_and_made_again(rank_pool_2):
    for rank, result in enumerate(rank_pool_2.run(destroyed_group_body)):
        assert result["reused_the_first"], f"rank {rank}: the second look-up made a second group"
        assert result["threads_after_forgetting"] == result["threads_with_group"] - 1, (
            f"rank {rank}: the destroyed group's transport thread is still running ({result})"
        )
        assert result["same_object"] and result["sum"] == 2.0, f"rank {rank}: the group made again does not work"
