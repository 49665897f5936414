"""Running statistics (BatchNorm's mean, variance and batch count) kept equal across data-parallel replicas.

[Note: running statistics follow the first replica]
A norm layer that tracks running statistics updates them from each rank's own batch, so replicas drift apart.
Lightning's ``ddp`` (torch's ``DistributedDataParallel`` with ``broadcast_buffers=True``) copies rank 0's buffers to
every rank before each forward while fitting, training and validation alike: every rank then normalises validation
batches with rank 0's statistics and ends the fit holding them. The sharding engines do not wrap the forward that
way, so the strategy does the same before each training and fitting-validation step, over the data-parallel ranks.
Only the buffers of modules that track running statistics move (one broadcast per dtype): a transformer without
such layers pays nothing, where torch DDP broadcasts every buffer (causal masks, rotary tables) each step.
Under pipeline parallelism the replicas of a stage are the ranks that hold the same stage (the mesh's ``dp`` axis),
and each rank follows only the norm layers its own stages kept after the pipeline cut.

[Note: a trial forward leaves no statistics]
Before the first step of a schedule, torch's pipelining runs each stage's forward once to learn its output shapes
(``PipelineStage._prepare_forward_infra``): on the first micro-batch in the first stage, and on uninitialised memory
in the others (``torch.empty`` of the received shapes). In training mode that forward updates running statistics like
a real micro-batch: one extra batch counted, and garbage, possibly NaN, averaged into every later stage's statistics.
``running_statistics_kept`` lets that forward update stand-in copies and gives the norm layers their own statistics
back afterwards (``parallel/schedules.py``), so the statistics are those one process computes on the same
micro-batches in the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.modules.batchnorm import _NormBase

from lightning_colossal.distributed import collectives

__all__ = ["follow_first_replica", "modules_with_running_statistics", "running_statistics_kept"]

#: The buffers of a norm layer that tracks running statistics (``None`` where it does not keep one).
_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


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
        buffer for module in modules for name in _STATISTICS if isinstance(buffer := getattr(module, name), Tensor)
    ]
    collectives.broadcast_tensors(buffers, source_rank=0, group=group)


@contextmanager
def running_statistics_kept(module: nn.Module) -> Iterator[None]:
    """Inside, forwards of ``module`` update stand-in copies of its running statistics; on leaving, its norm layers
    hold their own tensors again, unchanged ([Note: a trial forward leaves no statistics]).

    Swapped rather than copied back: torch keeps the trial forward's graph for a backward that infers gradient shapes,
    and that graph saved the statistics; writing into them would make its backward fail (a tensor modified in place).
    """
    # SyncBatchNorm included: a forward that is not a real micro-batch must leave no trace in any norm layer.
    originals = [
        (submodule, name, buffer)
        for submodule in module.modules()
        if isinstance(submodule, _NormBase) and submodule.track_running_stats
        for name in _STATISTICS
        if isinstance(buffer := getattr(submodule, name, None), Tensor)
    ]
    for submodule, name, buffer in originals:
        setattr(submodule, name, buffer.clone())
    try:
        yield
    finally:
        for submodule, name, buffer in originals:
            setattr(submodule, name, buffer)
