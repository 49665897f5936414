"""The processes of a run: launcher, process group, ranks, the device mesh over them, and Lightning's collectives.

A part of ``ColossalStrategy`` (``strategies/base.py``), split out by what it owns; not used on its own.
``setup_environment`` checks the devices, starts the process group with the collective ``timeout`` through
Lightning's own initialisation (so every launcher Lightning supports works), checks the group size against
``num_nodes * devices``, and builds the one ``DeviceMesh`` (``pp, dp, sp, tp``) every mode uses.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utilities_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_colossal.config import StartMethod
from lightning_colossal.distributed import ParallelDims, build_device_mesh, collectives, group_cache
from lightning_colossal.distributed import device as devices
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.strategies._lightning_private import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _SubprocessScriptLauncher,
)
from lightning_colossal.strategies.launcher import FullWeightsMultiProcessingLauncher


class ProcessGroupMixin(ParallelStrategy):
    """Processes, ranks, mesh and collectives of ``ColossalStrategy`` (see the module docstring)."""

    # Set by ColossalStrategy.__init__.
    _process_group_backend: str | None
    _timeout: timedelta
    _start_method: StartMethod
    _num_nodes: int
    _device_mesh: DeviceMesh | None
    _parallel_dims: ParallelDims | None

    @property
    def is_distributed(self) -> bool:
        # Lightning adds the DistributedSampler and makes sync_dist reduce only when this is True.
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "parallel_devices are set by the Trainer before use"
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh of all parallel axes (``pp``, ``dp``, ``sp``, ``tp``); exists after ``setup_environment``."""
        if self._device_mesh is None:
            raise RuntimeError(
                "The device mesh exists only after the Trainer set up the processes (in or after `setup`)."
            )
        return self._device_mesh

    @property
    def parallel_dims(self) -> ParallelDims:
        if self._parallel_dims is None:
            raise RuntimeError("Parallel sizes are known only after the Trainer set up the processes.")
        return self._parallel_dims

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Ranks that hold the same data-parallel replica (tensor/sequence/pipeline peers) must read the same batches.
        data_parallel = self.device_mesh["dp"]
        return {"num_replicas": data_parallel.size(), "rank": data_parallel.get_local_rank()}

    # ---------------------------------------------------------------------------------------------- start-up
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = FullWeightsMultiProcessingLauncher(self, start_method=self._start_method)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # rank_zero_only is a decorated function carrying a `rank` attribute that mypy cannot see.
        rank_zero_only.rank = utilities_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        self._validate_devices()
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        self._process_group_backend = backend
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout, device_id=device_id)
        # At exit, lets gloo's worker threads finish before the interpreter finalises (group_cache.py
        # [Note: let gloo's workers finish before the interpreter exits]).
        group_cache.destroy_groups_at_exit()
        self._validate_world_size()
        self._parallel_dims = self._build_parallel_dims()
        self._device_mesh = build_device_mesh(self._parallel_dims, self.root_device, self._timeout)
        if self.lightning_module is not None:
            # LightningModule.device_mesh: lets configure_model() parallelise against our mesh.
            self.lightning_module._device_mesh = self._device_mesh

    def _build_parallel_dims(self) -> ParallelDims:
        """The parallel layout of this mode; data parallel over every rank unless a subclass says otherwise."""
        return ParallelDims(world_size=self.world_size)

    def _validate_devices(self) -> None:
        assert self.parallel_devices is not None
        if self.local_rank >= len(self.parallel_devices):
            raise ValueError(
                f"This process has local rank {self.local_rank} but the Trainer was given {len(self.parallel_devices)}"
                " device(s) per node: set `Trainer(devices=...)` to the number of processes per node that your"
                " launcher (torchrun --nproc-per-node, SLURM --ntasks-per-node) starts."
            )
        device = self.root_device
        if device.type == "cpu" and self.local_rank == 0:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
            if self.num_processes > cores:
                # Not an error: oversubscribing is how multi-rank code is tested on small machines.
                rank_zero_warn(
                    f"Trainer(devices={self.num_processes}) starts {self.num_processes} CPU processes on {cores} cores:"
                    f" they share cores and train slower than devices={cores} would."
                )
        count = devices.device_count(device.type)
        if device.type == "cuda" and (device.index or 0) >= count:
            raise ValueError(
                f"Trainer(devices={len(self.parallel_devices)}) asks for GPU {device.index} but this machine has"
                f" {count}: pass `devices` <= {count}."
            )

    def _validate_world_size(self) -> None:
        actual = collectives.world_size()
        if actual != self.world_size:
            raise ValueError(
                f"The process group has {actual} processes but the Trainer expects num_nodes * devices ="
                f" {self.num_nodes} * {self.num_processes} = {self.world_size}: make `Trainer(devices=..., num_nodes=...)`"
                " match the number of processes you launched."
            )

    # ---------------------------------------------------------------------------------------------- collectives
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if not isinstance(tensor, Tensor):
            return tensor
        if isinstance(tensor, DTensor):
            # e.g. a loss computed under tensor parallelism's loss_parallel (replicated over the tp ranks)
            tensor = tensor.full_tensor()
        op = reduce_op if isinstance(reduce_op, str) else _reduce_op_name(reduce_op)
        with Activity("Lightning's strategy.reduce (self.log(..., sync_dist=True), a metric or a callback)"):
            return collectives.all_reduce(tensor.clone(), op=op or "mean", group=group)

    def barrier(self, name: str | None = None) -> None:
        with Activity("Lightning's strategy.barrier({!r})", name):
            collectives.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        with Activity("Lightning's strategy.broadcast (from rank {})", src):
            return collectives.broadcast_object(obj, source_rank=src)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        with Activity("Lightning's strategy.all_gather (self.all_gather or a callback)"):
            return collectives.all_gather_tensor(tensor, group=group, sync_grads=sync_grads)


def _reduce_op_name(reduce_op: Any) -> str | None:
    if reduce_op is None:
        return None
    name = str(reduce_op).split(".")[-1].lower()
    return {"avg": "mean", "sum": "sum", "max": "max", "min": "min", "product": "product"}.get(name, name)
