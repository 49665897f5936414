"""Copies between whole parameters and the staging buffers their collectives use (no communication here).

Two layouts hold the rows of many parameters at once ([Note: sharding along dim 0] in ``rows``):

- *rank-major slots*: a ``[world_size, slot_numel]`` buffer where row ``r`` holds rank ``r``'s rows of every
  parameter, each parameter at the same ``slot_offset`` in every slot. One reduce-scatter or all-gather moves the
  whole buffer (ZeRO's stage-2 buckets and parameter exchange, Gemini's chunk gathers and reductions).
- *parameter-major*: each parameter's whole flat value, one after the other. Zeroed, with each rank writing only its
  own rows, an all-reduce of it is an all-gather ([Note: exchanges per backend] in ``distributed/collectives.py``).

Zero-dimensional parameters are replicated: every rank owns the whole value.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from lightning_colossal.engine_parts.rows import ShardSpec


def rows_into_slots(whole: Tensor, spec: ShardSpec, slots: Tensor, slot_offset: int) -> None:
    """Copy every rank's rows of a parameter (``whole``, its flat value) into that rank's slot of ``slots``.

    A replicated parameter's value goes into every slot.
    """
    if spec.replicated:
        slots[:, slot_offset].copy_(whole.reshape(()).expand(spec.world_size))
        return
    for rank in range(spec.world_size):
        start, end = spec.rows_of(rank)
        if end > start:
            count = (end - start) * spec.row_numel
            slots[rank, slot_offset : slot_offset + count].copy_(whole[start * spec.row_numel : end * spec.row_numel])


def rows_from_slots(slots: Tensor, slot_offset: int, spec: ShardSpec, whole: Tensor) -> None:
    """Copy every rank's rows of a parameter out of its slot of ``slots`` into ``whole`` (its flat value).

    A replicated parameter takes rank 0's value, so every rank ends with the same one.
    """
    if spec.replicated:
        whole.copy_(slots[0, slot_offset : slot_offset + 1])
        return
    for rank in range(spec.world_size):
        start, end = spec.rows_of(rank)
        if end > start:
            count = (end - start) * spec.row_numel
            whole[start * spec.row_numel : end * spec.row_numel].copy_(slots[rank, slot_offset : slot_offset + count])


def own_rows_into_whole(own_rows: Tensor, spec: ShardSpec, whole: Tensor) -> None:
    """Write this rank's rows of a parameter into their place in ``whole`` (the parameter's flat region of a zeroed
    parameter-major buffer), so that the sum of every rank's buffer is the parameter.

    A replicated parameter is written by rank 0 only: it must count once in the sum.
    """
    if spec.replicated:
        if spec.rank == 0:
            whole.copy_(own_rows.reshape(-1))
        return
    start = spec.row_start * spec.row_numel
    whole[start : start + spec.local_numel].copy_(own_rows.reshape(-1))


def copy_out_of_flat(flat: Tensor, tensors: Sequence[Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` back into ``tensors`` (the inverse of concatenating their flat values)."""
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
        offset += tensor.numel()
