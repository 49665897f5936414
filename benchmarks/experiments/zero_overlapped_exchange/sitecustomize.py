"""Experiment (not part of the package): ZeRO's parameter exchange overlapped with the next forward.

Put this directory on ``PYTHONPATH`` of a ``benchmarks.run`` invocation (see benchmarks/RESULTS.md, "ZeRO-2: the
parameter exchange overlapped with the next forward"). Python imports ``sitecustomize`` at start-up in every rank,
and this one replaces ``ZeroEngine.sync_parameters`` for the engines whose ``bucket_size_mb`` is the marker value
25.000001 (the same buckets as the default 25), so one invocation compares the overlapped and the plain exchange.

The overlapped exchange launches every bucket's all-reduce asynchronously on a second process group right after the
optimizer step, into buffers kept across steps, and waits for a bucket when the first module holding one of its
parameters starts its forward; every top-level child's forward end waits for the rest. It is what ColossalAI's
``overlap_allgather`` does. It was measured and not adopted: see RESULTS.md for the figures and why.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

import lightning_colossal.zero.engine as zero_engine
from lightning_colossal.distributed.staging import copy_out_of_flat, own_rows_into_whole

MARKER_BUCKET_SIZE_MB = 25.000001
_plain_sync_parameters = zero_engine.ZeroEngine.sync_parameters


class _OverlappedExchange:
    def __init__(self, engine: zero_engine.ZeroEngine) -> None:
        self.group = dist.new_group(
            ranks=list(range(engine.world_size)), timeout=datetime.timedelta(seconds=120), backend="gloo"
        )
        position = {id(parameter): index for index, parameter in enumerate(engine.module.parameters())}
        # Forward order: the bucket holding the earliest registered parameter first.
        self.order = sorted(
            engine.reducer.buckets, key=lambda bucket: min(position[id(member.parameter)] for member in bucket.members)
        )
        self.buffers: dict[int, torch.Tensor] = {}
        self.pending: dict[int, Any] = {}
        bucket_of = {
            id(member.parameter): index for index, bucket in enumerate(self.order) for member in bucket.members
        }
        for module in engine.module.modules():
            held = {bucket_of[id(p)] for p in module._parameters.values() if p is not None and id(p) in bucket_of}
            if held:
                module.register_forward_pre_hook(self._pre_forward_hook(sorted(held)))
        for child in engine.module.children():
            child.register_forward_hook(lambda module, inputs, output: self.wait_all())

    def _pre_forward_hook(self, indices: list[int]) -> Any:
        def hook(module: torch.nn.Module, inputs: Any) -> None:
            for index in indices:
                self.wait(index)

        return hook

    def launch(self, engine: zero_engine.ZeroEngine) -> None:
        with torch.no_grad():
            for index, bucket in enumerate(self.order):
                total = sum(member.parameter.numel() for member in bucket.members)
                full = self.buffers.get(index)
                if full is None:
                    full = self.buffers[index] = torch.zeros(total, dtype=bucket.dtype)
                else:
                    full.zero_()
                offset = 0
                for member in bucket.members:
                    numel = member.parameter.numel()
                    owned = zero_engine._owned_rows(member.parameter.data, member)
                    own_rows_into_whole(owned, member.spec, full[offset : offset + numel])
                    offset += numel
                work = dist.all_reduce(full, group=self.group, async_op=True)
                self.pending[index] = (bucket, work, full)

    def wait(self, index: int) -> None:
        entry = self.pending.pop(index, None)
        if entry is None:
            return
        bucket, work, full = entry
        work.wait()
        with torch.no_grad():
            copy_out_of_flat(full, [member.parameter.data for member in bucket.members])

    def wait_all(self) -> None:
        for index in list(self.pending):
            self.wait(index)


def _sync_parameters(self: zero_engine.ZeroEngine) -> None:
    if self.config.bucket_size_mb != MARKER_BUCKET_SIZE_MB or self.world_size == 1:
        _plain_sync_parameters(self)
        return
    exchange = getattr(self, "_overlapped_exchange", None)
    if exchange is None:
        exchange = self._overlapped_exchange = _OverlappedExchange(self)
    exchange.launch(self)


zero_engine.ZeroEngine.sync_parameters = _sync_parameters
