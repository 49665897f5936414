"""Which tokens of a sequence each sequence-parallel rank holds, and in what order.

[Note: sequence layouts]
Two layouts exist. ``"contiguous"`` (Ulysses, ``sequence_parallel="all_to_all"``): rank r holds the r-th of
``sp_size`` equal slices. ``"zigzag"`` (ring attention, ``sequence_parallel="ring"``): the sequence is cut into
``2 * sp_size`` equal chunks and rank r holds chunks r and ``2 * sp_size - 1 - r``, in that order. Under causal
attention a contiguous layout gives the last rank ``sp_size`` times the work of the first (its queries see every
key, the first rank's see only its own); the zigzag pairs an early chunk with a late one, so every rank computes the
same number of visible query/key pairs and no rank waits on another in the ring. Positions, the batch split and the
gather before a loss all follow from ``sequence_positions``, so the three cannot disagree.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

SequenceLayout = Literal["contiguous", "zigzag"]
LAYOUTS: tuple[str, ...] = ("contiguous", "zigzag")


def _pieces(layout: str, sp_size: int) -> int:
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown sequence layout {layout!r}: use one of {', '.join(LAYOUTS)}.")
    return 2 * sp_size if layout == "zigzag" else sp_size


def check_sequence_length(sequence_length: int, sp_size: int, layout: str) -> None:
    """Raise, naming the fix, unless a sequence of ``sequence_length`` tokens splits in ``layout`` over ``sp_size``."""
    pieces = _pieces(layout, sp_size)
    if sequence_length % pieces != 0:
        why = (
            f"the zigzag layout of ring attention cuts it into 2 * sp_size = {pieces} equal chunks"
            if layout == "zigzag"
            else f"it is split into sp_size = {pieces} equal slices"
        )
        raise ValueError(
            f"Sequence parallelism cannot split a sequence of {sequence_length} tokens: {why}. Use a sequence length"
            f" divisible by {pieces} (pad it, or choose the data's block size accordingly)."
        )


def _chunks_of(sp_size: int, sp_rank: int, layout: str) -> tuple[int, ...]:
    """Indices of the equal chunks rank ``sp_rank`` holds, in the order it holds them."""
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank={sp_rank} is outside 0 .. sp_size - 1 = {sp_size - 1}.")
    if layout == "zigzag":
        return (sp_rank, 2 * sp_size - 1 - sp_rank)
    return (sp_rank,)


def sequence_positions(sequence_length: int, sp_size: int, sp_rank: int, layout: str) -> Tensor:
    """int64 global positions of rank ``sp_rank``'s tokens of a ``sequence_length``-token sequence, in the order the
    rank holds them ([Note: sequence layouts])."""
    check_sequence_length(sequence_length, sp_size, layout)
    chunk = sequence_length // _pieces(layout, sp_size)
    starts = [index * chunk for index in _chunks_of(sp_size, sp_rank, layout)]
    return torch.cat([torch.arange(start, start + chunk, dtype=torch.int64) for start in starts])


def shard_sequence(tensor: Tensor, dim: int, sp_size: int, sp_rank: int, layout: str) -> Tensor:
    """Rank ``sp_rank``'s tokens of ``tensor`` (the whole sequence along ``dim``), in the order the rank holds them.

    A view for the contiguous layout; a new tensor for the zigzag one (two chunks concatenated).
    """
    if sp_size == 1:
        return tensor
    length = tensor.shape[dim]
    check_sequence_length(length, sp_size, layout)
    pieces = tensor.chunk(_pieces(layout, sp_size), dim=dim)
    held = [pieces[index] for index in _chunks_of(sp_size, sp_rank, layout)]
    return held[0] if len(held) == 1 else torch.cat(held, dim=dim)


def unshard_sequence(gathered: Tensor, dim: int, sp_size: int, layout: str) -> Tensor:
    """The natural token order of ``gathered``: every rank's shard concatenated along ``dim`` in rank order (what an
    all-gather along ``dim`` returns). The inverse of ``shard_sequence`` over all ranks; gathering is the caller's."""
    if sp_size == 1 or layout == "contiguous":
        _pieces(layout, sp_size)  # an unknown layout still fails
        return gathered
    check_sequence_length(gathered.shape[dim], sp_size, layout)
    held = gathered.chunk(2 * sp_size, dim=dim)  # rank-major: rank r's two chunks are 2r and 2r + 1
    ordered = [held[2 * index] for index in range(sp_size)]
    ordered += [held[2 * index + 1] for index in reversed(range(sp_size))]
    return torch.cat(ordered, dim=dim)


__all__ = [
    "LAYOUTS",
    "SequenceLayout",
    "check_sequence_length",
    "sequence_positions",
    "shard_sequence",
    "unshard_sequence",
]
