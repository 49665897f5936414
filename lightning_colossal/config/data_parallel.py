"""Settings of the data-parallel engines that keep parameters whole: torch DDP and ZeRO-1/2."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GradientCompression = Literal["fp16", "bf16"]


#: How ZeRO-2 accumulates gradients over micro-batches (``ZeroConfig.stage2_accumulation``).
Stage2Accumulation = Literal["sharded", "local"]
#: How ZeRO and Gemini exchange gradients and parameters (``collectives.use_scatter_gather``; results are identical).
Communication = Literal["auto", "all_reduce", "scatter_gather"]


def bucket_numel(bucket_size_mb: float) -> int:
    """Elements in a gradient bucket of ``bucket_size_mb`` MiB, counted as fp32 (4 bytes) whatever the dtype."""
    return max(1, int(bucket_size_mb * 2**20 / 4))


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """Settings of torch ``DistributedDataParallel`` as used by ``ColossalDDPStrategy``.

    Args:
        bucket_cap_mb: gradient bucket size in MiB; larger buckets mean fewer, bigger all-reduces.
        gradient_as_bucket_view: let ``param.grad`` alias the communication buckets (the default: one gradient
            copy less than torch's own default; ``False`` only for code that calls ``detach_()`` on a gradient).
        static_graph: promise that the set of used parameters is the same every step (enables optimisations).
        find_unused_parameters: traverse the autograd graph each step to find parameters that got no gradient.
        forward_sync_buffers: broadcast module buffers from rank 0 at every forward (buffers are always
            broadcast once when the model is wrapped).
        broadcast_buffers: deprecated by torch in favour of ``forward_sync_buffers``; ``None`` (the default) when not
            given. ``False`` still means what it means to torch: buffers are neither synced at every forward nor
            when the model is wrapped (rank-local buffers), which ``forward_sync_buffers=False`` cannot express.
        gradient_compression: ``"fp16"`` or ``"bf16"`` to all-reduce gradients in half precision, or ``None``.
    """

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    find_unused_parameters: bool = False
    forward_sync_buffers: bool = True
    broadcast_buffers: bool | None = None
    gradient_compression: GradientCompression | None = None

    def __post_init__(self) -> None:
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb={self.bucket_cap_mb}: pass a positive size in MiB, e.g. 25.")
        if self.gradient_compression not in (None, "fp16", "bf16"):
            raise ValueError(f"gradient_compression={self.gradient_compression!r}: pass None, 'fp16' or 'bf16'.")
        if self.broadcast_buffers is not None and not self.forward_sync_buffers:
            raise ValueError(
                f"broadcast_buffers={self.broadcast_buffers} and forward_sync_buffers=False: pass only"
                " forward_sync_buffers (broadcast_buffers is deprecated by torch)."
            )
        if self.static_graph and self.find_unused_parameters:
            # torch accepts both, but static_graph already records unused parameters once; searching every step
            # again only costs time. Refuse so the user picks the behaviour they mean.
            raise ValueError(
                "static_graph=True and find_unused_parameters=True: pick one. static_graph=True already handles a"
                " fixed set of unused parameters; use find_unused_parameters=True when the set changes per step."
            )


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Settings of the ZeRO-1/2 engine (``lightning_colossal.zero``).

    Args:
        stage: 1 shards optimizer state (and fp32 masters); 2 also shards gradients.
        cpu_offload: keep fp32 masters, gradient shards and optimizer state in CPU memory and step the optimizer
            there.
        bucket_size_mb: size of a gradient reduction bucket in MiB (of fp32-equivalent elements).
        overlap_communication: launch bucket reductions from gradient hooks while backward still runs.
        stage2_accumulation: with gradient accumulation under stage 2, ``"sharded"`` (the default) reduces every
            micro-batch into the sharded fp32 accumulator (stage-2 memory, more communication); ``"local"``
            accumulates full gradients and reduces once per step (stage-1 memory during accumulation, least
            communication).
        communication: ``"auto"`` (chosen per backend) or ``"scatter_gather"`` reduce-scatter gradients and
            all-gather parameters (NCCL's collectives; point-to-point sends on gloo, where the all-gather is about
            twice as fast as an all-reduce); ``"all_reduce"`` does both with all-reduces instead (same results,
            twice the bytes).
        overlap_parameter_exchange: step the optimizer one bucket at a time and send each bucket's updated rows to the
            other ranks while the next bucket steps, instead of exchanging them all after the step (same values; only
            for torch's elementwise optimizers without step hooks, which step whole otherwise).
        offload_dir: directory on a local disk (NVMe) for the disk tier (``lightning_colossal/disk``); needs
            ``cpu_offload``.
        disk_fraction: share of the offloaded optimizer state (Adam's moments, SGD's momentum), counted in parameter
            order from the first, that lives on disk between steps under ``offload_dir``.
        masters_on_disk: keep the fp32 masters of the shards whose optimizer state is on disk (``disk_fraction``) in
            the same disk records, so host memory holds neither; needs ``disk_fraction`` and ``offload_dir``.
    """

    stage: int = 1
    cpu_offload: bool = False
    bucket_size_mb: float = 25.0
    overlap_communication: bool = True
    stage2_accumulation: Stage2Accumulation = "sharded"
    communication: Communication = "auto"
    overlap_parameter_exchange: bool = True
    offload_dir: str | None = None
    disk_fraction: float = 0.0
    masters_on_disk: bool = False

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(
                f"ZeRO stage={self.stage} is not a stage of this strategy: use 1 (optimizer state) or 2 (+ gradients)."
                " For stage 3 (sharded parameters) use `colossal_gemini` or `colossal_fsdp`; for plain data"
                " parallelism use `colossal_ddp`."
            )
        if not (math.isfinite(self.bucket_size_mb) and self.bucket_size_mb > 0):
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb}: pass a finite positive size in MiB, e.g. 25.")
        if self.stage2_accumulation not in ("sharded", "local"):
            raise ValueError(f"stage2_accumulation={self.stage2_accumulation!r}: pass 'sharded' or 'local'.")
        if self.communication not in ("auto", "all_reduce", "scatter_gather"):
            raise ValueError(f"communication={self.communication!r}: pass 'auto', 'all_reduce' or 'scatter_gather'.")
        if not 0.0 <= self.disk_fraction <= 1.0:
            raise ValueError(f"disk_fraction={self.disk_fraction}: pass a share in [0, 1].")
        if self.masters_on_disk and not self.cpu_offload:
            # Checked before the disk tier's own settings, so the message says what masters_on_disk lacks.
            raise ValueError(
                "masters_on_disk=True needs cpu_offload=True: without it fp32 parameters are their own masters, so"
                " there is no separate copy to move to disk. Pass cpu_offload=True (or use the"
                " `colossal_zero2_offload` strategy), or drop masters_on_disk."
            )
        if self.masters_on_disk and self.disk_fraction == 0:
            raise ValueError(
                "masters_on_disk=True needs disk_fraction > 0 and offload_dir: the masters go to disk beside the"
                " optimizer state of the same shards. Pass e.g. disk_fraction=1.0, offload_dir='/local_nvme', or drop"
                " masters_on_disk."
            )
        if self.disk_fraction > 0 and not self.cpu_offload:
            raise ValueError(
                f"disk_fraction={self.disk_fraction} needs cpu_offload=True: optimizer state on disk is stepped on the"
                " CPU. Pass cpu_offload=True (or use the `colossal_zero2_offload` strategy)."
            )
        if self.disk_fraction > 0 and self.offload_dir is None:
            raise ValueError(
                f"disk_fraction={self.disk_fraction} needs offload_dir: pass the directory on a local disk where the"
                " optimizer state may live, e.g. offload_dir='/local_nvme'."
            )
        if self.offload_dir is not None and self.disk_fraction == 0:
            raise ValueError(
                f"offload_dir={self.offload_dir!r} has no effect with disk_fraction=0: pass disk_fraction (e.g. 1.0)"
                " or drop offload_dir."
            )
