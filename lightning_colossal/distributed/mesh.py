"""Process topology: how the world is split into pipeline, data, sequence and tensor parallel axes.

One ``DeviceMesh`` with named axes (``pp``, ``dp``, ``sp``, ``tp``, outermost first) owns every process group.
Tensor parallelism is innermost because its collectives are the most frequent and should stay inside a node;
pipeline parallelism is outermost because it only sends activations between neighbours. Strategies pass the mesh
(or a sub-mesh) to engines explicitly. The one piece of process-wide state is the cache that makes each mesh once
per process (``group_cache.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_colossal.distributed.group_cache import reuse_or_create, set_group_timeout

MESH_AXES: tuple[str, ...] = ("pp", "dp", "sp", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """Sizes of the parallel axes; their product must equal the world size.

    Args:
        world_size: total number of processes.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        sp: sequence-parallel size (Ulysses all-to-all axis).
        dp: data-parallel size, or ``None`` to take whatever is left: ``world_size / (tp * pp * sp)``.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    dp: int | None = None

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size={self.world_size}: need at least one process.")
        for axis in ("tp", "pp", "sp"):
            size = getattr(self, axis)
            if size < 1:
                raise ValueError(f"{axis}_size={size}: pass an integer >= 1.")
        model_parallel = self.tp * self.pp * self.sp
        if self.world_size % model_parallel != 0:
            raise ValueError(
                f"tp_size * pp_size * sp_size = {self.tp} * {self.pp} * {self.sp} = {model_parallel} does not divide"
                f" the world size {self.world_size}: choose sizes whose product divides {self.world_size}, or change"
                " the number of devices/nodes."
            )
        derived_dp = self.world_size // model_parallel
        if self.dp is None:
            object.__setattr__(self, "dp", derived_dp)
        elif self.dp != derived_dp:
            raise ValueError(
                f"dp_size={self.dp} but world_size / (tp * pp * sp) = {self.world_size} / {model_parallel} ="
                f" {derived_dp}: leave dp_size unset or make the product of all sizes equal the world size."
            )

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel replicas (``dp``)."""
        assert self.dp is not None
        return self.dp

    def axis_sizes(self) -> dict[str, int]:
        """Sizes by axis name in mesh order (outermost first)."""
        sizes = {"pp": self.pp, "dp": self.data_parallel_size, "sp": self.sp, "tp": self.tp}
        return {axis: sizes[axis] for axis in MESH_AXES}


def build_device_mesh(dims: ParallelDims, device: torch.device, timeout: timedelta | None = None) -> DeviceMesh:
    """The ``DeviceMesh`` for ``dims`` on the device type of ``device``.

    Every rank must call this collectively (creating sub-groups is a collective operation). Axes of size 1 are
    kept so code can always ask for ``mesh["dp"]`` and friends. ``timeout`` is applied to every axis's group.
    """
    sizes = dims.axis_sizes()
    return named_device_mesh(device.type, tuple(sizes.values()), tuple(sizes.keys()), timeout)


def named_device_mesh(
    device_type: str, shape: tuple[int, ...], names: tuple[str, ...], timeout: timedelta | None = None
) -> DeviceMesh:
    """A mesh of ``shape`` with axes ``names`` over all ranks, made once per process and then reused (see
    [Note: one set of process groups per process] in ``group_cache.py``); a collective the first time."""

    def create() -> DeviceMesh:
        # A new mesh over new groups: DTensor's plans cached for an equal-looking earlier mesh must go.
        forget_dtensor_plans()
        return init_device_mesh(device_type, shape, mesh_dim_names=names)

    mesh = reuse_or_create(("device_mesh", device_type, shape, names), create)
    if timeout is not None:
        apply_timeout(mesh, timeout)
    return mesh


def apply_timeout(mesh: DeviceMesh, timeout: timedelta) -> None:
    """Give every axis group of ``mesh`` the collective ``timeout``.

    ``init_device_mesh`` creates an axis's group with torch's default timeout (30 minutes, 10 for NCCL), not the
    world group's: a hang on the data-parallel axis of a tp x dp mesh would otherwise wait half an hour.
    """
    for dimension in range(mesh.ndim):
        set_group_timeout(mesh.get_group(dimension), timeout)


def forget_dtensor_plans() -> None:
    """Drop DTensor's cached sharding and redistribution plans.

    ``DeviceMesh`` equality ignores process groups, and the cached plans hold the mesh they were made with. A second
    run in the same process (a notebook, the test pool) builds an equal-looking mesh over new groups; without this,
    DTensor ops (the user's own tensor parallelism on ``self.device_mesh``) would reuse a plan naming the previous
    run's destroyed groups. Private torch caches, so each is cleared only if this torch has it.
    """
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for cached in (
        getattr(propagator, "propagate_op_sharding", None),
        getattr(propagator, "_propagate_tensor_meta_cached", None),
        getattr(_redistribute, "_gen_transform_infos", None),
    ):
        if cached is not None and hasattr(cached, "cache_clear"):
            cached.cache_clear()
    clear_planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planner is not None:
        clear_planner()
    # The C++ dispatch fast path keeps a cache of its own (torch >= 2.9).
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
