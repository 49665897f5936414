"""The strategy's collective timeout reaches every group it communicates over, not only the world group: a hang on
one axis of a 2 x 2 mesh must fail after the configured time, not torch's 30-minute default."""

from __future__ import annotations

from datetime import timedelta

import torch

from lightning_colossal.distributed import ParallelDims, build_device_mesh


def axis_timeouts_body() -> dict[str, float]:
    mesh = build_device_mesh(
        ParallelDims(world_size=torch.distributed.get_world_size(), tp=2), torch.device("cpu"), timedelta(seconds=77)
    )
    return {
        name: mesh.get_group(name)._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for name in mesh.mesh_dim_names
        if mesh.get_group(name).size() > 1
    }


def test_every_axis_group_gets_the_strategy_timeout(rank_pool_4):
    for timeouts in rank_pool_4.run(axis_timeouts_body):
        assert set(timeouts) == {"dp", "tp"}
        assert set(timeouts.values()) == {77.0}, timeouts
