"""Non-model memory per module, traced during a warm-up step (what automatic placement plans against).

[Note: measuring non-model memory]
On CUDA the allocator knows: non-model memory before a module = allocated bytes minus the model data the chunk
manager accounts for on the device. On the CPU there is no device allocator to ask, so the tracer counts what
dominates non-model memory in training, the activations autograd saves for backward (a ``saved_tensors_hooks`` pack
hook adds their bytes, parameters excluded). A parameter is recognised by its storage at the moment it is saved: a
chunk's parameters point into the gathered buffer only while the chunk is gathered, so pointers taken before the
forward (empty placeholders then) would miss every gathered weight autograd saves and charge each as an activation,
about 4 bytes per parameter of fp32 weights in the trace. Backward frees activations in reverse order, so a module's backward is
charged what was saved when its forward ended. The trace is the sequence of modules and their chunks; it repeats every
step, which is what lets eviction look into the future.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_colossal.distributed import device as devices


@dataclass(frozen=True)
class TracedOp:
    """One module's forward or backward in the warm-up step."""

    key: tuple[str, int]  # ("forward" | "backward", module id within the engine)
    chunks: frozenset[int]
    non_model_bytes: int


class MemoryTracer:
    """Records the op sequence of the first step and the non-model bytes before each op."""

    def __init__(self, compute_device: torch.device, model_bytes_on_device: Callable[[], int]) -> None:
        self.compute_device = compute_device
        self.model_bytes_on_device = model_bytes_on_device
        self.ops: list[TracedOp] = []
        self.finished = False
        self._saved_bytes = 0
        self._saved_at_forward_end: dict[int, int] = {}
        self._model_storages: Callable[[], set[int]] = set
        self.position = -1

    # ---------------------------------------------------------------------------------------------- warm-up
    def saving_context(self, model_storages: Callable[[], set[int]]) -> AbstractContextManager[None]:
        """Wrap the forward of the warm-up step (CPU: counts saved activations; CUDA: nothing to wrap).

        ``model_storages`` returns the storage addresses holding model data at the moment it is called (gathered
        chunk buffers, parameters kept outside chunks); a saved tensor in one of them is a weight, not an activation.
        """
        if self.finished or self.compute_device.type == "cuda":
            return nullcontext()
        self._model_storages = model_storages

        def pack(tensor: Tensor) -> Tensor:
            if tensor.untyped_storage().data_ptr() not in self._model_storages():
                self._saved_bytes += tensor.numel() * tensor.element_size()
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def non_model_bytes_now(self, phase: str, module_id: int) -> int:
        peak = devices.max_memory_allocated(self.compute_device)
        if peak is not None:
            devices.reset_peak_memory_stats(self.compute_device)
            return max(peak - self.model_bytes_on_device(), 0)
        if phase == "backward":
            return self._saved_at_forward_end.get(module_id, self._saved_bytes)
        return self._saved_bytes

    def record(self, phase: str, module_id: int, chunks: frozenset[int]) -> None:
        if self.finished:
            return
        self.ops.append(TracedOp((phase, module_id), chunks, self.non_model_bytes_now(phase, module_id)))

    def forward_ended(self, module_id: int) -> None:
        if not self.finished:
            self._saved_at_forward_end[module_id] = self._saved_bytes

    def finish(self) -> None:
        """End of the warm-up step: from now on the trace is replayed."""
        if self.finished or not self.ops:
            return
        self.finished = True
        self.position = -1

    # ---------------------------------------------------------------------------------------------- replay
    def advance(self, phase: str, module_id: int) -> int:
        """Move the replay cursor to this op (searching forward, wrapping) and return its position."""
        key = (phase, module_id)
        length = len(self.ops)
        for step in range(1, length + 1):
            candidate = (self.position + step) % length
            if self.ops[candidate].key == key:
                self.position = candidate
                return candidate
        return self.position  # an op the warm-up never saw: keep the cursor where it is

    @property
    def sequence(self) -> list[frozenset[int]]:
        return [op.chunks for op in self.ops]

    def expected_non_model_bytes(self, position: int) -> int:
        if not self.ops:
            return 0
        return self.ops[position % len(self.ops)].non_model_bytes

    @property
    def peak_non_model_bytes(self) -> int:
        return max((op.non_model_bytes for op in self.ops), default=0)
