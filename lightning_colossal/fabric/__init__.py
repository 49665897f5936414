"""Lightning Fabric strategies: the same modes, checkpoints and precision as the Trainer's, for hand-written loops.

Importing ``lightning_colossal`` registers every name in Fabric's strategy registry as well as the Trainer's, so
``Fabric(strategy="colossal_zero2")`` works after ``import lightning_colossal``; the classes are here for
``Fabric(strategy=FabricZeroStrategy(stage=2, ...))``. See ``fabric/strategy.py`` [Note: one mode, two front doors]
and ``docs/fabric.md``.
"""

from __future__ import annotations

from typing import Any

from lightning_colossal.fabric.modes import (
    FABRIC_STRATEGIES,
    FabricDDPStrategy,
    FabricFSDPStrategy,
    FabricGeminiStrategy,
    FabricZeroStrategy,
)
from lightning_colossal.fabric.precision import FabricPrecision
from lightning_colossal.fabric.strategy import ColossalFabricStrategy


class FabricHybridRefusal:
    """``colossal_hybrid`` under Fabric: refused with the reason when the strategy is built."""

    def __init__(self, **arguments: Any) -> None:
        raise ValueError(
            "colossal_hybrid has no Fabric strategy: its pipeline schedule replaces the training step, which a Fabric"
            " loop writes itself, and tensor parallelism's loss needs a context around the loop's own loss code. Use"
            " `Trainer(strategy='colossal_hybrid', ...)`, or under Fabric one of colossal_zero1/2, colossal_gemini,"
            " colossal_fsdp or colossal_ddp."
        )


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
    for suffix in ("", "_notebook"):
        if "colossal_hybrid" + suffix not in STRATEGY_REGISTRY:
            STRATEGY_REGISTRY.register(
                "colossal_hybrid" + suffix, FabricHybridRefusal, description="refused under Fabric (see the message)"
            )


__all__ = [
    "ColossalFabricStrategy",
    "FabricDDPStrategy",
    "FabricFSDPStrategy",
    "FabricGeminiStrategy",
    "FabricPrecision",
    "FabricZeroStrategy",
    "register_fabric_strategies",
]
