"""Settings of the Gemini engine: where chunks and optimizer state live (static or automatic placement), chunk sizes."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_colossal.config.data_parallel import Communication


@dataclass(frozen=True, kw_only=True)
class StaticPlacement:
    """Gemini's static placement: fixed shares of chunk memory kept sharded or moved to the CPU.

    Shares count chunk bytes in chunk order (the first chunks first), so the same model always gets the same split.

    Args:
        shard_param_frac: share of parameter chunks re-sharded after each use (1.0 is ZeRO-3; 0.0 keeps every chunk
            gathered from its first use in forward until the optimizer step, like ZeRO-2, with no second gather in
            backward).
        offload_optim_frac: share of chunks whose fp32 masters, gradient shards and optimizer state live in CPU
            memory (stepped there).
        offload_param_frac: share of chunks whose working-precision shards wait in CPU memory between uses; needs
            ``shard_param_frac == 1`` and ``offload_optim_frac == 1`` (a chunk must be sharded and its optimizer on
            the CPU before its parameters can follow).
        disk_fraction: share of chunks (counted like ``offload_optim_frac``, from the first) whose optimizer state
            (Adam's moments, SGD's momentum) lives on disk between steps, under ``GeminiConfig.offload_dir``; at most
            ``offload_optim_frac`` (state on disk is stepped on the CPU). See ``lightning_colossal/disk``.
    """

    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0
    disk_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac", "disk_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"StaticPlacement({name}={value}): pass a share in [0, 1].")
        if self.offload_param_frac > 0 and (self.shard_param_frac < 1 or self.offload_optim_frac < 1):
            raise ValueError(
                f"StaticPlacement(offload_param_frac={self.offload_param_frac}) needs shard_param_frac=1.0 and"
                f" offload_optim_frac=1.0 (got {self.shard_param_frac} and {self.offload_optim_frac}): offloaded"
                " parameters must be sharded and stepped on the CPU. Raise both to 1.0 or set offload_param_frac=0."
            )
        if self.disk_fraction > self.offload_optim_frac:
            raise ValueError(
                f"StaticPlacement(disk_fraction={self.disk_fraction}) exceeds offload_optim_frac="
                f"{self.offload_optim_frac}: optimizer state on disk is stepped on the CPU. Raise offload_optim_frac"
                f" to at least {self.disk_fraction} or lower disk_fraction."
            )


@dataclass(frozen=True, kw_only=True)
class AutoPlacement:
    """Gemini's automatic placement: chunks stay on the compute device while a memory budget allows.

    A warm-up step traces the memory that is not model data (activations, temporaries) before each module runs;
    afterwards, before each module, chunks are moved to the CPU, farthest next use first, until the module's
    chunks, the traced non-model memory and the model data on the device fit the budget. fp32 masters and optimizer
    state live in CPU memory.

    Args:
        warmup_non_model_data_ratio: during the warm-up step (nothing traced yet), the share of the budget assumed
            to be taken by non-model data.
        steady_compute_cap_ratio: the share of the budget usable once the trace exists (headroom for fragmentation).
        compute_memory_budget: bytes of compute-device memory the model may use; ``None`` means the device's total
            memory on CUDA and no limit on the CPU.
        host_memory_budget: bytes of host memory this rank's model state may use (offloaded shards, masters,
            gradient shards, optimizer state). With ``GeminiConfig.offload_dir`` set, the optimizer state of the
            chunks that do not fit goes to disk (the last chunks first); without it, a model whose host bytes exceed
            the budget is refused before training. ``None``: no limit.
    """

    warmup_non_model_data_ratio: float = 0.8
    steady_compute_cap_ratio: float = 0.9
    compute_memory_budget: int | None = None
    host_memory_budget: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.warmup_non_model_data_ratio < 1.0:
            raise ValueError(
                f"AutoPlacement(warmup_non_model_data_ratio={self.warmup_non_model_data_ratio}): pass a share in"
                " [0, 1), e.g. 0.8."
            )
        if not 0.0 < self.steady_compute_cap_ratio <= 1.0:
            raise ValueError(
                f"AutoPlacement(steady_compute_cap_ratio={self.steady_compute_cap_ratio}): pass a share in (0, 1],"
                " e.g. 0.9."
            )
        if self.compute_memory_budget is not None and self.compute_memory_budget <= 0:
            raise ValueError(
                f"AutoPlacement(compute_memory_budget={self.compute_memory_budget}): pass a positive number of bytes"
                " or None (the whole device)."
            )
        if self.host_memory_budget is not None and self.host_memory_budget <= 0:
            raise ValueError(
                f"AutoPlacement(host_memory_budget={self.host_memory_budget}): pass a positive number of bytes or"
                " None (no limit)."
            )


Placement = StaticPlacement | AutoPlacement


@dataclass(frozen=True, kw_only=True)
class GeminiConfig:
    """Settings of the Gemini engine (``lightning_colossal.gemini``).

    Args:
        placement: ``StaticPlacement(...)`` or ``AutoPlacement(...)`` (a strategy given ``None`` takes
            ``StaticPlacement()``).
        chunk_numel: elements per chunk; ``None`` searches the size that wastes the least chunk space.
        min_chunk_numel: smallest chunk size the search tries.
        search_range_numel: the search tries sizes in ``[start, start + search_range_numel]``.
        search_step_numel: step between the sizes the search tries.
        max_prefetch: chunks gathered ahead of use, asynchronously, in the order recorded in the first step.
        communication: ``"auto"`` or ``"scatter_gather"`` (reduce-scatter and all-gather: NCCL's collectives,
            point-to-point sends on gloo) or ``"all_reduce"`` (all-reduces of twice the bytes); results are
            identical.
        init_window_bytes: when the model was built on the meta device, how many bytes of parameters one
            initialisation pass may materialise at once (more passes, less memory).
        shard_frozen_parameters: parameters with ``requires_grad=False`` (a LoRA model's whole base model) go into
            chunks of their own and are sharded like the trainable ones, as FSDP2 shards them: without it every rank
            holds them whole, which defeats ZeRO-3 for fine-tuning a model too large for one device. ``False`` keeps
            them whole on every rank: for a model that reads a frozen parameter outside the forward of the module
            that owns it (the hooks gather a chunk only for its owning modules), or a small frozen part whose
            gathers would cost more than its bytes save.
        offload_dir: directory on a local disk (NVMe) for the disk tier: the optimizer state that
            ``StaticPlacement(disk_fraction=...)`` or ``AutoPlacement(host_memory_budget=...)`` puts on disk lives in a
            per-run working directory under it, removed at the end of the run (``lightning_colossal/disk``).
        masters_on_disk: the fp32 masters of the chunks whose optimizer state is on disk live in the same disk
            records, so host memory holds neither (a master that is a separate copy of its working shard: the
            parameters are bf16/fp16, or the shard lives on an accelerator; an fp32 shard in host memory is its own
            master and stays). Needs the disk tier (``offload_dir`` with ``disk_fraction`` or ``host_memory_budget``).
    """

    placement: StaticPlacement | AutoPlacement = StaticPlacement()
    chunk_numel: int | None = None
    min_chunk_numel: int = 2**20
    search_range_numel: int = 2**24
    search_step_numel: int = 2**16
    max_prefetch: int = 0
    communication: Communication = "auto"
    init_window_bytes: int = 2**30
    shard_frozen_parameters: bool = True
    offload_dir: str | None = None
    masters_on_disk: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.placement, (StaticPlacement, AutoPlacement)):
            raise TypeError(
                f"placement={self.placement!r}: pass StaticPlacement(...) or AutoPlacement(...) from lightning_colossal."
            )
        if self.chunk_numel is not None and self.chunk_numel < 1:
            raise ValueError(f"chunk_numel={self.chunk_numel}: pass a positive number of elements or None (search).")
        for name in ("min_chunk_numel", "search_step_numel", "init_window_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: pass a positive integer.")
        if self.search_range_numel < 0:
            raise ValueError(f"search_range_numel={self.search_range_numel}: pass an integer >= 0.")
        if self.max_prefetch < 0:
            raise ValueError(f"max_prefetch={self.max_prefetch}: pass an integer >= 0 (0 turns prefetching off).")
        if self.communication not in ("auto", "all_reduce", "scatter_gather"):
            raise ValueError(f"communication={self.communication!r}: pass 'auto', 'all_reduce' or 'scatter_gather'.")
        placement = self.placement
        wants_disk = isinstance(placement, StaticPlacement) and placement.disk_fraction > 0
        if wants_disk and self.offload_dir is None:
            raise ValueError(
                f"StaticPlacement(disk_fraction={placement.disk_fraction}) needs offload_dir: pass the directory on a"
                " local disk where the optimizer state may live, e.g. offload_dir='/local_nvme'."
            )
        if self.offload_dir is not None and isinstance(placement, StaticPlacement) and not wants_disk:
            raise ValueError(
                f"offload_dir={self.offload_dir!r} has no effect with disk_fraction=0: pass disk_fraction (the share"
                " of chunks whose optimizer state goes to disk, e.g. 1.0) or drop offload_dir."
            )
        if (
            isinstance(placement, AutoPlacement)
            and self.offload_dir is not None
            and placement.host_memory_budget is None
        ):
            raise ValueError(
                f"offload_dir={self.offload_dir!r} with automatic placement needs host_memory_budget: the optimizer"
                " state of the chunks that do not fit that many bytes of host memory goes to disk."
            )
        if self.masters_on_disk and self.offload_dir is None:
            raise ValueError(
                "masters_on_disk=True needs the disk tier: the masters go to disk beside the optimizer state of the"
                " same chunks. Pass offload_dir='/local_nvme' with StaticPlacement(offload_optim_frac=1.0,"
                " disk_fraction=1.0) or AutoPlacement(host_memory_budget=...), or drop masters_on_disk."
            )
