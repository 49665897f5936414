"""Every call into a compute device's runtime (``torch.cuda`` and its kin) goes through this module.

The engines run where the compute device and host memory are one (CPU, gloo) and where they are two (a GPU beside
host RAM, NCCL). Code that only runs in the second case is code the CPU suite never runs, so it is kept here, small,
behind functions that take the device they act on and do nothing for the CPU. ``tests/unit/test_layering.py``
forbids ``torch.cuda``, ``pin_memory=`` and ``non_blocking=`` everywhere else.

The runtime is looked up through ``torch.get_device_module(device.type)``, so an XPU, NPU or MPS device needs no
new code here, and a test can swap the whole runtime for a stand-in (``substituted``): the fake-GPU tier
(``tests/fake_cluster/``) runs the engines on fake CUDA tensors with a runtime that answers without a GPU.

[Note: copies between host and device]
A copy from device to host with ``non_blocking=True`` returns at once with a pinned buffer the device fills later; a
host read of it before the copy lands reads garbage (nothing on the host waits for the device's stream). Every
device-to-host copy therefore goes through ``to_host`` or ``copy_all``, which wait for the copy before returning, or
through ``start_copy_to_host``, whose caller waits once for several copies with ``synchronize`` before reading any
(Gemini's offloaded gradients: gemini/manager.py [Note: reduced gradients drained to the host once]). Host-to-device
copies (``to_device``) stay asynchronous: the device reads them on the stream that issued them, in order. The one
rule for their sources: the host must not write a pinned source again before the device's stream has passed the
copy; the engines' sources (masters, shards) are rewritten only by the next optimizer step, after the host has
waited for that step's gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor


def is_accelerator(device: torch.device) -> bool:
    """Whether ``device`` is a compute device beside host memory (a GPU), not the host itself or ``meta``."""
    return device.type not in ("cpu", "meta")


class TorchRuntime:
    """The real runtime: ``torch.get_device_module`` of the device's type."""

    def available(self) -> bool:
        return torch.accelerator.is_available()

    def accelerator_type(self) -> str | None:
        current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        return None if current is None else current.type

    def device_count(self, device_type: str) -> int:
        module = torch.get_device_module(device_type)
        return module.device_count() if module.is_available() else 0

    def current_device(self, device_type: str) -> torch.device:
        return torch.device(device_type, torch.get_device_module(device_type).current_device())

    def synchronize(self, device: torch.device) -> None:
        torch.get_device_module(device.type).synchronize(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return int(torch.get_device_module(device.type).max_memory_allocated(device))

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.get_device_module(device.type).reset_peak_memory_stats(device)

    def memory_allocated(self, device: torch.device) -> int:
        return int(torch.get_device_module(device.type).memory_allocated(device))

    def total_memory(self, device: torch.device) -> int:
        return int(torch.get_device_module(device.type).get_device_properties(device).total_memory)

    def get_rng_state(self, device: torch.device) -> Tensor:
        return torch.get_device_module(device.type).get_rng_state(device)

    def set_rng_state(self, state: Tensor, device: torch.device) -> None:
        torch.get_device_module(device.type).set_rng_state(state, device)

    def can_pin(self) -> bool:
        return torch.accelerator.is_available()


_runtime: Any = TorchRuntime()


@contextmanager
def substituted(runtime: Any) -> Iterator[None]:
    """Inside: every function here asks ``runtime`` instead of torch (tests: a device without the hardware)."""
    global _runtime
    previous, _runtime = _runtime, runtime
    try:
        yield
    finally:
        _runtime = previous


def accelerator_available() -> bool:
    """Whether this process can use a compute device other than the host."""
    return bool(_runtime.available())


def accelerator_type() -> str | None:
    """The type of this machine's compute device (``"cuda"``, ``"xpu"``, ...), ``None`` when there is none."""
    return _runtime.accelerator_type()


def device_count(device_type: str) -> int:
    """How many devices of ``device_type`` this process sees (0 for ``cpu``)."""
    return 0 if device_type in ("cpu", "meta") else int(_runtime.device_count(device_type))


def current_device(device_type: str) -> torch.device:
    """This process's current device of ``device_type`` (the host for ``cpu``)."""
    return torch.device("cpu") if device_type == "cpu" else _runtime.current_device(device_type)


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has finished the work queued so far (nothing to wait for on the host)."""
    if is_accelerator(device):
        _runtime.synchronize(device)


def max_memory_allocated(device: torch.device) -> int | None:
    """The allocator's peak bytes on ``device`` since the last reset; ``None`` on the host (no allocator to ask)."""
    return int(_runtime.max_memory_allocated(device)) if is_accelerator(device) else None


def reset_peak_memory_stats(device: torch.device) -> None:
    if is_accelerator(device):
        _runtime.reset_peak_memory_stats(device)


def memory_allocated(device: torch.device) -> int | None:
    """Bytes the allocator holds for tensors on ``device`` now; ``None`` on the host."""
    return int(_runtime.memory_allocated(device)) if is_accelerator(device) else None


def total_memory(device: torch.device) -> int | None:
    """The capacity of ``device`` in bytes; ``None`` on the host (bounded by the machine, not a device)."""
    return int(_runtime.total_memory(device)) if is_accelerator(device) else None


def get_rng_state(device: torch.device) -> Tensor | None:
    """The random state of ``device``'s generator (a host tensor); ``None`` for the host, whose state is
    ``torch.get_rng_state()``."""
    return _runtime.get_rng_state(device) if is_accelerator(device) else None


def set_rng_state(state: Tensor, device: torch.device) -> None:
    _runtime.set_rng_state(state.cpu(), device)


def host_buffer(numel: int, dtype: torch.dtype, beside: torch.device, zeroed: bool = False) -> Tensor:
    """A flat host tensor that exchanges with ``beside``: pinned when that is a compute device (asynchronous copies
    need page-locked memory), plain otherwise."""
    pin = is_accelerator(beside) and bool(_runtime.can_pin())
    factory = torch.zeros if zeroed else torch.empty
    return factory(numel, dtype=dtype, device="cpu", pin_memory=pin)


def to_host(tensor: Tensor) -> Tensor:
    """``tensor`` on the host, ready to be read there ([Note: copies between host and device]); ``tensor`` itself when
    it is already there."""
    if not is_accelerator(tensor.device):
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=bool(_runtime.can_pin()))
    copy_all([(out, tensor)])
    return out


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``, copied asynchronously when it comes from the host (the device reads it in stream
    order; [Note: copies between host and device] says what the host must not do meanwhile)."""
    return tensor.to(device, non_blocking=is_accelerator(device))


def copy_all(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """``target.copy_(source)`` for every pair, all started before one wait for those that come to the host."""
    towards_host = set()
    for target, source in pairs:
        if is_accelerator(source.device) and not is_accelerator(target.device):
            towards_host.add(source.device)
            target.copy_(source, non_blocking=True)
        else:
            target.copy_(source, non_blocking=is_accelerator(target.device))
    for source_device in towards_host:
        synchronize(source_device)


def start_copy_to_host(target: Tensor, source: Tensor) -> None:
    """Start ``target.copy_(source)`` from the device into a host buffer without waiting: the caller must
    ``synchronize(source.device)`` before the host reads ``target`` ([Note: copies between host and device])."""
    target.copy_(source, non_blocking=is_accelerator(source.device))


def copy_into(target: Tensor, source: Tensor) -> None:
    """``target.copy_(source)`` across devices: asynchronous towards a device, waited for towards the host."""
    copy_all([(target, source)])
