"""lightning_colossal: ColossalAI-style large-model training as PyTorch Lightning strategies, in pure PyTorch.

Importing the package registers the strategy names (``colossal_ddp``, ``colossal_ddp_notebook``, ...) in
Lightning's ``StrategyRegistry``, so ``Trainer(strategy="colossal_ddp")`` works after ``import lightning_colossal``.
"""

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
    "register_strategies",
    "__version__",
]
