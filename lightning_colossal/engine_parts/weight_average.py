"""A running average of a model's weights kept in the same pieces as the weights themselves (whole, row shards, chunk
shards, DTensor shards), with the arithmetic of torch's ``AveragedModel``.

[Note: the average lives where the weights live]
Lightning's ``WeightAveraging`` deep-copies the whole model before a strategy shards it and averages
``module.parameters()`` into that copy: under a sharding engine the parameters are empty placeholders or DTensor
shards, and even where they are whole (ZeRO) each rank would hold a whole fp32 copy. Here the average is a copy of
each rank's part of the state a checkpoint saves (``model_state_for_checkpoint``: ZeRO's and Gemini's fp32 master rows,
FSDP's DTensor shards, hybrid's pieces; buffers and parameters kept whole stay whole), so it takes about
4 bytes x parameters / ranks per rank where the masters are sharded, it is updated with no communication (each rank
averages its own part, an elementwise operation), and a checkpoint saves and reshards it like the weights. Putting it
into the model (validation, the end of training) writes it into those same live tensors and lets the engine re-sync
its other copies, exactly as a checkpoint load does (``write_into``); that costs one gather, not one per parameter.

The arithmetic follows ``torch.optim.swa_utils.AveragedModel.update_parameters``, so the result equals the callback
under one process bit for bit: the first update copies, later ones call the user's ``multi_avg_fn`` per device and
dtype, the default SWA average by torch's own rule (``_swa_update``), or the user's ``avg_fn`` per tensor
(``EMAWeightAveraging``); ``n_averaged`` stays a host tensor, so the default's ``1 / (n + 1)`` reads no device scalar.
Buffers are averaged with ``use_buffers`` and copied otherwise. Two names of one tensor (tied weights) are averaged
once, as ``module.parameters()`` yields a tied parameter once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def local_part(value: Tensor) -> Tensor:
    """The tensor this rank holds of ``value`` (its local shard for a DTensor), aliasing its storage."""
    return value.to_local() if isinstance(value, DTensor) else value


def _storage_key(tensor: Tensor) -> tuple[Any, ...] | None:
    """What identifies the memory ``tensor`` covers: two names of one tied weight give the same key."""
    if tensor.numel() == 0:
        return None
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


class ShardedWeightAverage:
    """This rank's part of a running average of the weights (see [Note: the average lives where the weights live]).

    Args:
        live_state: returns this rank's part of the weights by name (the tensors a checkpoint saves, aliasing the live
            ones); called at each update and each write.
        after_written: re-synchronises the engine's other copies after the tensors of ``live_state()`` were written
            in place (the strategy's after-load hook).
        buffer_names: which names are buffers (averaged only with ``use_buffers``, copied otherwise).
        use_buffers, avg_fn, multi_avg_fn: as ``AveragedModel`` takes them.
        device: where the average lives; by default where each weight's part lives.
    """

    def __init__(
        self,
        live_state: Callable[[], Mapping[str, Any]],
        after_written: Callable[[], None],
        buffer_names: Iterable[str],
        use_buffers: bool = True,
        avg_fn: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None,
        multi_avg_fn: Callable[[list[Tensor], list[Tensor], Tensor], None] | None = None,
        device: torch.device | None = None,
    ) -> None:
        if avg_fn is not None and multi_avg_fn is not None:
            raise ValueError("Pass only one of avg_fn and multi_avg_fn to the weight-averaging callback.")
        self._live_state = live_state
        self._after_written = after_written
        self._buffer_names = set(buffer_names)
        self.use_buffers = use_buffers
        self.avg_fn = avg_fn
        self.multi_avg_fn = multi_avg_fn
        self.n_averaged = torch.tensor(0, dtype=torch.long)
        self.state: dict[str, Tensor] = {}
        #: Names whose tensors are averaged (one name per tied weight), and those only copied (buffers without
        #: ``use_buffers``).
        self._averaged_names: list[str] = []
        self._copied_names: list[str] = []
        by_storage: dict[tuple[Any, ...], Tensor] = {}
        for name, value in live_state().items():
            if not isinstance(value, Tensor):
                continue
            key = _storage_key(local_part(value))
            if key is not None and key in by_storage:
                self.state[name] = by_storage[key]  # a tied weight: one average under both names
                continue
            copy = value.detach().clone() if device is None else _moved(value.detach(), device)
            self.state[name] = copy
            if key is not None:
                by_storage[key] = copy
            (self._copied_names if name in self._buffer_names and not use_buffers else self._averaged_names).append(
                name
            )

    # ---------------------------------------------------------------------------------------------- averaging
    def _pairs(self, names: list[str], live: Mapping[str, Any]) -> tuple[list[Tensor], list[Tensor]]:
        averages = [local_part(self.state[name]) for name in names]
        currents = [
            local_part(live[name].detach()).to(average.device) for name, average in zip(names, averages, strict=True)
        ]
        return averages, currents

    @torch.no_grad()
    def update_parameters(self, model: object = None) -> None:
        """Move the average towards the weights as they are now (``AveragedModel.update_parameters``, under its name:
        the callback calls it with the module, whose weights this reads through ``live_state`` instead)."""
        live = self._live_state()
        averages, currents = self._pairs(self._averaged_names, live)
        if int(self.n_averaged) == 0:
            for average, current in zip(averages, currents, strict=True):
                average.copy_(current)
        elif self.avg_fn is None or self.multi_avg_fn is not None:
            for group_averages, group_currents in _by_device_and_dtype(averages, currents):
                device = group_averages[0].device
                if self.multi_avg_fn is not None:
                    self.multi_avg_fn(group_averages, group_currents, self.n_averaged.to(device))
                else:
                    _swa_update(group_averages, group_currents, self.n_averaged)
        else:
            counts: dict[torch.device, Tensor] = {}  # one copy of the count per device, not one per tensor
            for average, current in zip(averages, currents, strict=True):
                count = counts.setdefault(average.device, self.n_averaged.to(average.device))
                average.copy_(self.avg_fn(average, current, count))
        copied, sources = self._pairs(self._copied_names, live)
        for target, source in zip(copied, sources, strict=True):
            target.copy_(source)
        self.n_averaged += 1

    # ---------------------------------------------------------------------------------------------- the model
    @torch.no_grad()
    def write_into_model(self) -> None:
        """Put the average into the model (the end of training)."""
        live = self._live_state()
        for name, average in self.state.items():
            local_part(live[name]).copy_(local_part(average))
        self._after_written()

    @torch.no_grad()
    def swap_with_model(self) -> None:
        """Exchange the average and the model's weights (around validation; twice restores both)."""
        live = self._live_state()
        swapped: set[int] = set()
        for name, average in self.state.items():
            if id(average) in swapped:
                continue  # a tied weight, swapped under its first name
            swapped.add(id(average))
            target, held = local_part(live[name]), local_part(average)
            kept = target.clone()
            target.copy_(held)
            held.copy_(kept)
        self._after_written()

    @torch.no_grad()
    def take_from_model(self) -> None:
        """Make the average equal to the model's weights (a checkpoint without an average was loaded)."""
        live = self._live_state()
        for name, average in self.state.items():
            local_part(average).copy_(local_part(live[name]))

    def state_for_checkpoint(self) -> dict[str, Tensor]:
        """The average by name, in the pieces and placements of the weights: a checkpoint saves and loads it in place."""
        return dict(self.state)


def _moved(value: Tensor, device: torch.device) -> Tensor:
    if isinstance(value, DTensor):
        return DTensor.from_local(
            value.to_local().to(device, copy=True),
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    return value.to(device, copy=True)


def _by_device_and_dtype(averages: list[Tensor], currents: list[Tensor]) -> list[tuple[list[Tensor], list[Tensor]]]:
    groups: dict[tuple[torch.device, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for average, current in zip(averages, currents, strict=True):
        group = groups.setdefault((average.device, average.dtype), ([], []))
        group[0].append(average)
        group[1].append(current)
    return list(groups.values())


def _swa_update(averages: list[Tensor], currents: list[Tensor], n_averaged: Tensor) -> None:
    """torch's default SWA update, by its own rule: ``_foreach_lerp_`` on devices with foreach kernels
    (``get_swa_multi_avg_fn``), ``average + (current - average) / (n + 1)`` per tensor elsewhere (``get_swa_avg_fn``;
    the CPU), with ``n_averaged`` read on the host. Integer buffers (BatchNorm's batch count) take the per-tensor
    form everywhere: torch's foreach form refuses them (integer ``addcdiv``)."""
    device = averages[0].device
    if device.type in _foreach_devices() and (torch.is_floating_point(averages[0]) or torch.is_complex(averages[0])):
        torch._foreach_lerp_(averages, currents, float(1 / (n_averaged + 1)))
        return
    count = (n_averaged + 1).to(device)
    for average, current in zip(averages, currents, strict=True):
        average.copy_(average + (current - average) / count)


def _foreach_devices() -> tuple[str, ...]:
    """The device types torch's ``AveragedModel`` averages with foreach kernels."""
    try:  # a private helper of torch, the list AveragedModel itself consults
        from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices
    except ImportError:
        return ("cuda", "xpu")
    return tuple(_get_foreach_kernels_supported_devices())
