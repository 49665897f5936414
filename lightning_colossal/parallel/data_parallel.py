"""The data-parallel part of the hybrid engine without ZeRO (``zero_stage=0``): gradient averaging.

Gradients are averaged once per optimizer step, after the last backward of an accumulation window, in flat
buckets of one dtype (one all-reduce per bucket instead of one per parameter). It runs after backward rather than
overlapping it: pipeline schedules produce gradients micro-batch by micro-batch, and the step is where every
gradient is final in every mode.

``GradientAverager`` offers the hybrid engine the same methods as ``ZeroEngine`` (the part with ZeRO), so the engine
holds one data-parallel part of either kind; the ones that concern masters do nothing here, since the optimizer
steps the parameters themselves.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_colossal.config import GradientAveraging, bucket_numel
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts.staging import copy_out_of_flat
from lightning_colossal.parallel.checkpoint_view import CheckpointView
from lightning_colossal.parallel.tensor_parallel import local_view
from lightning_colossal.zero import ReducedGradient


class GradientAverager:
    """Averages the ``.grad`` of ``optimizer``'s parameters over ``group`` in buckets of ``config.bucket_size_mb``.

    Args:
        optimizer: the user's optimizer; it steps the (averaged) parameters themselves.
        group: the data-parallel (dp x sp) ranks, or ``None`` for one rank.
        config: the averaging settings.
        checkpoint_view: how the optimizer's state is described in checkpoints.
        excluded: ids of parameters reduced elsewhere (expert slices, over their own group: ``experts.py``).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        group: ProcessGroup | None,
        config: GradientAveraging,
        checkpoint_view: CheckpointView,
        excluded: frozenset[int] = frozenset(),
    ) -> None:
        self.optimizer = optimizer
        #: Every parameter the optimizer steps; ``parameters`` are those averaged here.
        self.all_parameters: list[nn.Parameter] = [
            parameter for group_of_parameters in optimizer.param_groups for parameter in group_of_parameters["params"]
        ]
        self.parameters = [parameter for parameter in self.all_parameters if id(parameter) not in excluded]
        self.group = group
        self.bucket_numel = bucket_numel(config.bucket_size_mb)
        self.checkpoint_view = checkpoint_view

    # ---------------------------------------------------------------------------------------------- step
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Nothing to hold back: gradients are averaged only when ``after_backward`` asks."""
        yield

    def after_backward(self, reduction_deferred: bool) -> None:
        """Average every gradient now (whether or not backward ran inside ``no_sync``: it never reduces there)."""
        self.average()

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """A plain step: the state is whole in memory."""
        return optimizer.step(**kwargs)

    def close_disk_tier(self) -> None:
        """No state on disk."""

    def release_checkpoint_copies(self) -> None:
        """No state on disk."""

    def after_step(self, stepped: bool) -> None:
        """Nothing to publish: every rank stepped the same averaged gradients."""

    def remove(self) -> None:
        """No hooks to remove."""

    def average(self) -> None:
        if self.group is None:
            return
        for parameter in self.parameters:
            if parameter.grad is None:
                # Unused on this rank: join the sum with zeros so every rank sends the same buckets.
                parameter.grad = torch.zeros_like(parameter)
        for bucket in self._buckets():
            flat = torch.cat([gradient.reshape(-1) for gradient in bucket])
            with Activity("averaging data-parallel gradients"):
                collectives.all_reduce(flat, op="mean", group=self.group)
            copy_out_of_flat(flat, bucket)

    def _buckets(self) -> list[list[Tensor]]:
        buckets: list[list[Tensor]] = []
        by_dtype: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for parameter in self.parameters:
            assert parameter.grad is not None
            # DTensor parameters (the user's own tensor parallelism): average each rank's piece.
            gradient = local_view(parameter.grad)
            key = (gradient.dtype, gradient.device)
            current = by_dtype.setdefault(key, [])
            if current and sizes[key] + gradient.numel() > self.bucket_numel:
                buckets.append(current)
                current = by_dtype[key] = []
                sizes[key] = 0
            current.append(gradient)
            sizes[key] = sizes.get(key, 0) + gradient.numel()
        buckets.extend(bucket for bucket in by_dtype.values() if bucket)
        return buckets

    # ---------------------------------------------------------------------------------------------- clipping
    def reduced_gradients(self) -> list[ReducedGradient]:
        """Every averaged gradient (this rank's piece of a DTensor one), the same on every rank of the group."""
        return [
            ReducedGradient(parameter, local_view(parameter.grad), replicated=True)
            for parameter in self.parameters
            if parameter.grad is not None
        ]

    # ---------------------------------------------------------------------------------------------- checkpoints
    def with_precise_masters(self, model_state: dict[str, Any]) -> dict[str, Any]:
        """``model_state`` unchanged: the parameters are the only copy of the weights."""
        return model_state

    def resync_after_model_state_loaded(self) -> None:
        """No second copy of the weights to refresh."""

    def parameters_to_masters(self) -> None:
        """No masters to refresh from the parameters."""

    def optimizer_state_by_name(self) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, tensor-parallel pieces as DTensors."""
        return self.checkpoint_view.describe_optimizer_state(self.optimizer)

    def load_optimizer_state_by_name(self, loaded: dict[str, Any]) -> None:
        """Load a name-keyed state cut to this rank's pieces (``CheckpointView.local_optimizer_state``)."""
        self.checkpoint_view.load_plain_optimizer_state(self.optimizer, loaded)
