"""Byte accounting of model state: what one rank holds for parameters, gradients and optimizer state.

Pure torch, no Lightning: ``MemoryMonitor`` and the benchmark harness (``benchmarks/measure.py``) share it.

[Note: counting bytes of real tensors]
A tensor's bytes are the bytes of its storage that it covers. Tensors that share a storage (a tied weight seen
twice, parameters that are views into one flat ZeRO buffer, gradients that alias DDP's buckets) are counted by
the union of the byte ranges they cover, so a weight shared by two modules counts once and a flat buffer counts
its covered part, never its unused padding twice. A non-contiguous view is taken to cover the span from its first
to its last element, an upper bound that is exact for transposes. DTensors (FSDP2, tensor parallel) are counted
by their local shard, which is what this rank holds.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = [
    "covered_bytes",
    "gemini_model_state_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
    "parameter_bytes",
    "process_rss_bytes",
    "zero_model_state_bytes",
]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this rank holds: a DTensor's local shard, otherwise the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    if callable(to_local) and type(tensor).__name__ == "DTensor":
        return to_local()
    return tensor


def covered_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of storage covered by ``tensors``, each shared byte counted once (see the module Note).

    Raises:
        ValueError: a tensor lives on the meta device, so it has no bytes to count.
    """
    ranges_by_storage: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta":
            raise ValueError("Cannot count the bytes of a meta tensor; measure after the model is materialised.")
        if local.numel() == 0:
            continue
        element_size = local.element_size()
        span_elements = 1 + sum(
            int(size - 1) * abs(int(stride)) for size, stride in zip(local.shape, local.stride(), strict=True)
        )
        start = int(local.storage_offset()) * element_size
        storage_key = (str(local.device), local.untyped_storage().data_ptr())
        ranges_by_storage.setdefault(storage_key, []).append((start, start + span_elements * element_size))
    total = 0
    for ranges in ranges_by_storage.values():
        ranges.sort()
        current_start, current_end = ranges[0]
        for start, end in ranges[1:]:
            if start > current_end:
                total += current_end - current_start
                current_start, current_end = start, end
            else:
                current_end = max(current_end, end)
        total += current_end - current_start
    return total


def parameter_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the parameters this rank holds; tied or aliased parameters count once."""
    return covered_bytes(parameters)


def gradient_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of the ``.grad`` tensors present on ``parameters`` now; parameters without a gradient add nothing."""
    return covered_bytes(parameter.grad for parameter in parameters if parameter.grad is not None)


def _tensors_in(value: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside a (nested) optimizer-state value."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors_in(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors_in(item)


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> tuple[int, dict[str, int]]:
    """Bytes of every tensor in the optimizers' ``state``, in total and per state key (``exp_avg``, ``step``, ...).

    The total de-duplicates shared storage across all keys; the per-key figures de-duplicate within a key.
    """
    tensors_by_key: dict[str, list[torch.Tensor]] = {}
    for optimizer in optimizers:
        for parameter_state in optimizer.state.values():
            for key, value in parameter_state.items():
                tensors_by_key.setdefault(str(key), []).extend(_tensors_in(value))
    by_key = {key: covered_bytes(tensors) for key, tensors in sorted(tensors_by_key.items())}
    total = covered_bytes(tensor for tensors in tensors_by_key.values() for tensor in tensors)
    return total, by_key


def gemini_model_state_bytes(memory_report: Mapping[str, Any]) -> dict[str, int]:
    """Per-rank model-state bytes of a Gemini rank, from its engine's ``memory_report()`` as a JSON-able mapping.

    The engine detaches its parameters from their values: between uses a parameter is an empty placeholder and its
    rows live in the chunk shards, so walking ``module.parameters()`` would find no bytes. The report counts the
    real chunk tensors instead. Its categories map onto the formula's as follows:

    - parameters: the working shards, the fp32 masters when they are separate tensors (they alias an fp32 shard on
      the same device, and then count 0; frozen chunks are shards only), and the parameters kept whole outside
      chunks (``replicated_bytes``);
    - gradients: the fp32 shard gradients (kept allocated between steps);
    - optimizer state: every tensor of the optimizer's state on the masters (Adam's ``step`` scalars included).

    The gathered chunks and their full gradients are left out: they are working memory that exists only while
    modules run, like FSDP2's unsharded blocks, and no formula counts them (the harness reports their peak apart).

    Args:
        memory_report: ``{"chunks": {"shard", "master", "gradient", "optimizer_state", ...}, "replicated_bytes",
            ...}`` (``GeminiMemoryReport`` with its ``ChunkBytes`` as dicts).
    """
    chunks = memory_report["chunks"]
    return {
        "parameters": chunks["shard"] + chunks["master"] + memory_report["replicated_bytes"],
        "gradients": chunks["gradient"],
        "optimizer_state": chunks["optimizer_state"],
    }


def zero_model_state_bytes(memory_report: Mapping[str, Any]) -> dict[str, int]:
    """Per-rank model-state bytes of a ZeRO rank, from its engine's ``memory_report()`` as a mapping.

    - parameters: the working parameters (whole on every rank) plus the separate fp32 master shard when there is one
      (offloaded or low-precision parameters; fp32 parameters on the compute device are their own masters);
    - gradients: the persistent gradient buffers (stage 1: full size; stage 2: this rank's rows) and, when offloaded,
      the fp32 gradient shard next to the masters;
    - optimizer state: every tensor of the optimizer's state on the masters (Adam's ``step`` scalars included).

    The reusable communication buckets (``bucket_bytes``) are working memory and left out, as in the formulas.
    """
    return {
        "parameters": memory_report["parameter_bytes"] + memory_report["master_bytes"],
        "gradients": memory_report["gradient_bytes"],
        "optimizer_state": memory_report["optimizer_state_bytes"],
    }


def process_rss_bytes() -> int | None:
    """Resident set size of this process: psutil when installed, else ``/proc/self/statm``; ``None`` if neither."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.Process().memory_info().rss)
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
