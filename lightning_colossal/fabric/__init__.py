"""Lightning Fabric strategies: the same modes, checkpoints and precision as the Trainer's, for hand-written loops.

Importing ``lightning_colossal`` registers every name in Fabric's strategy registry as well as the Trainer's, so
``Fabric(strategy="colossal_zero2")`` works after ``import lightning_colossal``; the classes are here for
``Fabric(strategy=FabricZeroStrategy(stage=2, ...))``. See ``fabric/strategy.py`` [Note: one mode, two front doors]
and ``docs/fabric.md``.
"""

from __future__ import annotations

from lightning_colossal.fabric.modes import (
    FABRIC_STRATEGIES,
    FabricDDPStrategy,
    FabricFSDPStrategy,
    FabricGeminiStrategy,
    FabricHybridStrategy,
    FabricZeroStrategy,
)
from lightning_colossal.fabric.precision import FabricPrecision
from lightning_colossal.fabric.strategy import ColossalFabricStrategy


def register_fabric_strategies() -> None:
    """Register every Fabric strategy name (``colossal_*`` and ``*_notebook``); safe to call any number of times."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    for strategy_class in FABRIC_STRATEGIES:
        for name, init_params in strategy_class.trainer_strategy.registry_entries():
            for suffix, start_method in (("", "popen"), ("_notebook", "fork")):
                if name + suffix in STRATEGY_REGISTRY:
                    continue
                STRATEGY_REGISTRY.register(
                    name + suffix,
                    strategy_class,
                    description=f"lightning_colossal {strategy_class.__name__} ({start_method} launcher)",
                    start_method=start_method,
                    **init_params,
                )


__all__ = [
    "ColossalFabricStrategy",
    "FabricDDPStrategy",
    "FabricFSDPStrategy",
    "FabricGeminiStrategy",
    "FabricHybridStrategy",
    "FabricPrecision",
    "FabricZeroStrategy",
    "register_fabric_strategies",
]
