"""What one benchmark run trains: the configurations compared and the spec handed to every rank.

A configuration is a strategy under a label: a name registered in Lightning's ``StrategyRegistry`` (``ddp``,
``colossal_ddp`` after ``import lightning_colossal``) or an importable ``module:Class``, with JSON constructor
arguments and the training mode (``ddp``, ``zero1``, ...) whose model-state formula it is checked against.
Nothing here imports torch or Lightning, so the orchestrator parses its arguments at once.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.harness.measure import MODEL_STATE_FORMULAS, STRATEGY_MODES

__all__ = [
    "BENCHMARK_MODEL",
    "DEEPSPEED_INSTALL_COMMAND",
    "DEEPSPEED_STAGES",
    "Configuration",
    "RunSpec",
    "check_deepspeed_installed",
    "parse_configuration",
    "parse_strategy_names",
]

# The 27.4M-parameter benchmark GPT (benchmarks/RESULTS.md, "Method"): d512, 6 layers, 8 heads, vocabulary 8192,
# untied LM head.
BENCHMARK_MODEL: dict[str, Any] = {
    "vocab_size": 8192,
    "block_size": 128,
    "num_layers": 6,
    "num_heads": 8,
    "embed_dim": 512,
    "tie_weights": False,
}

_CONFIGURATION_KEYS = ("label", "strategy", "args", "mode")

# DeepSpeed's ZeRO stages as peer configurations, by name. They are not Lightning strategies: Lightning's
# DeepSpeedStrategy refuses CPU accelerators, so the worker drives DeepSpeed's own engine for them
# (benchmarks/deepspeed_worker.py). Their ``args`` are merged over the engine's ``zero_optimization`` settings.
DEEPSPEED_STAGES: dict[str, int] = {"deepspeed_zero1": 1, "deepspeed_zero2": 2, "deepspeed_zero3": 3}
# DeepSpeed's setup.py imports torch, so pip's isolated build environment (which has no torch) cannot build it.
DEEPSPEED_INSTALL_COMMAND = "pip install --no-build-isolation 'lightning_colossal[benchmark-deepspeed]'"


def deepspeed_installed() -> bool:
    """Whether ``import deepspeed`` can find the package (it is not imported: that takes seconds)."""
    return importlib.util.find_spec("deepspeed") is not None


def check_deepspeed_installed(configurations: Sequence[Configuration]) -> None:
    """Fail before any run starts when a DeepSpeed configuration is asked for and DeepSpeed is missing.

    Raises:
        ValueError: naming the configurations and the install command.
    """
    wanted = [configuration.label for configuration in configurations if configuration.strategy in DEEPSPEED_STAGES]
    if wanted and not deepspeed_installed():
        raise ValueError(
            f"{', '.join(wanted)} need DeepSpeed, which is not installed; install the optional extra with "
            f"`{DEEPSPEED_INSTALL_COMMAND}` (or `pip install --no-build-isolation deepspeed`)."
        )


@dataclass(frozen=True)
class Configuration:
    """One strategy under test.

    Args:
        label: Name of the configuration in tables, ``--peer`` and the JSON output.
        strategy: A registered strategy name or ``module:Class``.
        init_args: Keyword arguments for the strategy's constructor (merged over a registered name's own).
        mode: Key of ``MODEL_STATE_FORMULAS`` to compare the measured bytes with; ``None`` for no formula.
    """

    label: str
    strategy: str
    init_args: dict[str, Any] = field(default_factory=dict)
    mode: str | None = None


def _default_mode(strategy: str) -> str | None:
    return STRATEGY_MODES.get(strategy)


def _check_strategy(strategy: str) -> None:
    if not strategy:
        raise ValueError("A strategy must not be empty; give a registered name (e.g. ddp) or module:Class.")
    if ":" in strategy:
        module, _, class_name = strategy.partition(":")
        if not module or not class_name or ":" in class_name:
            raise ValueError(f"Strategy {strategy!r} is not of the form module:Class (e.g. lightning_colossal:Foo).")


def _check_mode(mode: str | None) -> None:
    if mode is not None and mode not in MODEL_STATE_FORMULAS:
        raise ValueError(f"Unknown mode {mode!r}; choose one of {sorted(MODEL_STATE_FORMULAS)}.")


def parse_strategy_names(text: str) -> list[Configuration]:
    """Configurations from ``--strategies a,b,module:Class``: each labelled by its name, with no arguments.

    Raises:
        ValueError: an empty list or name, a malformed ``module:Class``, or a name given twice.
    """
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise ValueError("--strategies needs at least one name, e.g. --strategies colossal_ddp,ddp.")
    configurations = []
    for name in names:
        _check_strategy(name)
        configurations.append(Configuration(label=name, strategy=name, mode=_default_mode(name)))
    return configurations


def parse_configuration(tokens: list[str]) -> Configuration:
    """A configuration from ``--configuration label=L strategy=S [args=JSON] [mode=M]`` tokens.

    Raises:
        ValueError: a token without ``=``, an unknown or repeated key, a missing label or strategy, ``args`` that
            is not a JSON object, or an unknown mode.
    """
    values: dict[str, str] = {}
    for token in tokens:
        key, separator, value = token.partition("=")
        if not separator:
            raise ValueError(f"--configuration token {token!r} is not key=value; keys are {list(_CONFIGURATION_KEYS)}.")
        if key not in _CONFIGURATION_KEYS:
            raise ValueError(f"Unknown --configuration key {key!r}; keys are {list(_CONFIGURATION_KEYS)}.")
        if key in values:
            raise ValueError(f"--configuration key {key!r} is given twice.")
        values[key] = value
    for required in ("label", "strategy"):
        if not values.get(required):
            raise ValueError(f"--configuration needs {required}=..., e.g. label=zero2 strategy=colossal_zero2.")
    _check_strategy(values["strategy"])
    init_args: Any = {}
    if "args" in values:
        try:
            init_args = json.loads(values["args"])
        except json.JSONDecodeError as error:
            raise ValueError(f"--configuration args={values['args']!r} is not valid JSON: {error}.") from None
        if not isinstance(init_args, dict):
            raise ValueError("--configuration args must be a JSON object, e.g. args='{\"bucket_cap_mb\": 50}'.")
    mode = values.get("mode") or _default_mode(values["strategy"])
    _check_mode(mode)
    return Configuration(label=values["label"], strategy=values["strategy"], init_args=init_args, mode=mode)


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs to train one run; written as JSON by the orchestrator, read by every rank."""

    strategy: str
    init_args: dict[str, Any]
    model_config: dict[str, Any]
    world_size: int
    batch_size_per_rank: int
    sequence_length: int
    warmup_steps: int
    measured_steps: int
    learning_rate: float
    seed: int
    result_directory: str

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.measured_steps

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def read(cls, path: Path) -> RunSpec:
        return cls(**json.loads(path.read_text()))
