"""Many DTensors gathered whole at once ([Note: gathering many shards at once] in ``fsdp/whole.py``), against the
values every rank distributed: uneven and empty shards, a split along dimension 1, several dtypes, replicated and
plain tensors, buckets smaller than one tensor, on gloo's point-to-point route and on the native all-gather."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist


def _tensors() -> list[tuple[torch.Tensor, str]]:
    """Whole values (the same on every rank: one seed) and how each is placed."""
    generator = torch.Generator().manual_seed(5)
    return [
        (torch.randn(7, 5, generator=generator), "shard0"),  # rows 2, 2, 2, 1 on 4 ranks
        (torch.randn(3, 4, generator=generator), "shard0"),  # a rank with no rows on 4 ranks
        (torch.randn(4, 9, generator=generator), "shard1"),  # split along columns
        (torch.randn(10, generator=generator).to(torch.bfloat16), "shard0"),  # another dtype, its own bucket
        (torch.randn(3, 3, generator=generator), "replicate"),
        (torch.tensor(3.0), "plain"),  # Adam's step
        (torch.randn(2, generator=generator), "shard0"),  # ranks with no rows on 3 and 4 ranks
        (torch.randn(64, 3, generator=generator).double(), "shard0"),
    ]


def gather_body(native: bool, bucket_bytes: int) -> dict[str, Any]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lightning_colossal.distributed import collectives
    from lightning_colossal.distributed.mesh import named_device_mesh
    from lightning_colossal.fsdp import full_tensors

    mesh = named_device_mesh("cpu", (dist.get_world_size(),), ("dp",))
    placements = {"shard0": [Shard(0)], "shard1": [Shard(1)], "replicate": [Replicate()]}
    wholes = _tensors()
    given = [value if how == "plain" else distribute_tensor(value, mesh, placements[how]) for value, how in wholes]
    if native:
        with collectives.native_route():
            gathered = full_tensors(given, torch.device("cpu"), bucket_bytes=bucket_bytes)
    else:
        gathered = full_tensors(given, bucket_bytes=bucket_bytes)
    pointers = [value.untyped_storage().data_ptr() for value in gathered if value.numel()]
    return {
        "exact": [
            value.dtype == expected.dtype and value.shape == expected.shape and torch.equal(value, expected)
            for value, (expected, _) in zip(gathered, wholes, strict=True)
        ],
        "plain_tensors": [type(value) is torch.Tensor for value in gathered],
        "separate_storage": len(set(pointers)) == len(pointers),
    }


@pytest.mark.parametrize("native", [False, True], ids=["point-to-point", "native"])
@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20], ids=["tiny-buckets", "one-bucket"])
def test_four_ranks_gather_every_tensor_exactly(rank_pool_4, native, bucket_bytes):
    for rank, result in enumerate(rank_pool_4.run(gather_body, native, bucket_bytes)):
        assert all(result["exact"]), f"rank {rank}: wrong whole values at {result['exact']}"
        assert all(result["plain_tensors"]), f"rank {rank}: a DTensor came back"
        assert result["separate_storage"], f"rank {rank}: two results share storage"


def test_two_ranks(rank_pool_2):
    for result in rank_pool_2.run(gather_body, False, 1 << 20):
        assert all(result["exact"]) and result["separate_storage"]


def exchange_count_body(native: bool) -> dict[str, int]:
    """How many exchanges gathering 40 sharded tensors whole takes (one bucket)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_colossal.distributed import collectives
    from lightning_colossal.distributed.mesh import named_device_mesh
    from lightning_colossal.fsdp import full_tensors, whole

    mesh = named_device_mesh("cpu", (dist.get_world_size(),), ("dp",))
    given = [distribute_tensor(torch.full((5, 3), float(index)), mesh, [Shard(0)]) for index in range(40)]
    counts = {"sizes": 0, "exchanges": 0}
    originals = {
        name: getattr(collectives, name) for name in ("all_gather_tensor", "all_gather_into", "all_gather_pieces_async")
    }

    def counted(name: str, key: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[key] += 1
            return originals[name](*args, **kwargs)

        return call

    whole.collectives.all_gather_tensor = counted("all_gather_tensor", "sizes")  # type: ignore[attr-defined]
    whole.collectives.all_gather_into = counted("all_gather_into", "exchanges")  # type: ignore[attr-defined]
    whole.collectives.all_gather_pieces_async = counted("all_gather_pieces_async", "exchanges")  # type: ignore[attr-defined]
    try:
        if native:
            with collectives.native_route():
                gathered = full_tensors(given)
        else:
            gathered = full_tensors(given)
    finally:
        for name, original in originals.items():
            setattr(collectives, name, original)
    assert all(torch.equal(value, torch.full((5, 3), float(index))) for index, value in enumerate(gathered))
    return counts


@pytest.mark.parametrize("native", [False, True], ids=["point-to-point", "native"])
def test_many_tensors_take_one_exchange_not_one_each(rank_pool_2, native):
    """The point of ``full_tensors``: giving the module back cost 1 s in one all-gather per tensor."""
    for counts in rank_pool_2.run(exchange_count_body, native):
        assert counts == {"sizes": 1, "exchanges": 1}
