"""Gradient averaging over the data-parallel axis without ZeRO (``zero_stage=0``).

Gradients are averaged once per optimizer step, after the last backward of an accumulation window, in flat
buckets of one dtype (one all-reduce per bucket instead of one per parameter). It runs after backward rather than
overlapping it: pipeline schedules produce gradients micro-batch by micro-batch, and the step is where every
gradient is final in every mode.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.distributed.staging import copy_out_of_flat
from lightning_colossal.parallel.tensor_parallel import local_view


class GradientAverager:
    """Averages the ``.grad`` of ``parameters`` over ``group`` in buckets of about ``bucket_numel`` elements."""

    def __init__(self, parameters: list[nn.Parameter], group: ProcessGroup | None, bucket_numel: int) -> None:
        self.parameters = parameters
        self.group = group
        self.bucket_numel = bucket_numel

    def average(self) -> None:
        if self.group is None:
            return
        for parameter in self.parameters:
            if parameter.grad is None:
                # Unused on this rank: join the sum with zeros so every rank sends the same buckets.
                parameter.grad = torch.zeros_like(parameter)
        for bucket in self._buckets():
            flat = torch.cat([gradient.reshape(-1) for gradient in bucket])
            with Activity("averaging data-parallel gradients"):
                collectives.all_reduce(flat, op="mean", group=self.group)
            copy_out_of_flat(flat, bucket)

    def _buckets(self) -> list[list[Tensor]]:
        buckets: list[list[Tensor]] = []
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for parameter in self.parameters:
            assert parameter.grad is not None
            # DTensor parameters (the user's own tensor parallelism): average each rank's piece.
            gradient = local_view(parameter.grad)
            key = (gradient.dtype, gradient.device)
            current = by_dtype.setdefault(key, [])
            if current and sizes[key] + gradient.numel() > self.bucket_numel:
                buckets.append(current)
                current = by_dtype[key] = []
                sizes[key] = 0
            current.append(gradient)
            sizes[key] = sizes.get(key, 0) + gradient.numel()
        buckets.extend(bucket for bucket in by_dtype.values() if bucket)
        return buckets
