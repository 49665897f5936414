"""Settings of the hybrid 3D engine: tensor, pipeline, sequence and data parallelism, each part its own object."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal, TypeVar, get_args

from lightning_colossal.config.data_parallel import ZeroConfig

SequenceParallelMode = Literal["split_gather", "all_to_all", "ring"]
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

    #: The mode's one name: ``sequence_parallel=`` takes it, and messages and listings say it.
    name: ClassVar[str] = "split_gather"
    #: Which tokens each rank holds ([Note: sequence layouts] in ``parallel/sequence_layout.py``): contiguous
    #: slices, over the tensor-parallel ranks.
    layout: ClassVar[str] = "contiguous"
    #: No ``sp`` axis: the shards are the tensor-parallel ranks'.
    sp_size: ClassVar[int] = 1

    @classmethod
    def from_sp_size(cls, sp_size: int) -> SplitGather:
        """The mode as the flat ``sequence_parallel="split_gather"`` / ``sp_size`` pair describes it."""
        if sp_size > 1:
            raise ValueError(
                f"sp_size={sp_size} is the Ulysses axis, but sequence_parallel='split_gather' runs on the"
                " tensor-parallel ranks: use sp_size=1 with 'split_gather', or sequence_parallel='all_to_all'."
            )
        return cls()


@dataclass(frozen=True, kw_only=True)
class _SequenceAxis:
    """A mode over the ``sp`` axis of the mesh: each of its ``sp_size`` ranks holds a share of every sequence."""

    name: ClassVar[str]
    layout: ClassVar[str]
    sp_size: int

    def __post_init__(self) -> None:
        _check_size("sp_size", self.sp_size)
        if self.sp_size == 1:
            raise ValueError(f"sequence_parallel={self.name!r} needs sp_size > 1: set sp_size (e.g. 2).")

    @classmethod
    def from_sp_size(cls: type[_Axis], sp_size: int) -> _Axis:
        """The mode as the flat ``sequence_parallel`` / ``sp_size`` pair describes it."""
        return cls(sp_size=sp_size)


_Axis = TypeVar("_Axis", bound=_SequenceAxis)


@dataclass(frozen=True, kw_only=True)
class AllToAll(_SequenceAxis):
    """Ulysses sequence parallelism: each rank of the ``sp`` axis holds a slice of the sequence, and attention
    exchanges heads for sequence with two all-to-alls.

    Args:
        sp_size: sequence-parallel ranks (at least 2).
    """

    name: ClassVar[str] = "all_to_all"
    layout: ClassVar[str] = "contiguous"


@dataclass(frozen=True, kw_only=True)
class Ring(_SequenceAxis):
    """Ring attention (context parallelism): each rank of the ``sp`` axis holds two zigzag chunks of the sequence
    (balanced causal work) and attention passes key/value blocks around the ring, so no rank ever holds the whole
    sequence's activations; composes with tensor and pipeline parallelism and ZeRO. The sequence length must divide
    into ``2 * sp_size`` chunks.

    Args:
        sp_size: ranks of the ring (at least 2).
    """

    name: ClassVar[str] = "ring"
    layout: ClassVar[str] = "zigzag"


#: How the sequence dimension is split, if at all (``None``: not split). Each mode owns its name, its layout and its
#: ``sp_size``; ``parallel/`` dispatches on the type.
SequenceParallelism = SplitGather | AllToAll | Ring
#: Every mode, by its name (``sequence_parallel=``); a new mode is one more class here and in the two lines above.
SEQUENCE_PARALLEL_MODES: dict[str, type[SequenceParallelism]] = {
    mode.name: mode for mode in (SplitGather, AllToAll, Ring)
}
assert set(get_args(SequenceParallelMode)) == set(SEQUENCE_PARALLEL_MODES), "SequenceParallelMode lists every mode"


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
class ExpertParallel:
    """Expert parallelism of mixture-of-experts layers, carved out of the data-parallel ranks (ColossalAI's
    ``MoeHybridParallelPlugin``): each group of ``ep_size`` consecutive data-parallel ranks splits every experts
    module's experts between its ranks, and tokens travel to the rank holding their expert by all-to-all (dropless:
    every routed token is computed). ``ep_size`` must divide the data-parallel size.

    Args:
        ep_size: expert-parallel ranks (at least 2); each holds ``num_experts / ep_size`` experts of every layer.
    """

    ep_size: int

    def __post_init__(self) -> None:
        _check_size("ep_size", self.ep_size)
        if self.ep_size == 1:
            raise ValueError("ExpertParallel(ep_size=1) splits nothing: pass ep_size >= 2, or expert_parallelism=None.")


@dataclass(frozen=True, kw_only=True)
class HybridConfig:
    """Settings of the hybrid 3D engine (``lightning_colossal.parallel``): tensor, pipeline, sequence, data parallel.

    Each part is its own settings object, which owns its size; the data-parallel size is what is left:
    ``world_size / (tp_size * pp_size * sp_size)``. ``from_flat_arguments`` builds one from the strategy's flat
    keyword arguments.

    Args:
        tp_size: tensor-parallel ranks (attention heads, MLP width and vocabulary are split over them).
        pipeline: the pipeline settings (``PipelineConfig``, which holds ``pp_size``), or ``None`` for no pipeline.
        sequence_parallelism: ``SplitGather()``, ``AllToAll(sp_size=...)``, ``Ring(sp_size=...)``, or ``None`` for no
            sequence parallelism.
        data_parallel: the reduction over the data-parallel (and Ulysses) ranks: ``GradientAveraging(...)``
            (``zero_stage=0``) or a ``ZeroConfig`` (ZeRO-1/2; stage 2 not with a pipeline).
        expert_parallelism: ``ExpertParallel(ep_size=...)`` to split mixture-of-experts layers' experts over
            data-parallel ranks, or ``None`` (every rank holds every expert).
        activation_checkpointing: recompute each transformer layer's activations in backward.
        init_window_bytes: when the model was built on the meta device, how many bytes of this rank's pieces one
            initialisation pass may materialise at once (more passes, less memory).
    """

    tp_size: int = 1
    pipeline: PipelineConfig | None = None
    sequence_parallelism: SequenceParallelism | None = None
    data_parallel: GradientAveraging | ZeroConfig = GradientAveraging()
    expert_parallelism: ExpertParallel | None = None
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
        if self.expert_parallelism is not None:
            _check_expert_parallel_combination(self)
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
        ep_size: int = 1,
        **zero_options: Any,
    ) -> HybridConfig:
        """The config that one flat list of keyword arguments describes (how the strategy's constructor, and so
        LightningCLI, takes them). The flat arguments that are no field of a part are described here:

        Args:
            pp_size: pipeline stages the layers are split into; 1 for no pipeline, where the settings only a
                pipeline uses must keep their defaults and the micro-batch settings are ignored.
            sp_size: sequence-parallel ranks: Ulysses' (``sequence_parallel="all_to_all"``) or the ring's
                (``sequence_parallel="ring"``).
            zero_stage: 0 all-reduces gradients over the data-parallel axis; 1 shards optimizer state; 2 also shards
                gradients (not with ``pp_size > 1``).
            sequence_parallel: ``"split_gather"`` (Megatron: norms and dropout on sequence shards inside the
                tensor-parallel group), ``"all_to_all"`` (Ulysses attention over the ``sp`` axis) or ``"ring"`` (ring
                attention over the ``sp`` axis, zigzag sequence shards); ``None`` for none, which becomes
                ``"all_to_all"`` when ``sp_size > 1``.
            zero: the whole ZeRO settings of the data-parallel axis, every ``ZeroConfig`` field (e.g.
                ``ZeroConfig(stage=2, overlap_communication=False)``), instead of ``zero_stage``, ``bucket_size_mb``
                and the ZeRO settings passed one by one, which then keep their defaults. A ZeRO option added to
                ``ZeroConfig`` reaches the hybrid engine this way without a new argument here.
            zero_options: further ``ZeroConfig`` settings, for ``zero_stage`` 1 or 2 only.
            ep_size: expert-parallel ranks (``ExpertParallel``), carved out of the data-parallel ranks; 1 for none.
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
            expert_parallelism=_expert_parallelism(ep_size),
        )

    @property
    def pp_size(self) -> int:
        """Pipeline ranks (1 without a pipeline)."""
        return 1 if self.pipeline is None else self.pipeline.pp_size

    @property
    def sp_size(self) -> int:
        """Sequence-parallel ranks of the ``sp`` axis, Ulysses' or the ring's (1 without one, or with split-gather)."""
        return 1 if self.sequence_parallelism is None else self.sequence_parallelism.sp_size

    @property
    def ep_size(self) -> int:
        """Expert-parallel ranks (1 without ``ExpertParallel``)."""
        return 1 if self.expert_parallelism is None else self.expert_parallelism.ep_size

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
    if mode is None:
        return AllToAll(sp_size=sp_size) if sp_size > 1 else None
    kind = SEQUENCE_PARALLEL_MODES.get(mode) if isinstance(mode, str) else None
    if kind is None:
        names = [repr(name) for name in SEQUENCE_PARALLEL_MODES]
        raise ValueError(f"sequence_parallel={mode!r}: pass None, {', '.join(names[:-1])} or {names[-1]}.")
    return kind.from_sp_size(sp_size)


def _expert_parallelism(ep_size: int) -> ExpertParallel | None:
    """The flat ``ep_size`` as one setting (1: none)."""
    _check_size("ep_size", ep_size)
    return ExpertParallel(ep_size=ep_size) if ep_size > 1 else None


def _check_expert_parallel_combination(config: HybridConfig) -> None:
    """Expert parallelism is built and tested over data-parallel ranks only so far (with or without ZeRO)."""
    others = [
        f"{name}={value}"
        for name, value in (("tp_size", config.tp_size), ("pp_size", config.pp_size), ("sp_size", config.sp_size))
        if value > 1
    ]
    if others:
        raise ValueError(
            f"ep_size={config.ep_size} with {', '.join(others)} is not supported yet: expert parallelism runs over"
            " data-parallel ranks only. Use tp_size=pp_size=sp_size=1 with ep_size, or ep_size=1."
        )


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
