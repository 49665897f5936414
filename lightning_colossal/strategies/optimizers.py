"""The optimizers a strategy builds: those the sharding engines take over (every optimizer under ZeRO, exactly one
under Gemini and hybrid parallelism), and the user's optimizer inside Lightning's wrapper.

``OptimizerSetupMixin`` is a part of ``ColossalStrategy`` (``strategies/base.py``), split out by what it owns.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ParallelStrategy
from torch.optim import Optimizer


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer (Lightning hands strategies a ``LightningOptimizer`` wrapping it in some hooks)."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def refuse_parameters_in_two_optimizers(optimizers: list[Optimizer], strategy_name: str) -> None:
    """Refuse a trainable parameter held by two of ``optimizers``: one engine per optimizer would each shard it."""
    owner: dict[int, int] = {}
    for index, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                if not parameter.requires_grad:
                    continue  # frozen: no engine takes it (optimizer_takeover.py [Note: optimizer takeover])
                first = owner.setdefault(id(parameter), index)
                if first != index:
                    raise ValueError(
                        f"A parameter of shape {tuple(parameter.shape)} is in optimizer {first} and in optimizer"
                        f" {index}: {strategy_name} shards each optimizer's parameters separately, so a parameter"
                        " must belong to one optimizer only. Give each parameter to one optimizer (one param group per"
                        " setting within it)."
                    )


class OptimizerSetupMixin(ParallelStrategy):
    """Set-up steps on optimizers that several modes share (see the module docstring)."""

    def _setup_engine_optimizers(self, trainer: Any) -> list[Optimizer]:
        """Build every optimizer ``configure_optimizers`` returns, for one engine each (ZeRO).

        Lightning itself refuses several optimizers under automatic optimization, with the fix (manual optimization,
        which these engines take); a trainable parameter in two optimizers is refused here, as two engines would each
        shard it.
        """
        self.setup_optimizers(trainer)
        optimizers = [unwrap_optimizer(optimizer) for optimizer in self.optimizers]
        refuse_parameters_in_two_optimizers(optimizers, type(self).__name__)
        return optimizers

    def _setup_single_optimizer(self, trainer: Any, manual_reason: str, manual_alternatives: str) -> Optimizer:
        """Build the one optimizer a sharding engine takes over; refuse manual optimization and several optimizers.

        Args:
            manual_reason: why the engine cannot leave the step to the user (what it owns).
            manual_alternatives: the strategy names to use instead for manual optimization and several optimizers.
        """
        assert self.lightning_module is not None
        name = type(self).__name__
        several_optimizers = (
            f"{name} shards exactly one optimizer, and manual optimization (which Lightning suggests for several"
            f" optimizers) is not supported either ({manual_reason}). Put all parameters into one optimizer with one"
            " param group per setting, e.g. `torch.optim.AdamW([{'params': self.encoder.parameters()}, {'params':"
            f" self.head.parameters(), 'lr': 1e-3}}])`, or train with {manual_alternatives}, which take several"
            " optimizers under manual optimization."
        )
        automatic = self.lightning_module.automatic_optimization
        try:
            # Under manual optimization Lightning accepts several optimizers, so count them before refusing: a user
            # with two optimizers must hear about both limits at once, not be sent from one refusal to the other.
            self.setup_optimizers(trainer)
        except RuntimeError as error:
            # Lightning refuses several optimizers under automatic optimization by telling the user to switch to
            # manual optimization, which this strategy refuses next: replace that advice with the fix that works.
            if automatic and "multiple optimizers" in str(error):
                raise ValueError(several_optimizers) from error
            raise
        if len(self.optimizers) != 1:
            raise ValueError(f"`configure_optimizers` returned {len(self.optimizers)} optimizers. {several_optimizers}")
        if not automatic:
            raise ValueError(
                f"{name} does not support manual optimization ({manual_reason}). Use automatic optimization, or"
                f" {manual_alternatives} for manual optimization."
            )
        return unwrap_optimizer(self.optimizers[0])

    def _drop_optimizers_of_earlier_fit(self) -> None:
        """Forget the optimizers and LR schedulers of an earlier ``fit`` once their state no longer belongs to the
        module's weights (an evaluation stage loaded others): ``trainer.save_checkpoint`` then writes the weights only.
        """
        self.optimizers = []
        self.lr_scheduler_configs = []
