"""Running statistics (BatchNorm's mean, variance and batch count) kept equal across data-parallel replicas.

[Note: running statistics follow the first replica]
A norm layer that tracks running statistics updates them from each rank's own batch, so replicas drift apart.
Lightning's ``ddp`` (torch's ``DistributedDataParallel`` with ``broadcast_buffers=True``) copies rank 0's buffers to
every rank before each forward while fitting, training and validation alike: every rank then normalises validation
batches with rank 0's statistics and ends the fit holding them. The sharding engines do not wrap the forward that
way, so the strategy does the same before each training and fitting-validation step, over the data-parallel ranks.
Only the buffers of modules that track running statistics move (one broadcast per dtype): a transformer without
such layers pays nothing, where torch DDP broadcasts every buffer (causal masks, rotary tables) each step.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _NormBase

from lightning_colossal.distributed import collectives

__all__ = ["follow_first_replica", "modules_with_running_statistics"]


def modules_with_running_statistics(module: nn.Module) -> list[nn.Module]:
    """The norm layers of ``module`` that track running statistics (BatchNorm, InstanceNorm with tracking)."""
    # SyncBatchNorm (Trainer(sync_batchnorm=True)) computes its statistics over every rank: they never drift.
    return [
        submodule
        for submodule in module.modules()
        if isinstance(submodule, _NormBase)
        and submodule.track_running_stats
        and not isinstance(submodule, nn.SyncBatchNorm)
    ]


def follow_first_replica(modules: Iterable[nn.Module], group: ProcessGroup | None) -> None:
    """Overwrite the running statistics of ``modules`` with those of the first rank of ``group`` (a collective)."""
    buffers = [
        buffer
        for module in modules
        for buffer in (module.running_mean, module.running_var, module.num_batches_tracked)
        if isinstance(buffer, Tensor)
    ]
    collectives.broadcast_tensors(buffers, source_rank=0, group=group)
