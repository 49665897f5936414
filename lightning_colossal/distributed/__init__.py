"""Topology and communication. Imports torch only; the one place that calls collectives."""

from lightning_colossal.distributed.mesh import MESH_AXES, ParallelDims, build_device_mesh

__all__ = ["MESH_AXES", "ParallelDims", "build_device_mesh"]
