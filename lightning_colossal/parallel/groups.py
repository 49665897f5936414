"""The process groups of hybrid parallelism, all cut from the one ``DeviceMesh`` (axes pp, dp, sp, tp).

[Note: the gradient-reduction axis]
Data-parallel ranks see different samples; Ulysses ranks see different sequence slices of the same samples. Both
hold the same parameters and compute a mean loss over their own tokens, so gradients are averaged over dp x sp
(as ColossalAI does) and ZeRO shards optimizer state over those dp * sp ranks. A second mesh, laid out as
(pp, tp, dp x sp), provides that flattened axis and the 2-D (tp, dp x sp) sub-mesh that describes a ZeRO shard of
a tensor-parallel shard as one DTensor in checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

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
    tp_size: int
    pp_size: int
    sp_size: int
    dp_size: int
    tp_rank: int
    pp_rank: int
    reduce_rank: int

    @property
    def reduce_size(self) -> int:
        return self.dp_size * self.sp_size


def build_groups(mesh: DeviceMesh) -> HybridGroups:
    """Every rank must call this (creating groups is collective)."""
    sizes = dict(zip(mesh.mesh_dim_names or (), mesh.mesh.shape, strict=True))
    pp, dp, sp, tp = (int(sizes[axis]) for axis in ("pp", "dp", "sp", "tp"))
    layout = mesh.mesh.permute(0, 3, 1, 2).reshape(pp, tp, dp * sp)
    reduction = DeviceMesh(mesh.device_type, layout, mesh_dim_names=("pp", "tp", "reduce"))
    reduce_mesh = reduction["reduce"]
    return HybridGroups(
        mesh=mesh,
        tp_mesh=mesh["tp"],
        tp_group=mesh["tp"].get_group() if tp > 1 else None,
        sp_group=mesh["sp"].get_group() if sp > 1 else None,
        pp_group=mesh["pp"].get_group() if pp > 1 else None,
        reduce_mesh=reduce_mesh,
        reduce_group=reduce_mesh.get_group() if dp * sp > 1 else None,
        describe_mesh=reduction["tp", "reduce"],
        tp_size=tp,
        pp_size=pp,
        sp_size=sp,
        dp_size=dp,
        tp_rank=mesh["tp"].get_local_rank(),
        pp_rank=mesh["pp"].get_local_rank(),
        reduce_rank=reduce_mesh.get_local_rank(),
    )


def stage_tie_group(mesh: DeviceMesh, pp_ranks: list[int], timeout: timedelta) -> ProcessGroup | None:
    """A group joining, for each (dp, sp, tp) position, the pipeline ranks in ``pp_ranks`` (those holding a weight
    shared between stages, e.g. the embedding on the first and the tied head on the last)."""
    grid = mesh.mesh  # [pp, dp, sp, tp]
    members = grid[pp_ranks].reshape(len(pp_ranks), -1).t().tolist()
    return collectives.new_group_containing(members, timeout)
