"""``colossal_gemini`` / ``colossal_gemini_auto`` / ``colossal_gemini_offload``: the Gemini engine as a strategy.

The model is not wrapped: ``lightning_colossal.gemini.GeminiEngine`` moves the trainable parameters into chunks,
hooks the modules that own them, and takes over the parameter lists of the optimizer ``configure_optimizers``
returned. Lightning's loop stays in charge; this adapter tells the engine when an optimizer step happened, hands
it the precision plugin's clipping, and maps checkpoints onto the engine's name-keyed shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import ClusterEnvironment
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.config import (
    DEFAULT_COLLECTIVE_TIMEOUT,
    DEFAULT_HEARTBEAT_TIMEOUT,
    AutoPlacement,
    GeminiConfig,
    LossScalerConfig,
    NonFiniteAction,
    StartMethod,
    StaticPlacement,
)
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.strategies.base import ColossalStrategy
from lightning_colossal.strategies.model_summary import count_whole_parameters_in_model_summary


class GeminiStrategy(ColossalStrategy):
    """ZeRO-3 over the data-parallel ranks with parameters, gradients and optimizer state in chunks.

    Registered as ``colossal_gemini`` (static placement, all on the compute device), ``colossal_gemini_auto``
    (automatic placement) and ``colossal_gemini_offload`` (static, fp32 masters and optimizer state in CPU memory),
    each also ``*_notebook``.

    Args:
        placement: ``StaticPlacement(...)`` or ``AutoPlacement(...)``; default ``StaticPlacement()``.
        chunk_numel: elements per chunk; ``None`` searches the size wasting the least chunk space.
        min_chunk_numel: smallest chunk size the chunk-size search tries.
        search_range_numel: the search tries sizes in ``[start, start + search_range_numel]``.
        search_step_numel: step between the sizes the search tries.
        max_prefetch: chunks gathered ahead of use, asynchronously.
        communication: ``"auto"``, ``"all_reduce"`` or ``"scatter_gather"`` (identical results).
        init_window_bytes: bytes one initialisation pass materialises when the model is built on the meta device
            (``Trainer.init_module(empty_init=True)`` or ``configure_model``).
    """

    materialises_meta_models = True  # meta models are initialised into chunk shards (gemini/initialise.py)

    def __init__(
        self,
        placement: StaticPlacement | AutoPlacement | None = None,
        chunk_numel: int | None = None,
        min_chunk_numel: int = 2**20,
        search_range_numel: int = 2**24,
        search_step_numel: int = 2**16,
        max_prefetch: int = 0,
        communication: Literal["auto", "all_reduce", "scatter_gather"] = "auto",
        init_window_bytes: int = 2**30,
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
        self.gemini_config = GeminiConfig(
            placement=placement if placement is not None else StaticPlacement(),
            chunk_numel=chunk_numel,
            min_chunk_numel=min_chunk_numel,
            search_range_numel=search_range_numel,
            search_step_numel=search_step_numel,
            max_prefetch=max_prefetch,
            communication=communication,
            init_window_bytes=init_window_bytes,
        )
        self.engine: GeminiEngine | None = None

    @classmethod
    def registry_entries(cls) -> Iterable[tuple[str, dict[str, Any]]]:
        return [
            ("colossal_gemini", {"placement": StaticPlacement()}),
            ("colossal_gemini_auto", {"placement": AutoPlacement()}),
            ("colossal_gemini_offload", {"placement": StaticPlacement(offload_optim_frac=1.0)}),
        ]

    # ---------------------------------------------------------------------------------------------- set-up
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = self._prepare_module(trainer)
        assert self.lightning_module is not None
        if self.engine is not None:
            self.engine.restore_full_parameters()  # a previous stage's chunks; this stage builds its own
            self.engine = None
        optimizer = None
        if fitting:
            optimizer = self._setup_single_optimizer(
                trainer,
                manual_reason="the engine owns when chunks are gathered, reduced and refreshed around the optimizer"
                " step",
                manual_alternatives="`colossal_ddp` / `colossal_fsdp`",
            )
        else:
            self._drop_optimizers_of_earlier_fit()
        self.engine = GeminiEngine(
            self.lightning_module,
            optimizer,
            self.gemini_config,
            self.device_mesh["dp"],
            self.root_device,
            timeout=self._timeout,
        )
        self.setup_precision_plugin()
        self.precision_plugin.gradient_clipper = self.engine
        # Chunked parameters are empty placeholders between gathers; Lightning's summary would count them as 0.
        count_whole_parameters_in_model_summary(trainer, self.engine.whole_numel)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None:
            return super().training_step(*args, **kwargs)
        with self.engine.step_context():
            output = super().training_step(*args, **kwargs)
        # Ranks may have run different modules (experts without tokens): serve the gathers others still need.
        self.engine.finish_phase()
        return output

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().validation_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.finish_phase()
        return output

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().test_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.finish_phase()
        return output

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = super().predict_step(*args, **kwargs)
        if self.engine is not None:
            self.engine.finish_phase()
        return output

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        if self.engine is not None:
            self.engine.prepare_backward(closure_loss)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

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
        # Parameters get their whole values back (as after any Lightning run), then the base moves them to the CPU.
        # The engine stays: `trainer.save_checkpoint` after `fit` still reads its shards and optimizer state.
        # Not after a failed run: gathering is a collective that other ranks may never reach.
        if self.engine is not None and self._failure_being_torn_down() is None:
            self.engine.restore_full_parameters()
        super().teardown()

    # ---------------------------------------------------------------------------------------------- checkpoints
    def model_state_for_checkpoint(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        if self.engine is None:
            return self.lightning_module.state_dict()
        # fp32 master rows of every chunked parameter (never rounded weights) plus buffers and frozen parameters.
        state = self.engine.state_by_name()
        for name, value in self.lightning_module.state_dict().items():
            state.setdefault(name, value)
        return state

    def _on_model_state_loaded(self) -> None:
        if self.engine is not None:
            self.engine.masters_loaded()

    def _load_full_model_state(self, state_dict: Mapping[str, Tensor], strict: bool) -> None:
        assert self.lightning_module is not None
        if self.engine is None:
            self.lightning_module.load_state_dict(state_dict, strict=strict)
            return
        expected = set(self.lightning_module.state_dict())
        missing, unexpected = sorted(expected - set(state_dict)), sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"The checkpoint does not match the model: missing {missing[:10]}, unexpected {unexpected[:10]}."
                " Fix the model or load with `strict_loading = False` on the LightningModule."
            )
        self.engine.load_full_weights(state_dict)
        chunked = set(self.engine.state_by_name())
        rest = {name: value for name, value in state_dict.items() if name not in chunked}
        self.lightning_module.load_state_dict(rest, strict=False)

    def optimizer_names_and_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if self.engine is None:
            return super().optimizer_names_and_state(optimizer)
        return self.engine.optimizer_state_by_name()

    def _load_optimizer_state(self, optimizer: Optimizer, state: dict[str, Any]) -> None:
        assert self.engine is not None
        self.engine.load_optimizer_state_by_name(state)

    def full_model_state_dict(self) -> dict[str, Tensor]:
        if self.engine is None:
            return super().full_model_state_dict()
        return self.engine.full_state_dict()
