"""``colossal_zero1`` / ``colossal_zero2`` (and ``*_offload``): the ZeRO engine as a Lightning strategy.

The model is not wrapped: ``lightning_colossal.zero.ZeroEngine`` hooks its parameters' gradients and takes over the
parameter lists of the optimizer ``configure_optimizers`` returned. Lightning's loop stays in charge
(``EngineStrategy``): accumulation enters the engine's ``no_sync()`` on non-final micro-batches, clipping reaches
the engine through the precision plugin's gradient clipper (a global norm over every shard), and after each optimizer
step the engine publishes the updated rows to every replica.

Checkpoints hold the fp32 masters or the parameters by the engine's rule (``zero/engine.py`` [Note: masters or
parameters in checkpoints]).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import lightning.pytorch as pl
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.config import Communication, Stage2Accumulation, ZeroConfig
from lightning_colossal.strategies._lightning_private import _sync_module_states
from lightning_colossal.strategies.engine_strategy import EngineStrategy
from lightning_colossal.zero import ZeroEngine


class ZeroStrategy(EngineStrategy[ZeroEngine]):
    """ZeRO stage 1 or 2 over the data-parallel ranks, optionally with the optimizer on the CPU.

    Registered as ``colossal_zero1``, ``colossal_zero2``, ``colossal_zero1_offload``, ``colossal_zero2_offload``
    (each also ``*_notebook``). Every argument is a ``ZeroConfig`` setting, described there (the ``Args:`` below are
    completed from it).
    """

    # The constructor names each ZeroConfig field once more, as LightningCLI reads arguments from the signature.
    argument_doc_sources = (ZeroConfig,)
    # One engine per optimizer, manual optimization included (engines_by_optimizer.py [Note: one engine per optimizer]).
    takes_several_optimizers = True
    # Parameters that join an optimizer later rebuild its engine (zero/engine.py [Note: parameters that join the
    # optimizer]).
    takes_joining_parameters = True

    def __init__(
        self,
        stage: Literal[1, 2] = 1,
        cpu_offload: bool = False,
        bucket_size_mb: float = 25.0,
        overlap_communication: bool = True,
        stage2_accumulation: Stage2Accumulation = "sharded",
        communication: Communication = "auto",
        overlap_parameter_exchange: bool = True,
        offload_dir: str | None = None,
        disk_fraction: float = 0.0,
        masters_on_disk: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.zero_config = ZeroConfig(
            stage=stage,
            cpu_offload=cpu_offload,
            bucket_size_mb=bucket_size_mb,
            overlap_communication=overlap_communication,
            stage2_accumulation=stage2_accumulation,
            communication=communication,
            overlap_parameter_exchange=overlap_parameter_exchange,
            offload_dir=offload_dir,
            disk_fraction=disk_fraction,
            masters_on_disk=masters_on_disk,
        )

    def grad_norm_limitation(self) -> str | None:
        if self.zero_config.stage == 1:
            return None  # stage 1 reduces whole gradients into .grad
        return (
            "parameters' `.grad` is None (ZeRO-2 keeps each reduced gradient only as this rank's shard), so Lightning's"
            " `grad_norm(module)` finds no gradient and logs nothing"
        )

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [
            ("colossal_zero1", {"stage": 1, "cpu_offload": False}),
            ("colossal_zero2", {"stage": 2, "cpu_offload": False}),
            ("colossal_zero1_offload", {"stage": 1, "cpu_offload": True}),
            ("colossal_zero2_offload", {"stage": 2, "cpu_offload": True}),
        ]

    def _build_engine(self, trainer: pl.Trainer, optimizer: Optimizer | None) -> ZeroEngine | None:
        assert self.model is not None
        if optimizer is None:
            # Without the engine nothing broadcasts rank 0's weights; do it once so every rank evaluates the same model.
            _sync_module_states(self.model)
            return None
        return ZeroEngine(
            self.model, optimizer, self.zero_config, self.device_mesh["dp"], self.root_device, timeout=self._timeout
        )

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        # After fit, the fit's engines still hold the unrounded masters (engine_strategy.py [Note: a fit's optimizer
        # outlives the evaluation after it]); each puts in those of its own optimizer's parameters.
        for engine in self._checkpoint_engines():
            state = engine.with_precise_masters(state)
        return state

    def _on_model_state_loaded(self) -> None:
        for engine in self.engines:
            engine.resync_after_model_state_loaded()

    def weights_for_averaging(self) -> dict[str, Any]:
        # This rank's master rows even where they are rows of the fp32 parameters: the average then takes
        # 4 bytes x parameters / ranks, not a whole copy per rank.
        assert self.lightning_module is not None
        engines = self._checkpoint_engines()
        if not engines:
            return super().weights_for_averaging()
        state = self.lightning_module.state_dict()
        for engine in engines:
            state = engine.with_precise_masters(state, always=True)
        return self._averageable(state)

    def after_averaged_weights_written(self) -> None:
        # The masters were written: every replica's parameters follow them (one exchange per engine).
        for engine in self.engines:
            engine.masters_to_parameters()

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(state_dict, strict=strict)
        # The file may hold fp32 weights: masters take them unrounded, not the (possibly bf16) parameters.
        for engine in self.engines:
            engine.parameters_to_masters(full_weights=state_dict)
