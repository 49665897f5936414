"""lightning_colossal: ColossalAI-style large-model training as PyTorch Lightning strategies, in pure PyTorch.

Importing the package registers the strategy names (``colossal_ddp``, ``colossal_ddp_notebook``, ...) in
Lightning's ``StrategyRegistry``, so ``Trainer(strategy="colossal_ddp")`` works after ``import lightning_colossal``.

[Note: misspelt strategy names]
Lightning validates ``Trainer(strategy="...")`` against its registry inside ``Trainer.__init__`` and raises its own
generic error, with no hook for a strategy package: it discovers no strategies through entry points (its only entry
point group, ``lightning.pytorch.callbacks_factory``, is read after the strategy name was checked), and it only
knows our names once this package was imported. A misspelt name in ``Trainer(strategy=...)`` therefore gets
Lightning's message; ``strategy_from_name("colossal_gemeni")`` builds a strategy by name and, for a misspelt one,
names the closest registered ``colossal_*`` names.
"""

import difflib
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_colossal.config import (
    AutoPlacement,
    DDPConfig,
    GeminiConfig,
    HybridConfig,
    LossScalerConfig,
    StaticPlacement,
    ZeroConfig,
)
from lightning_colossal.precision import ColossalPrecision, DynamicLossScaler
from lightning_colossal.strategies import (
    ALL_STRATEGIES,
    ColossalDDPStrategy,
    ColossalFSDPStrategy,
    ColossalStrategy,
    GeminiStrategy,
    HybridParallelStrategy,
    ZeroStrategy,
)

__version__ = "0.1.0"


def register_strategies() -> None:
    """Register every lightning_colossal strategy name; safe to call any number of times."""
    for strategy_class in ALL_STRATEGIES:
        strategy_class.register_strategies(StrategyRegistry)
    # The same names for Lightning Fabric (fabric/__init__.py).
    from lightning_colossal.fabric import register_fabric_strategies

    register_fabric_strategies()


def strategy_names() -> list[str]:
    """Every registered lightning_colossal strategy name (``colossal_*``, including ``*_notebook``), sorted."""
    names = {
        name + suffix
        for strategy_class in ALL_STRATEGIES
        for name, _ in strategy_class.registry_entries()
        for suffix in ("", "_notebook")
    }
    return sorted(names)


def closest_strategy_names(name: str) -> list[str]:
    """Up to three registered lightning_colossal names closest to ``name`` (for a misspelt name), best first."""
    return difflib.get_close_matches(name, strategy_names(), n=3, cutoff=0.6)


def strategy_from_name(name: str, **arguments: Any) -> ColossalStrategy:
    """The strategy registered as ``name``, built with the arguments the name implies plus ``arguments``.

    ``Trainer(strategy=strategy_from_name("colossal_gemini", chunk_numel=2**22))`` is
    ``Trainer(strategy="colossal_gemini")`` with one setting changed; a misspelt name fails with the closest
    registered names instead of Lightning's generic list (see [Note: misspelt strategy names]).
    """
    if name not in strategy_names():
        close = closest_strategy_names(name)
        hint = f"Did you mean {' or '.join(repr(match) for match in close)}? " if close else ""
        raise ValueError(
            f"{name!r} is not a lightning_colossal strategy name. {hint}The names are: {', '.join(strategy_names())}."
        )
    register_strategies()  # the registry may have been cleared since the import
    entry = StrategyRegistry[name]
    return entry["strategy"](**{**entry["init_params"], **arguments})


register_strategies()

__all__ = [
    "AutoPlacement",
    "ColossalDDPStrategy",
    "ColossalFSDPStrategy",
    "ColossalPrecision",
    "ColossalStrategy",
    "DDPConfig",
    "DynamicLossScaler",
    "GeminiConfig",
    "GeminiStrategy",
    "HybridConfig",
    "HybridParallelStrategy",
    "LossScalerConfig",
    "StaticPlacement",
    "ZeroConfig",
    "ZeroStrategy",
    "closest_strategy_names",
    "register_strategies",
    "strategy_from_name",
    "strategy_names",
    "__version__",
]
