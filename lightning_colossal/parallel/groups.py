"""The process groups of hybrid parallelism, all cut from the one ``DeviceMesh`` (axes pp, dp, sp, tp).

[Note: the gradient-reduction axis]
Data-parallel ranks see different samples; sequence-parallel ranks (Ulysses or ring) see different tokens of the
same samples. Both hold the same parameters and compute a mean loss over their own tokens, so gradients are averaged
over dp x sp (as ColossalAI does) and ZeRO shards optimizer state over those dp * sp ranks. A second mesh, laid out as
(pp, tp, dp x sp), provides that flattened axis and the 2-D (tp, dp x sp) sub-mesh that describes a ZeRO shard of
a tensor-parallel shard as one DTensor in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_colossal.distributed import collectives


@dataclass
class HybridGroups:
    """Groups and meshes of one rank; sizes and this rank's coordinates."""

    mesh: DeviceMesh
    tp_mesh: DeviceMesh
    tp_group: ProcessGroup | None
    sp_group: ProcessGroup | None
    pp_group: ProcessGroup | None
    reduce_mesh: DeviceMesh  # 1-D, dp x sp (see [Note: the gradient-reduction axis])
    reduce_group: ProcessGroup | None
    describe_mesh: DeviceMesh  # 2-D (tp, dp x sp)
    pp_size: int
    tp_rank: int
    pp_rank: int
    reduce_rank: int
    #: Expert parallelism's groups (``ep_size > 1`` only; [Note: expert-parallel groups]).
    experts: ExpertGroups | None = None


@dataclass
class ExpertGroups:
    """Expert parallelism's groups of one rank.

    [Note: expert-parallel groups]
    As in ColossalAI's MoE plugin, expert-parallel ranks are carved out of the data-parallel axis: consecutive blocks
    of ``ep_size`` dp ranks form an ep group, whose ranks split each experts module's experts (and exchange tokens by
    all-to-all); the ranks at the same place in every block hold the same experts and form the expert-data group over
    which those experts' gradients are reduced. Everything else is still reduced over the whole dp x sp group.
    """

    ep_size: int
    ep_rank: int
    ep_group: ProcessGroup | None
    ep_mesh: DeviceMesh  # 1-D over the ep group: describes an expert shard as a DTensor of the whole parameter
    expert_data_group: ProcessGroup | None  # same experts, other data (``None`` when dp == ep)
    expert_data_size: int
    expert_data_rank: int


def build_expert_groups(mesh: DeviceMesh, ep_size: int, timeout: timedelta) -> ExpertGroups:
    """Every rank must call this (creating groups is collective); see [Note: expert-parallel groups]."""
    grid = mesh.mesh  # [pp, dp, sp, tp]
    pp, dp, sp, tp = (int(size) for size in grid.shape)
    if dp % ep_size != 0:
        raise ValueError(
            f"ep_size={ep_size} must divide the data-parallel size {dp} (world size / (tp_size * pp_size * sp_size)),"
            " since expert-parallel ranks are carved out of the data-parallel ones: pick ep_size among its divisors."
        )
    own = collectives.rank()
    dp_index = int((grid == own).nonzero()[0][1])
    # [pp, dp / ep, ep, sp, tp]: ep groups along axis 2, expert-data groups along axis 1.
    blocks = grid.reshape(pp, dp // ep_size, ep_size, sp, tp)
    ep_group = collectives.new_group_containing(_axis_lists(blocks, 2), timeout)
    expert_data_group = collectives.new_group_containing(_axis_lists(blocks, 1), timeout)
    ep_ranks = next(ranks for ranks in _axis_lists(blocks, 2) if own in ranks)
    ep_mesh = DeviceMesh.from_group(
        ep_group, mesh.device_type, mesh=ep_ranks, mesh_dim_names=(f"ep_{_group_name(ep_group)}",)
    )
    return ExpertGroups(
        ep_size=ep_size,
        ep_rank=dp_index % ep_size,
        ep_group=ep_group,
        ep_mesh=ep_mesh,
        expert_data_group=expert_data_group if dp > ep_size else None,
        expert_data_size=dp // ep_size,
        expert_data_rank=dp_index // ep_size,
    )


def _axis_lists(grid: torch.Tensor, axis: int) -> list[list[int]]:
    """Rank lists along ``axis`` of ``grid``, one per position of the other axes."""
    moved = grid.movedim(axis, -1)
    return moved.reshape(-1, moved.shape[-1]).tolist()


def _group_name(group: ProcessGroup | None) -> str:
    return str(getattr(group, "group_name", "none"))


def build_groups(mesh: DeviceMesh, timeout: timedelta) -> HybridGroups:
    """Every rank must call this (creating groups is collective).

    The groups are created here and wrapped with ``DeviceMesh.from_group`` rather than sliced from ``mesh``: torch
    caches sliced meshes by their layout, and a cached slice can name groups that a previous run in the same
    process (a notebook, the test pool) already destroyed.
    """
    grid = mesh.mesh  # [pp, dp, sp, tp]
    pp, dp, sp, tp = (int(size) for size in grid.shape)
    own = collectives.rank()
    pp_index, dp_index, sp_index, tp_index = (int(index) for index in (grid == own).nonzero()[0])
    layout = grid.permute(0, 3, 1, 2).reshape(pp, tp, dp * sp)  # [pp, tp, dp x sp]
    reduce_index = dp_index * sp + sp_index
    tp_group = collectives.new_group_containing(_axis_lists(grid, 3), timeout)
    sp_group = collectives.new_group_containing(_axis_lists(grid, 2), timeout)
    pp_group = collectives.new_group_containing(_axis_lists(grid, 0), timeout)
    reduce_group = collectives.new_group_containing(_axis_lists(layout, 2), timeout)
    device_type = mesh.device_type
    # Names unique to these groups: DeviceMesh equality ignores groups, and DTensor's sharding caches would otherwise
    # hand an equal-looking mesh of an earlier run (same ranks, same names) whose groups are gone.
    tp_name, reduce_name = (
        f"{axis}_{_group_name(group)}" for axis, group in (("tp", tp_group), ("reduce", reduce_group))
    )
    tp_mesh = DeviceMesh.from_group(
        tp_group, device_type, mesh=grid[pp_index, dp_index, sp_index].tolist(), mesh_dim_names=(tp_name,)
    )
    reduce_mesh = DeviceMesh.from_group(
        reduce_group, device_type, mesh=layout[pp_index, tp_index].tolist(), mesh_dim_names=(reduce_name,)
    )
    describe_mesh = DeviceMesh.from_group(
        [tp_group, reduce_group], device_type, mesh=layout[pp_index].tolist(), mesh_dim_names=(tp_name, reduce_name)
    )
    return HybridGroups(
        mesh=mesh,
        tp_mesh=tp_mesh,
        tp_group=tp_group if tp > 1 else None,
        sp_group=sp_group if sp > 1 else None,
        pp_group=pp_group if pp > 1 else None,
        reduce_mesh=reduce_mesh,
        reduce_group=reduce_group if dp * sp > 1 else None,
        describe_mesh=describe_mesh,
        pp_size=pp,
        tp_rank=tp_index,
        pp_rank=pp_index,
        reduce_rank=reduce_index,
    )


def stage_tie_group(mesh: DeviceMesh, pp_ranks: list[int], timeout: timedelta) -> ProcessGroup | None:
    """A group joining, for each (dp, sp, tp) position, the pipeline ranks in ``pp_ranks`` (those holding a weight
    shared between stages, e.g. the embedding on the first and the tied head on the last)."""
    grid = mesh.mesh  # [pp, dp, sp, tp]
    members = grid[pp_ranks].reshape(len(pp_ranks), -1).t().tolist()
    return collectives.new_group_containing(members, timeout)
