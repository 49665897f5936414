"""Large host buffers kept for reuse between a step's gathers and reductions (no Lightning, no engine here).

[Note: reusing large host buffers]
On a CPU compute device every gathered chunk, full gradient and staging buffer of a step is a fresh allocation. glibc
serves allocations above its mmap threshold (at most 32 MiB on 64-bit systems) with new mappings, so each is
page-faulted in on its first write and unmapped when freed: measured on the benchmark GPT (2 chunks of 55 MB), about
25 ms per buffer whether it is zeroed or only copied into (``torch.zeros`` 25.8 ms, ``torch.empty`` + a full copy
29.3 ms, the same copy into a kept buffer 5.5 ms), and about 0.3 s of a 1.45 s Gemini step
(``benchmarks/RESULTS.md``, "Where a step's time goes"). FSDP2's per-block buffers are small enough for the heap, which
reuses them. CUDA's caching allocator already keeps its blocks, so the pool serves host buffers only.

A buffer given back may still be in use: autograd keeps views of a gathered chunk's weights for backward after the
engine released the chunk, and a collective in flight holds its tensors. So the pool never reuses a buffer whose
storage anyone else still holds: ``take`` checks the storage's use count (torch's ``_storage_Use_Count``: only the
pool's own reference left) and skips buffers still held, which become reusable once their holders let go. Without
that torch function the pool allocates every time.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor

#: Buffers below this size come from the heap, which reuses freed memory already (glibc's smallest mmap threshold).
SMALLEST_POOLED_BYTES = 128 * 1024
#: Buffers kept per size and dtype: a step's gathers, full gradients and staging of one chunk size.
KEPT_PER_SIZE = 4

_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _held_only_by_the_pool(buffer: Tensor) -> bool:
    # The pool's tensor and the temporary storage object of this call: 2 references when nothing else holds it. A
    # view elsewhere adds its own reference (and keeps ``buffer``, its base, alive as well), so any view still in use
    # counts.
    assert _use_count is not None
    return _use_count(buffer.untyped_storage()._cdata) <= 2


def held_elsewhere(buffer: Tensor) -> bool:
    """Whether anything besides the tensor ``buffer`` holds its storage (views autograd saved, a collective in
    flight); ``False`` where torch cannot say."""
    return _use_count is not None and not _held_only_by_the_pool(buffer)


class BufferPool:
    """Flat host buffers by (elements, dtype), handed out again once nothing but the pool holds them."""

    def __init__(self, kept_per_size: int = KEPT_PER_SIZE) -> None:
        self.kept_per_size = kept_per_size
        self._kept: dict[tuple[int, torch.dtype], list[Tensor]] = defaultdict(list)
        #: Buffers handed out again, and made new (for tests and the benchmarks' breakdowns).
        self.reused = 0
        self.allocated = 0

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, zeroed: bool) -> Tensor:
        """A flat buffer of ``numel`` elements; all zeros with ``zeroed``, else of undefined values."""
        if self._pools(numel, dtype, device):
            kept = self._kept[(numel, dtype)]
            for index, buffer in enumerate(kept):
                if _held_only_by_the_pool(buffer):
                    del kept[index]
                    self.reused += 1
                    return buffer.zero_() if zeroed else buffer
        self.allocated += 1
        return (torch.zeros if zeroed else torch.empty)(numel, dtype=dtype, device=device)

    def give_back(self, buffer: Tensor | None) -> None:
        """Keep ``buffer`` (a whole flat buffer ``take`` returned) for a later ``take``; it may still be in use."""
        if buffer is None or not self._pools(buffer.numel(), buffer.dtype, buffer.device):
            return
        while buffer._base is not None:  # the flat buffer ``take`` made, whatever view of it its user gives back
            buffer = buffer._base
        kept = self._kept[(buffer.numel(), buffer.dtype)]
        if any(buffer.data_ptr() == other.data_ptr() for other in kept):
            return
        if len(kept) >= self.kept_per_size:
            # Make room from buffers still held elsewhere: they cost nothing to drop (their holders free them).
            still_held = [index for index, other in enumerate(kept) if not _held_only_by_the_pool(other)]
            if not still_held:
                return
            del kept[still_held[0]]
        kept.append(buffer)

    def clear(self) -> None:
        """Drop every kept buffer (the end of a run: their memory goes back to the system)."""
        self._kept.clear()

    @staticmethod
    def _pools(numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return _use_count is not None and device.type == "cpu" and numel * dtype.itemsize >= SMALLEST_POOLED_BYTES
