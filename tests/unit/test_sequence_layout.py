"""Sequence layouts (``parallel/sequence_layout.py``): which tokens each sequence-parallel rank holds."""

from __future__ import annotations

import pytest
import torch

from lightning_colossal.parallel.batches import split_sequence
from lightning_colossal.parallel.sequence_layout import sequence_positions, shard_sequence, unshard_sequence


def test_zigzag_ranks_hold_an_early_and_a_late_chunk():
    assert sequence_positions(8, 2, 0, "zigzag").tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 2, 1, "zigzag").tolist() == [2, 3, 4, 5]
    assert sequence_positions(8, 4, 3, "zigzag").tolist() == [3, 4]
    assert sequence_positions(8, 2, 1, "contiguous").tolist() == [4, 5, 6, 7]
    assert sequence_positions(8, 2, 1, "zigzag").dtype == torch.int64


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("sp_size", [1, 2, 4])
def test_shards_cover_the_sequence_and_unshard_restores_it(layout, sp_size):
    whole = torch.arange(2 * 16 * 3).view(2, 16, 3)
    shards = [shard_sequence(whole, 1, sp_size, rank, layout) for rank in range(sp_size)]
    for rank, shard in enumerate(shards):
        # A shard holds exactly the tokens at its positions, in that order.
        assert torch.equal(shard, whole[:, sequence_positions(16, sp_size, rank, layout)])
    assert torch.equal(unshard_sequence(torch.cat(shards, dim=1), 1, sp_size, layout), whole)


def test_every_rank_sees_the_same_number_of_causal_pairs_under_zigzag():
    """The point of the zigzag: causal attention work is equal on every rank (contiguous: the last rank's is
    largest)."""
    whole = torch.arange(16)

    def pairs(layout: str, rank: int) -> int:
        return int((sequence_positions(16, 4, rank, layout)[:, None] >= whole[None, :]).sum())

    assert len({pairs("zigzag", rank) for rank in range(4)}) == 1
    assert len({pairs("contiguous", rank) for rank in range(4)}) == 4


def test_lengths_that_do_not_split_and_unknown_layouts_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"2 \* sp_size = 4 equal chunks.*divisible by 4"):
        sequence_positions(6, 2, 0, "zigzag")
    with pytest.raises(ValueError, match="divisible by 3"):
        shard_sequence(torch.zeros(1, 8), 1, 3, 0, "contiguous")
    with pytest.raises(ValueError, match="use one of contiguous, zigzag"):
        sequence_positions(8, 2, 0, "striped")
    with pytest.raises(ValueError, match="outside 0 .. sp_size - 1"):
        sequence_positions(8, 2, 2, "zigzag")


def test_split_sequence_takes_the_layout():
    tokens = torch.arange(16).view(2, 8)
    lengths = torch.tensor([8, 8])  # no sequence dimension: kept whole
    inputs, kept = split_sequence((tokens, lengths), sp_size=2, sp_rank=0, layout="zigzag")
    assert torch.equal(inputs, tokens[:, [0, 1, 6, 7]]) and kept is lengths
