"""Typed settings shared by the engines and strategies.

Every setting object is a frozen, keyword-only dataclass that validates itself in ``__post_init__`` and raises a
``ValueError`` whose message names the fix. Strategies take a few explicit keyword arguments (so LightningCLI can
read them) and build these objects; engines only ever see the objects.

One module per part: ``run`` (what every strategy shares), ``data_parallel`` (DDP, ZeRO), ``gemini``, ``fsdp``,
``hybrid``. Import the settings from here: the modules are how the package is laid out, not an interface.
"""

from lightning_colossal.config.data_parallel import (
    Communication,
    DDPConfig,
    GradientCompression,
    Stage2Accumulation,
    ZeroConfig,
    bucket_numel,
)
from lightning_colossal.config.fsdp import (
    FSDPConfig,
)
from lightning_colossal.config.gemini import (
    AutoPlacement,
    GeminiConfig,
    Placement,
    StaticPlacement,
)
from lightning_colossal.config.hybrid import (
    PIPELINE_SCHEDULES,
    AllToAll,
    ExpertParallel,
    GradientAveraging,
    HybridConfig,
    PipelineConfig,
    PipelineSchedule,
    Ring,
    SequenceParallelism,
    SequenceParallelMode,
    SplitGather,
)
from lightning_colossal.config.run import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    NONFINITE_ACTIONS,
    START_METHODS,
    SUPPORTED_PRECISIONS,
    LossScalerConfig,
    NonFiniteAction,
    PrecisionName,
    StartMethod,
    validate_nonfinite_action,
    validate_precision,
    validate_start_method,
)

__all__ = [
    "bucket_numel",
    "AllToAll",
    "ExpertParallel",
    "AutoPlacement",
    "Communication",
    "DDPConfig",
    "DEFAULT_COLLECTIVE_TIMEOUT",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "FSDPConfig",
    "GeminiConfig",
    "GradientAveraging",
    "GradientCompression",
    "HybridConfig",
    "LossScalerConfig",
    "NONFINITE_ACTIONS",
    "NonFiniteAction",
    "PIPELINE_SCHEDULES",
    "PipelineConfig",
    "PipelineSchedule",
    "Placement",
    "PrecisionName",
    "START_METHODS",
    "SUPPORTED_PRECISIONS",
    "Ring",
    "SequenceParallelMode",
    "SequenceParallelism",
    "SplitGather",
    "Stage2Accumulation",
    "StartMethod",
    "StaticPlacement",
    "ZeroConfig",
    "validate_nonfinite_action",
    "validate_precision",
    "validate_start_method",
]
