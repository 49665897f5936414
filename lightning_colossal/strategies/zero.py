"""``colossal_zero1`` / ``colossal_zero2`` (and ``*_offload``): the ZeRO engine as a Lightning strategy.

The model is not wrapped: ``lightning_colossal.zero.ZeroEngine`` hooks its parameters' gradients and takes over the
parameter lists of the optimizer ``configure_optimizers`` returned. Lightning's loop stays in charge: accumulation
enters ``block_backward_sync()`` on non-final micro-batches, clipping reaches the engine through the precision
plugin's gradient clipper (a global norm over every shard), and after each optimizer step the engine publishes
the updated rows to every replica.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.overrides.distributed import _sync_module_states
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.config import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    LossScalerConfig,
    NonFiniteAction,
    StartMethod,
    ZeroConfig,
)
from lightning_colossal.strategies.base import ColossalStrategy
from lightning_colossal.zero import ZeroEngine


class ZeroStrategy(ColossalStrategy):
    """ZeRO stage 1 or 2 over the data-parallel ranks, optionally with the optimizer on the CPU.

    Registered as ``colossal_zero1``, ``colossal_zero2``, ``colossal_zero1_offload``, ``colossal_zero2_offload``
    (each also ``*_notebook``).

    Args:
        stage: 1 shards fp32 masters and optimizer state; 2 also shards gradients.
        cpu_offload: keep masters, gradient shards and optimizer state in CPU memory and step the optimizer there.
        bucket_size_mb: gradient bucket size in MiB.
        overlap_communication: reduce buckets from gradient hooks while backward runs.
        stage2_accumulation: ``"sharded"`` (reduce every micro-batch, keep stage-2 memory; default) or
            ``"local"`` (accumulate full gradients, reduce once per step).
        communication: ``"auto"`` (per backend), ``"all_reduce"`` or ``"scatter_gather"``; results are identical.
    """

    def __init__(
        self,
        stage: Literal[1, 2] = 1,
        cpu_offload: bool = False,
        bucket_size_mb: float = 25.0,
        overlap_communication: bool = True,
        stage2_accumulation: Literal["sharded", "local"] = "sharded",
        communication: Literal["auto", "all_reduce", "scatter_gather"] = "auto",
        process_group_backend: str | None = None,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
        start_method: StartMethod = "popen",
        loss_scaler: LossScalerConfig | None = None,
        heartbeat_timeout: timedelta | None = DEFAULT_HEARTBEAT_TIMEOUT,
        on_nonfinite: NonFiniteAction | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            loss_scaler=loss_scaler,
            heartbeat_timeout=heartbeat_timeout,
            on_nonfinite=on_nonfinite,
        )
        self.zero_config = ZeroConfig(
            stage=stage,
            cpu_offload=cpu_offload,
            bucket_size_mb=bucket_size_mb,
            overlap_communication=overlap_communication,
            stage2_accumulation=stage2_accumulation,
            communication=communication,
        )
        self.engine: ZeroEngine | None = None

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [
            ("colossal_zero1", {"stage": 1, "cpu_offload": False}),
            ("colossal_zero2", {"stage": 2, "cpu_offload": False}),
            ("colossal_zero1_offload", {"stage": 1, "cpu_offload": True}),
            ("colossal_zero2_offload", {"stage": 2, "cpu_offload": True}),
        ]

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._prepare_module(trainer)
        assert self.model is not None and self.lightning_module is not None
        if self.engine is not None:
            self.engine.remove()
            self.engine = None
        if fitting:
            optimizer = self._setup_single_optimizer(
                trainer,
                manual_reason="the engine owns when gradients are reduced and parameters re-synchronised",
                manual_alternatives="`colossal_ddp` / `colossal_fsdp`",
            )
            self.engine = ZeroEngine(
                self.model,
                optimizer,
                self.zero_config,
                self.device_mesh["dp"],
                self.root_device,
            )
        else:
            _sync_module_states(self.model)
            self._drop_optimizers_of_earlier_fit()
        self.setup_precision_plugin()
        if self.engine is not None:
            self.precision_plugin.gradient_clipper = self.engine

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        if self.engine is None:
            yield
            return
        with self.engine.no_sync():
            yield

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.engine is not None:
            self.engine.after_step(stepped=not self.precision_plugin.last_step_skipped)
        return output

    def teardown(self) -> None:
        if self.engine is not None:
            self.engine.remove()
        super().teardown()

    # ---------------------------------------------------------------------------------------------- checkpoints
    def _masters_are_more_precise(self) -> bool:
        engine = self.engine
        return engine is not None and any(member.parameter.dtype != torch.float32 for member in engine.members)

    def model_state_for_checkpoint(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        state = self.lightning_module.state_dict()
        if self._masters_are_more_precise():
            assert self.engine is not None
            # Save the fp32 masters rather than their low-precision copies (ColossalAI saves only the latter).
            state.update(self.engine.masters_by_name())
        return state

    def _on_model_state_loaded(self) -> None:
        if self.engine is None:
            return
        if self._masters_are_more_precise():
            self.engine.masters_to_parameters()
        else:
            self.engine.parameters_to_masters()

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.lightning_module is not None
        self.lightning_module.load_state_dict(state_dict, strict=strict)
        if self.engine is None:
            return
        # The file may hold fp32 weights: masters take them unrounded, not the (possibly bf16) parameters.
        self.engine.parameters_to_masters(full_weights=state_dict)

    def optimizer_names_and_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_names_and_state(optimizer)
        return self.engine.optimizer_state_by_name()

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        assert self.engine is not None
        self.engine.load_optimizer_state_by_name(state)
