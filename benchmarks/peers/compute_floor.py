"""A floor for data-parallel step time on this machine: every rank's arithmetic, and no communication at all.

``ComputeFloorStrategy`` is Lightning's ``DDPStrategy`` with two changes, as a ``module:Class`` configuration of
``benchmarks.peers``::

    --configuration label=floor_sharded strategy=benchmarks.peers.compute_floor:ComputeFloorStrategy 'args={"shard_optimizer":true}'

- DDP's gradient all-reduce is replaced by a communication hook that returns the bucket untouched, so nothing
  crosses a socket and gloo's threads never run (Lightning registers hooks on CUDA only; this one is registered on
  every device).
- With ``shard_optimizer=True`` each rank's optimizer steps only its share of the parameters (about Ψ/N elements,
  whole parameters dealt greedily by size), the optimizer work ZeRO, Gemini and FSDP do per rank. Without it the
  optimizer steps every parameter, as DDP does.

What is left is the forward, the backward and the optimizer step of one rank's batch, with every rank doing the same
at once on the shared cores and memory. Any data-parallel engine does at least this arithmetic per step, so this
configuration's step time over a peer's is the lowest ratio any engine could reach against that peer here, whatever
it does about communication. The floor trains nothing useful (ranks drift apart and parameters outside a rank's share
never move); only its step time means something.
"""

from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed import GradBucket

__all__ = ["ComputeFloorStrategy", "rank_share"]


# Evaluated annotations (no ``from __future__ import annotations`` in this file): DDP checks a hook's signature.
def _keep_bucket(_state: object, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that communicates nothing: the bucket's local gradients are its result."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def rank_share(sizes: list[int], world_size: int, rank: int) -> list[int]:
    """Indices of the parameters ``rank`` steps: whole parameters dealt largest first to the least loaded rank."""
    loads = [0] * world_size
    owner = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda index: (-sizes[index], index)):
        least = min(range(world_size), key=lambda candidate: (loads[candidate], candidate))
        owner[index] = least
        loads[least] += sizes[index]
    return [index for index in range(len(sizes)) if owner[index] == rank]


class ComputeFloorStrategy(DDPStrategy):
    """DDP without its all-reduce, optionally with each rank stepping only its share (see the module docstring)."""

    def __init__(self, shard_optimizer: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("gradient_as_bucket_view", True)  # no copy of each gradient into a bucket
        super().__init__(**kwargs)
        self.shard_optimizer = shard_optimizer

    def _register_ddp_hooks(self) -> None:
        assert self.model is not None
        self.model.register_comm_hook(None, _keep_bucket)

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if not self.shard_optimizer:
            return
        for optimizer in self.optimizers:
            parameters = [parameter for group in optimizer.param_groups for parameter in group["params"]]
            kept = {
                id(parameters[index])
                for index in rank_share(
                    [parameter.numel() for parameter in parameters], self.world_size, self.global_rank
                )
            }
            for group in optimizer.param_groups:
                group["params"] = [parameter for parameter in group["params"] if id(parameter) in kept]
