"""The point-to-point all-gather and reduce-scatter of gloo ([Note: direct exchanges on gloo]), against values
computed by hand: every rank's slot lands in its place, sums are exact in rank order, and a slot every rank holds
in full (a replicated parameter) gets the same bits everywhere."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_colossal.distributed import collectives

SLOT = 1031  # odd, so no slot happens to line up with anything


def _contribution(rank: int, world_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s rank-major input: values of very different magnitudes, so the order of a sum shows in its
    last bits."""
    generator = torch.Generator().manual_seed(rank)
    magnitudes = 10.0 ** torch.randint(-4, 5, (world_size * SLOT,), generator=generator)
    values = torch.randn(world_size * SLOT, generator=generator) * magnitudes
    return values.to(dtype)


def exchange_body(dtype_name: str, asynchronous: bool) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs = [_contribution(source, world_size, dtype) for source in range(world_size)]

    output = torch.full((SLOT,), float("nan"), dtype=dtype)
    work = collectives.reduce_scatter_async(output, inputs[rank].clone())
    work.wait()
    expected_sum = inputs[0].view(world_size, SLOT)[rank].clone()
    for source in range(1, world_size):
        expected_sum += inputs[source].view(world_size, SLOT)[rank]

    gathered = torch.full((world_size * SLOT,), float("nan"), dtype=dtype)
    own = inputs[rank][:SLOT]
    if asynchronous:
        handle = collectives.all_gather_into_async(gathered, own)
        handle.wait()
    else:
        collectives.all_gather_into(gathered, own)
    expected_gather = torch.cat([inputs[source][:SLOT] for source in range(world_size)])

    # A replicated slot: every rank contributes the whole tensor in every slot, so every rank sums the same values.
    replicated_input = torch.cat([inputs[rank][:SLOT]] * world_size)
    replicated = torch.empty(SLOT, dtype=dtype)
    collectives.reduce_scatter_async(replicated, replicated_input).wait()
    return {
        "sum_exact": torch.equal(output, expected_sum),
        "gather_exact": torch.equal(gathered, expected_gather),
        "replicated": replicated,
        "completed_after_wait": work.is_completed(),
    }


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
@pytest.mark.parametrize("asynchronous", [False, True])
def test_four_ranks_get_exact_slots_and_sums(rank_pool_4, dtype_name, asynchronous):
    results = rank_pool_4.run(exchange_body, dtype_name, asynchronous)
    for rank, result in enumerate(results):
        assert result["sum_exact"], f"rank {rank}: the reduce-scatter is not the rank-order sum of its slot"
        assert result["gather_exact"], f"rank {rank}: the all-gather misplaced a slot"
        assert result["completed_after_wait"]
        # Replicated rows: the same bits on every rank, or replicated parameters would drift apart.
        assert torch.equal(result["replicated"], results[0]["replicated"]), f"rank {rank} summed in another order"


def test_two_ranks(rank_pool_2):
    for result in rank_pool_2.run(exchange_body, "float32", True):
        assert result["sum_exact"] and result["gather_exact"]


def watched_body(count: int) -> dict[str, Any]:
    """``count`` watched reduce-scatters in flight at once ([Note: a thread that watches exchanges]): each must turn
    complete without a ``wait()``, and ``wait()`` must then give the rank-order sum."""
    import time

    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs = [
        _contribution(source + 10 * index, world_size, torch.float32)
        for index in range(count)
        for source in range(world_size)
    ]
    outputs, works = [], []
    for index in range(count):
        output = torch.full((SLOT,), float("nan"))
        own = inputs[index * world_size + rank].clone()
        work, received = collectives.reduce_own_slot_async(
            own, None, scatter=True, output=output, reports_completion=True
        )
        outputs.append(received)
        works.append(work)
    deadline = time.monotonic() + 30
    while not all(work.is_completed() for work in works) and time.monotonic() < deadline:
        time.sleep(0.01)
    completed_without_wait = all(work.is_completed() for work in works)
    for work in works:
        work.wait()
    exact = []
    for index, output in enumerate(outputs):
        expected = inputs[index * world_size].view(world_size, SLOT)[rank].clone()
        for source in range(1, world_size):
            expected += inputs[index * world_size + source].view(world_size, SLOT)[rank]
        exact.append(torch.equal(output, expected))
    # A plain exchange after the watched ones still matches in order on the same group.
    gathered = torch.empty(world_size * SLOT)
    collectives.all_gather_into(gathered, inputs[rank][:SLOT])
    return {
        "completed_without_wait": completed_without_wait,
        "exact": exact,
        "gather_exact": torch.equal(gathered, torch.cat([inputs[source][:SLOT] for source in range(world_size)])),
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_watched_exchanges_complete_by_themselves_and_sum_in_rank_order(request, world_size):
    pool = request.getfixturevalue(f"rank_pool_{world_size}")
    for rank, result in enumerate(pool.run(watched_body, 3)):
        assert result["completed_without_wait"], f"rank {rank}: a watched exchange never reported completion"
        assert all(result["exact"]), f"rank {rank}: a watched reduce-scatter is not the rank-order sum"
        assert result["gather_exact"]


def in_place_body() -> dict[str, Any]:
    """A reduce-scatter given a scratch and no output ([Note: direct exchanges on gloo]): the sum lands in the scratch
    or the input, still the rank-order sum, and for a replicated slot the same bits on every rank."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    inputs = [_contribution(source, world_size, torch.float32) for source in range(world_size)]
    own = inputs[rank].clone()
    scratch = torch.full(((world_size - 1) * SLOT,), float("nan"))
    work, result = collectives.reduce_own_slot_async(own, None, scatter=True, reports_completion=True, scratch=scratch)
    work.wait()
    expected = inputs[0].view(world_size, SLOT)[rank].clone()
    for source in range(1, world_size):
        expected += inputs[source].view(world_size, SLOT)[rank]
    home = own if rank == 0 else scratch
    replicated_input = torch.cat([inputs[rank][:SLOT]] * world_size)
    replicated_scratch = torch.empty((world_size - 1) * SLOT)
    replicated_work, replicated = collectives.reduce_own_slot_async(
        replicated_input, None, scatter=True, scratch=replicated_scratch
    )
    replicated_work.wait()
    return {
        "exact": torch.equal(result, expected),
        "in_own_buffers": result.untyped_storage().data_ptr() == home.untyped_storage().data_ptr(),
        "replicated": replicated.clone(),
    }


def test_a_reduce_scatter_with_scratch_sums_in_place_in_rank_order(rank_pool_4):
    results = rank_pool_4.run(in_place_body)
    for rank, result in enumerate(results):
        assert result["exact"], f"rank {rank}: the in-place reduce-scatter is not the rank-order sum"
        assert result["in_own_buffers"], f"rank {rank}: the sum went to a fresh buffer instead of the scratch/input"
        assert torch.equal(result["replicated"], results[0]["replicated"]), f"rank {rank} summed in another order"
