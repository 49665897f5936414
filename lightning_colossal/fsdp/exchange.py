"""FSDP2's all-gathers and reduce-scatters on gloo, done by our point-to-point exchanges.

torch FSDP2 (``fully_shard``) calls ``torch.distributed.all_gather_single`` and ``reduce_scatter_single`` through
replaceable "comm" objects (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, torch >= 2.8). On
gloo those collectives are the slow route ([Note: direct exchanges on gloo] in ``distributed/direct_exchange.py``),
so each shard unit of a gloo mesh gets comm objects that call ``collectives``' exchanges instead. The values are the
same: FSDP2 is told to reduce with sums only (``set_force_sum_reduction_for_comms``), dividing by the group size
itself, which is what it does on gloo anyway, and the exchanges sum in rank order.

FSDP2 waits only on a real ``torch.distributed.Work`` handle; these exchanges are therefore always finished when the
call returns. FSDP2 on CPU gathers synchronously by default, so nothing overlaps less than before.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup, ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts.buffer_pool import BufferPool

try:  # the comm interfaces arrived with the custom-comm setters; older torch keeps FSDP2's own collectives
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
except ImportError:  # pragma: no cover - torch < 2.8
    AllGather = ReduceScatter = None  # type: ignore[assignment,misc]


#: The exchanges' buffers (gathered units, reduce-scatter inputs), kept for reuse once FSDP2 lets go of them
#: ([Note: reusing large host buffers] in ``engine_parts/buffer_pool.py``): a unit above glibc's mmap threshold (the
#: root holding a large embedding and head) was page-faulted in at every gather. ``drop_kept_buffers`` at teardown.
_BUFFERS = BufferPool()


def _allocate(size: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    numel = math.prod(size)
    buffer = _BUFFERS.take(numel, dtype, device, zeroed=False)
    # Kept at once: FSDP2 holds it until its copy-out is done, and the pool hands it out only after that.
    _BUFFERS.give_back(buffer)
    return buffer.view(*size)


def drop_kept_buffers() -> None:
    """Let go of the buffers kept for the next gathers (a run's end)."""
    _BUFFERS.clear()


if AllGather is not None:

    class DirectAllGather(AllGather):
        """FSDP2's all-gather comm, on ``collectives.all_gather_into``."""

        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return _allocate(size, dtype, device)

        def __call__(
            self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: ProcessGroup, async_op: bool = False
        ) -> None:
            collectives.all_gather_into(output_tensor, input_tensor, group)

    class DirectReduceScatter(ReduceScatter):
        """FSDP2's reduce-scatter comm, on ``collectives.reduce_scatter_async`` (sums only)."""

        def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            return _allocate(size, dtype, device)

        def __call__(
            self,
            output_tensor: torch.Tensor,
            input_tensor: torch.Tensor,
            group: ProcessGroup,
            op: Any,
            async_op: bool = False,
        ) -> None:
            if op != ReduceOp.SUM:
                raise RuntimeError(
                    f"FSDP2 asked lightning_colossal's gloo reduce-scatter for {op}, but sum-only reduction was set"
                    " on every shard unit. This is a bug in lightning_colossal; please report it with your torch"
                    " version."
                )
            work = collectives.reduce_scatter_async(output_tensor, input_tensor, group)
            if work is not None:
                work.wait()


def use_direct_exchange(unit: FSDPModule, mesh: DeviceMesh) -> bool:
    """Give ``unit`` the point-to-point comms when its mesh runs on gloo and torch can take them; returns whether."""
    if AllGather is None or not hasattr(unit, "set_custom_all_gather"):
        return False
    if not all(collectives.sends_directly(group) for group in mesh.get_all_groups()):
        return False  # NCCL, or gloo on the native route: FSDP2's own collectives
    unit.set_force_sum_reduction_for_comms(True)
    unit.set_custom_all_gather(DirectAllGather())
    unit.set_custom_reduce_scatter(DirectReduceScatter())
    return True
