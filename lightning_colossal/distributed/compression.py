"""Gradient compression for DDP buckets: all-reduce in fp16 or bf16, on any backend.

torch's ``bf16_compress_hook`` refuses anything but NCCL (and XCCL); gloo all-reduces bf16 correctly, so one
hook of our own serves both dtypes on CPU and GPU. Each rank divides by the world size *before* the cast, which
keeps the half-precision sum in range (the same order torch's fp16 hook uses).
"""

# No `from __future__ import annotations` here: DDP's register_comm_hook checks the hook's annotations at runtime
# and rejects the string "dist.GradBucket".
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.futures import Future

CompressionHook = Callable[[ProcessGroup | None, dist.GradBucket], Future[torch.Tensor]]


def compressed_all_reduce_hook(dtype: torch.dtype) -> CompressionHook:
    """A DDP communication hook that averages each gradient bucket in ``dtype`` and writes the result back."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"Gradient compression supports float16 and bfloat16, not {dtype}.")

    def hook(process_group: ProcessGroup | None, bucket: dist.GradBucket) -> Future[torch.Tensor]:
        group = process_group if process_group is not None else dist.group.WORLD
        buffer = bucket.buffer()
        compressed = buffer.div(dist.get_world_size(group)).to(dtype)
        future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

        def decompress(completed: Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(completed.value()[0])
            return buffer

        return future.then(decompress)

    return hook
