"""Typed settings shared by the engines and strategies.

Every setting object is a frozen, keyword-only dataclass that validates itself in ``__post_init__`` and raises a
``ValueError`` whose message names the fix. Strategies take a few explicit keyword arguments (so LightningCLI can
read them) and build these objects; engines only ever see the objects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any, Literal

PrecisionName = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed"]
SUPPORTED_PRECISIONS: tuple[str, ...] = ("32-true", "bf16-mixed", "bf16-true", "16-mixed")

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")

GradientCompression = Literal["fp16", "bf16"]

DEFAULT_COLLECTIVE_TIMEOUT = timedelta(minutes=30)

#: How long a peer's heartbeat may stop before the watchdog stops this rank (``lightning_colossal/distributed/
#: watchdog.py``). 60 s: long enough that a busy but live process (a long checkpoint write, a compile) never trips it,
#: since its heartbeat thread keeps beating; short enough that a dead rank costs a minute, not the 30-minute
#: collective timeout. A peer on the same host whose process is gone is found within one heartbeat interval (1 s).
DEFAULT_HEARTBEAT_TIMEOUT = timedelta(seconds=60)

#: How ZeRO-2 accumulates gradients over micro-batches (``ZeroConfig.stage2_accumulation``).
Stage2Accumulation = Literal["sharded", "local"]
#: How ZeRO and Gemini exchange gradients and parameters (``collectives.use_scatter_gather``; results are identical).
Communication = Literal["auto", "all_reduce", "scatter_gather"]

NonFiniteAction = Literal["raise", "skip", "warn"]
NONFINITE_ACTIONS: tuple[str, ...] = ("raise", "skip", "warn")


@dataclass(frozen=True, kw_only=True)
class LossScalerConfig:
    """Dynamic loss scaling for ``16-mixed`` (fp16) training.

    The semantics follow ColossalAI's ``DynamicGradScaler``: an overflow increments a hysteresis counter and the
    scale backs off once the counter reaches ``hysteresis``; the counter resets only when the scale grows, so
    later overflows back off at once. ``growth_interval`` clean steps in a row grow the scale.

    Args:
        initial_scale: scale applied to the loss before the first step.
        growth_factor: multiplier applied after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplier applied on overflow (in (0, 1)).
        growth_interval: number of consecutive clean steps before the scale grows.
        hysteresis: number of overflows tolerated before the scale backs off.
        min_scale: lower bound of the scale.
        max_scale: upper bound of the scale.
    """

    initial_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    max_scale: float = 2.0**32

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial_scale) and self.initial_scale > 0):
            raise ValueError(
                f"LossScalerConfig(initial_scale={self.initial_scale}): pass a finite value > 0, e.g. 2**16."
            )
        if not self.growth_factor > 1:
            raise ValueError(f"LossScalerConfig(growth_factor={self.growth_factor}): pass a value > 1, e.g. 2.0.")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(
                f"LossScalerConfig(backoff_factor={self.backoff_factor}): pass a value in (0, 1), e.g. 0.5."
            )
        if self.growth_interval < 1:
            raise ValueError(f"LossScalerConfig(growth_interval={self.growth_interval}): pass an integer >= 1.")
        if self.hysteresis < 1:
            raise ValueError(f"LossScalerConfig(hysteresis={self.hysteresis}): pass an integer >= 1.")
        if not 0 < self.min_scale <= self.max_scale:
            raise ValueError(
                f"LossScalerConfig(min_scale={self.min_scale}, max_scale={self.max_scale}): pass 0 < min_scale <= max_scale."
            )
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            raise ValueError(
                f"LossScalerConfig(initial_scale={self.initial_scale}) lies outside [min_scale, max_scale] ="
                f" [{self.min_scale}, {self.max_scale}]: move initial_scale inside or widen the bounds."
            )


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """Settings of torch ``DistributedDataParallel`` as used by ``ColossalDDPStrategy``.

    Args:
        bucket_cap_mb: gradient bucket size in MiB; larger buckets mean fewer, bigger all-reduces.
        gradient_as_bucket_view: let ``param.grad`` alias the communication buckets (saves one gradient copy).
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
    gradient_as_bucket_view: bool = False
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
    """

    stage: int = 1
    cpu_offload: bool = False
    bucket_size_mb: float = 25.0
    overlap_communication: bool = True
    stage2_accumulation: Stage2Accumulation = "sharded"
    communication: Communication = "auto"

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
    """

    shard_param_frac: float = 1.0
    offload_optim_frac: float = 0.0
    offload_param_frac: float = 0.0

    def __post_init__(self) -> None:
        for name in ("shard_param_frac", "offload_optim_frac", "offload_param_frac"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"StaticPlacement({name}={value}): pass a share in [0, 1].")
        if self.offload_param_frac > 0 and (self.shard_param_frac < 1 or self.offload_optim_frac < 1):
            raise ValueError(
                f"StaticPlacement(offload_param_frac={self.offload_param_frac}) needs shard_param_frac=1.0 and"
                f" offload_optim_frac=1.0 (got {self.shard_param_frac} and {self.offload_optim_frac}): offloaded"
                " parameters must be sharded and stepped on the CPU. Raise both to 1.0 or set offload_param_frac=0."
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
    """

    warmup_non_model_data_ratio: float = 0.8
    steady_compute_cap_ratio: float = 0.9
    compute_memory_budget: int | None = None

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


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """Settings of torch FSDP2 as used by ``ColossalFSDPStrategy`` (``lightning_colossal.fsdp``).

    Args:
        wrap_policy: which modules to shard one by one (transformer blocks): class names, or a predicate
            ``module -> bool``. ``None`` detects them: the classes a model names in ``_no_split_modules`` (Hugging
            Face models; the demo GPT declares its ``Block`` the same way).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); ``False`` keeps them until backward
            (ZeRO-2-like: more memory, one all-gather less per step).
        cpu_offload: keep parameter, gradient and optimizer shards in CPU memory (FSDP2's ``CPUOffloadPolicy``).
        activation_checkpointing: recompute each sharded block's activations in backward.
        replicate_size: hybrid sharding (HSDP): parameters are sharded within groups of ``world / replicate_size``
            ranks and replicated across ``replicate_size`` such groups (e.g. one group per node); 1 is plain FSDP.
            It must divide the world size, which is checked when the processes are known.
        keep_weights_sharded: after each run leave the module's parameters as FSDP's DTensor shards instead of
            gathering full plain tensors onto every rank (the default, as Lightning's ``ddp``). For models too large
            for one rank's memory; see [Note: what the module holds after a run] in ``strategies/fsdp.py``.
    """

    wrap_policy: tuple[str, ...] | Callable[[Any], bool] | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    replicate_size: int = 1
    keep_weights_sharded: bool = False

    def __post_init__(self) -> None:
        if self.replicate_size < 1:
            raise ValueError(
                f"replicate_size={self.replicate_size}: pass 1 (plain FSDP) or the number of replica groups."
            )


def validate_precision(precision: str) -> PrecisionName:
    """Return ``precision`` if lightning_colossal supports it, else raise a ``ValueError`` naming the choices."""
    if precision not in SUPPORTED_PRECISIONS:
        hint = ""
        if precision == "16-true":
            hint = " Pure fp16 weights need fp32 master copies: use '16-mixed' (fp16 compute, fp32 weights)."
        elif precision == "64-true":
            hint = " Double precision is not a training mode of this library: use '32-true'."
        raise ValueError(
            f"precision={precision!r} is not supported by lightning_colossal. Choose one of"
            f" {', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}.{hint}"
        )
    return precision  # type: ignore[return-value]


def validate_nonfinite_action(action: str) -> NonFiniteAction:
    """Check ``on_nonfinite``; see ``precision.py`` [Note: non-finite values without a loss scaler]."""
    if action not in NONFINITE_ACTIONS:
        raise ValueError(
            f"on_nonfinite={action!r} is not supported: use 'raise' (stop every rank), 'skip' (skip the step on every"
            " rank) or 'warn' (report and step anyway)."
        )
    return action  # type: ignore[return-value]


def validate_start_method(start_method: str) -> StartMethod:
    """Return ``start_method`` if Lightning can launch with it, else raise a ``ValueError`` naming the choices."""
    if start_method not in START_METHODS:
        raise ValueError(
            f"start_method={start_method!r}: choose 'popen' (scripts, torchrun, SLURM), 'spawn', or 'fork' (notebooks)."
        )
    return start_method  # type: ignore[return-value]


SequenceParallelMode = Literal["split_gather", "all_to_all"]
PipelineSchedule = Literal["1f1b", "interleaved", "zbv"]
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved", "zbv")


def _check_size(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: pass an integer >= 1.")


@dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Pipeline settings of the hybrid engine (``HybridConfig.pipeline``; ``None`` there means no pipeline).

    Args:
        pp_size: pipeline ranks the layers are split over (at least 2).
        pp_schedule: ``"1f1b"``, ``"interleaved"`` (1F1B over ``num_model_chunks`` chunks per rank) or ``"zbv"``
            (zero-bubble V schedule, two chunks per rank).
        num_microbatches: micro-batches per pipeline step; set this or ``microbatch_size`` when ``pp_size > 1``.
        microbatch_size: samples per micro-batch (the alternative to ``num_microbatches``).
        num_model_chunks: model chunks per pipeline rank: 1 for 1F1B, at least 2 for interleaved, 2 for ZB-V.
        layers_per_stage: layers of each pipeline stage (``pp_size * num_model_chunks`` entries), or ``None`` to split
            as evenly as possible (the remainder going to the middle stages).
    """

    pp_size: int
    pp_schedule: PipelineSchedule = "1f1b"
    num_microbatches: int | None = None
    microbatch_size: int | None = None
    num_model_chunks: int = 1
    layers_per_stage: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.layers_per_stage is not None:
            object.__setattr__(self, "layers_per_stage", tuple(self.layers_per_stage))
        _check_size("pp_size", self.pp_size)
        if self.pp_size == 1:
            raise ValueError(
                "pipeline=PipelineConfig(...) splits the model over pipeline stages, but pp_size=1: set pp_size > 1"
                " or pipeline=None."
            )
        _check_size("num_model_chunks", self.num_model_chunks)
        _check_pipeline_schedule(self.pp_schedule)
        if (self.num_microbatches is None) == (self.microbatch_size is None):
            raise ValueError(
                "pp_size > 1 needs exactly one of num_microbatches or microbatch_size (how each batch is split into"
                " micro-batches), e.g. num_microbatches=4."
            )
        for name in ("num_microbatches", "microbatch_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r}: pass an integer >= 1.")
        if self.pp_schedule == "1f1b" and self.num_model_chunks != 1:
            raise ValueError(
                f"pp_schedule='1f1b' runs one model chunk per rank, but num_model_chunks={self.num_model_chunks}: use"
                " pp_schedule='interleaved' for several chunks, or num_model_chunks=1."
            )
        if self.pp_schedule == "interleaved" and self.num_model_chunks < 2:
            raise ValueError(
                "pp_schedule='interleaved' needs num_model_chunks >= 2 (chunks of layers per rank, visited in turn):"
                " pass e.g. num_model_chunks=2."
            )
        if self.pp_schedule == "zbv" and self.num_model_chunks != 2:
            raise ValueError(
                f"pp_schedule='zbv' places exactly two chunks per rank in a V, but num_model_chunks="
                f"{self.num_model_chunks}: pass num_model_chunks=2."
            )
        if self.layers_per_stage is not None:
            if any(count < 1 for count in self.layers_per_stage):
                raise ValueError(
                    f"layers_per_stage={list(self.layers_per_stage)}: every stage needs at least one layer; pass"
                    " positive entries (layers of stage 0, 1, ...), or None for an even split."
                )
            if len(self.layers_per_stage) != self.num_stages:
                raise ValueError(
                    f"layers_per_stage={list(self.layers_per_stage)} must have pp_size * num_model_chunks ="
                    f" {self.num_stages} positive entries (layers of stage 0, 1, ...), or be None for an even split."
                )

    @property
    def num_stages(self) -> int:
        """Pipeline stages in total: ``pp_size * num_model_chunks``."""
        return self.pp_size * self.num_model_chunks


def _check_pipeline_schedule(pp_schedule: str) -> None:
    if pp_schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pp_schedule={pp_schedule!r}: pass '1f1b', 'interleaved' or 'zbv'.")


@dataclass(frozen=True, kw_only=True)
class SplitGather:
    """Megatron sequence parallelism: the residual stream, norms and dropout run on sequence shards of the
    tensor-parallel group (all-gather before column-parallel layers, reduce-scatter after row-parallel ones); needs
    ``tp_size > 1``."""


@dataclass(frozen=True, kw_only=True)
class AllToAll:
    """Ulysses sequence parallelism: each rank of the ``sp`` axis holds a slice of the sequence, and attention
    exchanges heads for sequence with two all-to-alls.

    Args:
        sp_size: sequence-parallel ranks (at least 2).
    """

    sp_size: int

    def __post_init__(self) -> None:
        _check_size("sp_size", self.sp_size)
        if self.sp_size == 1:
            raise ValueError("sequence_parallel='all_to_all' needs sp_size > 1: set sp_size (e.g. 2).")


#: How the sequence dimension is split, if at all (``None``: not split).
SequenceParallelism = SplitGather | AllToAll


@dataclass(frozen=True, kw_only=True)
class GradientAveraging:
    """Data parallelism without ZeRO (hybrid's ``zero_stage=0``): gradients averaged over the data-parallel ranks
    after the last backward of each step, in buckets of one dtype.

    Args:
        bucket_size_mb: size of a gradient all-reduce bucket in MiB (of fp32-equivalent elements).
    """

    bucket_size_mb: float = 25.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bucket_size_mb) and self.bucket_size_mb > 0):
            raise ValueError(f"bucket_size_mb={self.bucket_size_mb}: pass a finite positive size in MiB, e.g. 25.")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Settings of the hybrid 3D engine (``lightning_colossal.parallel``): tensor, pipeline, sequence, data parallel.

    Each part is its own settings object, which owns its size; the data-parallel size is what is left:
    ``world_size / (tp_size * pp_size * sp_size)``. ``from_flat_arguments`` builds one from the strategy's flat
    keyword arguments.

    Args:
        tp_size: tensor-parallel ranks (attention heads, MLP width and vocabulary are split over them).
        pipeline: the pipeline settings (``PipelineConfig``, which holds ``pp_size``), or ``None`` for no pipeline.
        sequence_parallelism: ``SplitGather()``, ``AllToAll(sp_size=...)``, or ``None`` for no sequence parallelism.
        data_parallel: the reduction over the data-parallel (and Ulysses) ranks: ``GradientAveraging(...)``
            (``zero_stage=0``) or a ``ZeroConfig`` (ZeRO-1/2; stage 2 not with a pipeline).
        activation_checkpointing: recompute each transformer layer's activations in backward.
        init_window_bytes: when the model was built on the meta device, how many bytes of this rank's pieces one
            initialisation pass may materialise at once (more passes, less memory).
    """

    tp_size: int = 1
    pipeline: PipelineConfig | None = None
    sequence_parallelism: SequenceParallelism | None = None
    data_parallel: GradientAveraging | ZeroConfig = GradientAveraging()
    activation_checkpointing: bool = False
    init_window_bytes: int = 2**30

    def __post_init__(self) -> None:
        if self.init_window_bytes < 1:
            raise ValueError(f"init_window_bytes={self.init_window_bytes}: pass a positive integer.")
        _check_size("tp_size", self.tp_size)
        if self.zero_stage == 2 and self.pipeline is not None:
            raise ValueError(
                "zero_stage=2 with pp_size > 1 would reduce-scatter gradients after every micro-batch of the pipeline"
                " schedule (ZeRO-2 keeps no full gradients to accumulate into): use zero_stage=1 with pipelines."
            )
        if isinstance(self.sequence_parallelism, SplitGather) and self.tp_size == 1:
            raise ValueError(
                "sequence_parallel='split_gather' shards activations over the tensor-parallel ranks, but tp_size=1:"
                " set tp_size > 1, or use sequence_parallel='all_to_all' with sp_size > 1."
            )

    @classmethod
    def from_flat_arguments(
        cls,
        *,
        tp_size: int = 1,
        pp_size: int = 1,
        sp_size: int = 1,
        zero_stage: int = 0,
        sequence_parallel: SequenceParallelMode | None = None,
        pp_schedule: PipelineSchedule = "1f1b",
        num_microbatches: int | None = None,
        microbatch_size: int | None = None,
        num_model_chunks: int = 1,
        layers_per_stage: tuple[int, ...] | list[int] | None = None,
        bucket_size_mb: float = 25.0,
        activation_checkpointing: bool = False,
        init_window_bytes: int = 2**30,
        zero: ZeroConfig | None = None,
        **zero_options: Any,
    ) -> HybridConfig:
        """The config that one flat list of keyword arguments describes (how the strategy's constructor, and so
        LightningCLI, takes them). The flat arguments that are no field of a part are described here:

        Args:
            pp_size: pipeline stages the layers are split into; 1 for no pipeline, where the settings only a
                pipeline uses must keep their defaults and the micro-batch settings are ignored.
            sp_size: Ulysses sequence-parallel ranks (``sequence_parallel="all_to_all"``).
            zero_stage: 0 all-reduces gradients over the data-parallel axis; 1 shards optimizer state; 2 also shards
                gradients (not with ``pp_size > 1``).
            sequence_parallel: ``"split_gather"`` (Megatron: norms and dropout on sequence shards inside the
                tensor-parallel group) or ``"all_to_all"`` (Ulysses attention over the ``sp`` axis); ``None`` for
                none, which becomes ``"all_to_all"`` when ``sp_size > 1``.
            zero: the whole ZeRO settings of the data-parallel axis, every ``ZeroConfig`` field (e.g.
                ``ZeroConfig(stage=2, overlap_communication=False)``), instead of ``zero_stage``, ``bucket_size_mb``
                and the ZeRO settings passed one by one, which then keep their defaults. A ZeRO option added to
                ``ZeroConfig`` reaches the hybrid engine this way without a new argument here.
            zero_options: further ``ZeroConfig`` settings, for ``zero_stage`` 1 or 2 only.
        """
        for name, value in (("tp_size", tp_size), ("pp_size", pp_size), ("sp_size", sp_size)):
            _check_size(name, value)
        if pp_size > 1:
            pipeline: PipelineConfig | None = PipelineConfig(
                pp_size=pp_size,
                pp_schedule=pp_schedule,
                num_microbatches=num_microbatches,
                microbatch_size=microbatch_size,
                num_model_chunks=num_model_chunks,
                layers_per_stage=None if layers_per_stage is None else tuple(layers_per_stage),
            )
        else:
            _check_pipeline_schedule(pp_schedule)
            if num_model_chunks != 1 or layers_per_stage is not None:
                raise ValueError(
                    "num_model_chunks and layers_per_stage split the model over pipeline stages, but pp_size=1: set"
                    " pp_size > 1 or leave them at their defaults."
                )
            pipeline = None
        return cls(
            tp_size=tp_size,
            pipeline=pipeline,
            sequence_parallelism=_sequence_parallelism(sp_size, sequence_parallel),
            data_parallel=_data_parallel(zero_stage, bucket_size_mb, zero_options)
            if zero is None
            else _whole_zero(zero, zero_stage, bucket_size_mb, zero_options),
            activation_checkpointing=activation_checkpointing,
            init_window_bytes=init_window_bytes,
        )

    @property
    def pp_size(self) -> int:
        """Pipeline ranks (1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.pp_size

    @property
    def sp_size(self) -> int:
        """Ulysses sequence-parallel ranks (1 without ``AllToAll``)."""
        return self.sequence_parallelism.sp_size if isinstance(self.sequence_parallelism, AllToAll) else 1

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage of the data-parallel part (0: gradient averaging)."""
        return self.data_parallel.stage if isinstance(self.data_parallel, ZeroConfig) else 0

    @property
    def model_parallel_size(self) -> int:
        """Ranks that hold one replica of the model: ``tp_size * pp_size * sp_size``."""
        return self.tp_size * self.pp_size * self.sp_size

    @property
    def num_stages(self) -> int:
        """Pipeline stages in total (``pp_size * num_model_chunks``; 1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.num_stages


def _sequence_parallelism(sp_size: int, mode: SequenceParallelMode | None) -> SequenceParallelism | None:
    """The flat ``sp_size`` / ``sequence_parallel`` pair as one setting (``sp_size > 1`` alone means Ulysses)."""
    if mode not in (None, "split_gather", "all_to_all"):
        raise ValueError(f"sequence_parallel={mode!r}: pass None, 'split_gather' or 'all_to_all'.")
    if mode == "split_gather":
        if sp_size > 1:
            raise ValueError(
                f"sp_size={sp_size} is the Ulysses axis, but sequence_parallel='split_gather' runs on the"
                " tensor-parallel ranks: use sp_size=1 with 'split_gather', or sequence_parallel='all_to_all'."
            )
        return SplitGather()
    if mode == "all_to_all" or sp_size > 1:
        return AllToAll(sp_size=sp_size)
    return None


def _whole_zero(zero: ZeroConfig, zero_stage: int, bucket_size_mb: float, zero_options: dict[str, Any]) -> ZeroConfig:
    """``zero=ZeroConfig(...)`` as the data-parallel setting, refused beside the same settings passed one by one."""
    if not isinstance(zero, ZeroConfig):
        raise TypeError(f"zero={zero!r}: pass a ZeroConfig, e.g. ZeroConfig(stage=1), or None.")
    defaults = {field.name: field.default for field in fields(ZeroConfig)}
    given = [f"zero_stage={zero_stage}"] if zero_stage != 0 else []
    given += [f"bucket_size_mb={bucket_size_mb}"] if bucket_size_mb != defaults["bucket_size_mb"] else []
    given += [f"{name}={value!r}" for name, value in zero_options.items() if value != defaults.get(name)]
    if given:
        raise ValueError(
            f"zero={zero} and {', '.join(given)} both configure ZeRO: put every ZeRO setting into the ZeroConfig"
            " (e.g. ZeroConfig(stage=1, bucket_size_mb=50)) and leave the flat arguments at their defaults."
        )
    return zero


def _data_parallel(
    zero_stage: int, bucket_size_mb: float, zero_options: dict[str, Any]
) -> GradientAveraging | ZeroConfig:
    """The flat ``zero_stage`` / ``bucket_size_mb`` (and further ZeRO settings) as one data-parallel setting."""
    if zero_stage not in (0, 1, 2):
        raise ValueError(
            f"zero_stage={zero_stage}: pass 0 (all-reduce gradients), 1 (shard optimizer state) or 2 (also"
            " shard gradients). For sharded parameters use `colossal_gemini` or `colossal_fsdp`."
        )
    defaults = {field.name: field.default for field in fields(ZeroConfig)}
    if "stage" in zero_options:
        raise TypeError("stage: the hybrid engine takes the ZeRO stage as zero_stage (0, 1 or 2).")
    unknown = sorted(set(zero_options) - set(defaults))
    if unknown:
        raise TypeError(f"{', '.join(unknown)}: not a setting of the hybrid engine; ZeRO's are {', '.join(defaults)}.")
    if zero_stage > 0:
        return ZeroConfig(stage=zero_stage, bucket_size_mb=bucket_size_mb, **zero_options)
    changed = [f"{name}={value!r}" for name, value in zero_options.items() if value != defaults[name]]
    if changed:
        raise ValueError(
            f"{', '.join(changed)} configures ZeRO, but zero_stage=0: set zero_stage=1 (or 2), or leave"
            " it at its default."
        )
    return GradientAveraging(bucket_size_mb=bucket_size_mb)
