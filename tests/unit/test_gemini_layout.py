"""Gemini's chunk layout and chunk states: packing, chunk-size search, shard offsets and legal transitions.

Pure logic, no process group: every rank's view of the layout is built in this process.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_colossal.gemini.chunk import LEGAL_TRANSITIONS, Chunk, ChunkState, Location, check_transition
from lightning_colossal.gemini.layout import (
    ChunkSizeChoice,
    build_layout,
    check_chunk_numel,
    pack,
    search_chunk_numel,
    wasted_numel,
)

# ---------------------------------------------------------------------------------------------------------------
# pack / wasted_numel
# ---------------------------------------------------------------------------------------------------------------


def test_pack_fills_chunks_greedily_in_order():
    # 4 + 5 = 9 fits 10; 2 does not (11), so it starts chunk 2; 3 + 5 = 10 still fits there; 1 opens chunk 3.
    # A best-fit packer would move the 1 into the first chunk; greedy in-order packing must not.
    assert pack([4, 5, 2, 3, 5, 1], capacity=10) == [[0, 1], [2, 3, 4], [5]]


def test_pack_gives_an_oversized_item_a_chunk_of_its_own():
    # The 25 closes the open chunk [0] and sits alone; packing then resumes with a fresh chunk after it.
    assert pack([3, 25, 4, 5], capacity=10) == [[0], [1], [2, 3]]
    assert pack([25], capacity=10) == [[0]]
    assert pack([], capacity=10) == []


def test_pack_item_exactly_at_capacity_fills_a_chunk():
    assert pack([10, 10, 1], capacity=10) == [[0], [1], [2]]


@pytest.mark.parametrize("capacity", [0, -5])
def test_pack_rejects_a_capacity_below_one(capacity):
    with pytest.raises(ValueError, match="at least one element"):
        pack([1, 2], capacity=capacity)


@pytest.mark.parametrize(
    ("numels", "capacity", "expected"),
    [
        # [4, 5] -> 1 unused, [2, 3, 5] -> 0 unused, [1] -> 9 unused.
        ([4, 5, 2, 3, 5, 1], 10, 1 + 0 + 9),
        # [3] -> 7, [25] is its own exact-size chunk -> 0, [4, 5] -> 1.
        ([3, 25, 4, 5], 10, 7 + 0 + 1),
        # Everything fits one chunk: the waste is the unused tail.
        ([1, 2, 3], 100, 94),
        ([5, 5, 5, 5], 10, 0),
        ([], 10, 0),
    ],
)
def test_wasted_numel_hand_computed(numels, capacity, expected):
    assert wasted_numel(numels, capacity) == expected


# ---------------------------------------------------------------------------------------------------------------
# search_chunk_numel
# ---------------------------------------------------------------------------------------------------------------


def _brute_force_choice(numels, start, search_range_numel, search_step_numel):
    """The least-waste capacity over the search's candidates, ties to the smaller one, by exhaustive search."""
    candidates = range(start, start + search_range_numel + 1, search_step_numel)
    best = min(candidates, key=lambda capacity: (wasted_numel(numels, capacity), capacity))
    return ChunkSizeChoice(best, wasted_numel(numels, best), len(pack(numels, best)))


@pytest.mark.parametrize(
    ("numels", "min_chunk_numel", "search_range_numel", "search_step_numel", "start"),
    [
        # start = largest parameter (9); the best capacity (23, waste 2) lies well inside the range.
        ([7, 3, 9, 4, 8, 2, 6, 5], 1, 20, 1, 9),
        # start = 9 rounded up to the step of 4 = 12; candidates 12, 16, 20, 24, 28.
        ([7, 3, 9, 4, 8, 2, 6, 5], 1, 16, 4, 12),
        # min_chunk_numel (75) is larger than every parameter, so it sets the start.
        ([30, 50, 20, 70, 40, 10, 60], 75, 30, 5, 75),
    ],
)
def test_search_chunk_numel_matches_brute_force(numels, min_chunk_numel, search_range_numel, search_step_numel, start):
    expected = _brute_force_choice(numels, start, search_range_numel, search_step_numel)
    # The search only matters if the answer is not simply the first candidate.
    assert expected.chunk_numel != start
    choice = search_chunk_numel(numels, min_chunk_numel, search_range_numel, search_step_numel)
    assert choice == expected
    assert choice.num_chunks == len(pack(numels, choice.chunk_numel))


def test_search_chunk_numel_breaks_ties_towards_the_smaller_capacity():
    numels = [5, 5, 5, 5]
    # Capacities 5, 10 and 20 all waste nothing; the smallest means the smallest gathered buffers.
    assert wasted_numel(numels, 5) == wasted_numel(numels, 10) == wasted_numel(numels, 20) == 0
    choice = search_chunk_numel(numels, min_chunk_numel=5, search_range_numel=15, search_step_numel=5)
    assert choice == ChunkSizeChoice(chunk_numel=5, wasted_numel=0, num_chunks=4)


@pytest.mark.parametrize(("min_chunk_numel", "search_step_numel"), [(100, 1), (5, 8)])
def test_search_chunk_numel_model_smaller_than_start_is_one_exact_chunk(min_chunk_numel, search_step_numel):
    # total 7 <= start (100, or 5 rounded up to the step 8): one chunk of exactly 7, not a padded 100 or 8.
    choice = search_chunk_numel([3, 4], min_chunk_numel, search_range_numel=1000, search_step_numel=search_step_numel)
    assert choice == ChunkSizeChoice(chunk_numel=7, wasted_numel=0, num_chunks=1)


def test_search_chunk_numel_ignores_outliers_when_choosing_the_start():
    # One embedding-like parameter far above mean + 3 std must not force every chunk to be that large.
    numels = [10] * 20 + [10_000]
    limit = sum(numels) / len(numels) + 3 * torch.tensor(numels, dtype=torch.float64).std(unbiased=False).item()
    assert 10_000 > limit  # really an outlier by the documented rule
    choice = search_chunk_numel(numels, min_chunk_numel=1, search_range_numel=0, search_step_numel=1)
    # Capacity 10: twenty full chunks plus the outlier's own exact-size chunk.
    assert choice == ChunkSizeChoice(chunk_numel=10, wasted_numel=0, num_chunks=21)


def test_search_chunk_numel_empty_model():
    assert search_chunk_numel([], 16, 0, 1) == ChunkSizeChoice(chunk_numel=16, wasted_numel=0, num_chunks=0)


@pytest.mark.parametrize(
    ("min_chunk_numel", "search_range_numel", "search_step_numel"), [(0, 10, 1), (1, -1, 1), (1, 10, 0)]
)
def test_search_chunk_numel_rejects_bad_search_parameters(min_chunk_numel, search_range_numel, search_step_numel):
    with pytest.raises(ValueError, match="search_step_numel >= 1"):
        search_chunk_numel([4, 5], min_chunk_numel, search_range_numel, search_step_numel)


# ---------------------------------------------------------------------------------------------------------------
# build_layout
# ---------------------------------------------------------------------------------------------------------------

NAMED_SHAPES = [
    ("embedding.weight", torch.Size((5, 4))),  # 20 elements, 5 rows: uneven over 2 and 4 ranks
    ("linear.weight", torch.Size((3, 2))),  # 6
    ("linear.bias", torch.Size((3,))),  # 3
    ("scale", torch.Size(())),  # 0-dim: replicated
    ("head.weight", torch.Size((7, 3))),  # 21 > capacity: its own chunk
    ("head.bias", torch.Size((2,))),  # 2
]
CAPACITY = 16


def _layouts(world_size):
    return [build_layout(NAMED_SHAPES, CAPACITY, world_size, rank) for rank in range(world_size)]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_build_layout_is_parameter_major_and_contiguous(world_size):
    for chunks in _layouts(world_size):
        assert [chunk.index for chunk in chunks] == list(range(len(chunks)))
        # Members appear in registration order, each chunk as pack() grouped them.
        numels = [math.prod(shape) for _, shape in NAMED_SHAPES]
        assert [[member.name for member in chunk.members] for chunk in chunks] == [
            [NAMED_SHAPES[index][0] for index in group] for group in pack(numels, CAPACITY)
        ]
        for chunk in chunks:
            offset = 0
            for member in chunk.members:
                assert member.offset == offset  # each whole parameter directly follows the previous one
                offset += member.numel
            assert chunk.numel == offset
            # An oversized parameter's chunk is exactly its size; the others have the requested capacity.
            assert chunk.capacity == max(CAPACITY, offset)


def test_build_layout_gives_the_oversized_parameter_an_exact_chunk():
    chunks = build_layout(NAMED_SHAPES, CAPACITY, world_size=1, rank=0)
    (head_chunk,) = [chunk for chunk in chunks if any(member.name == "head.weight" for member in chunk.members)]
    assert [member.name for member in head_chunk.members] == ["head.weight"]
    assert head_chunk.capacity == head_chunk.numel == 21


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_build_layout_shards_follow_torch_chunk_rows(world_size):
    for rank, chunks in enumerate(_layouts(world_size)):
        for chunk in chunks:
            shard_offset = slot_offset = 0
            for member in chunk.members:
                spec = member.spec
                assert member.shard_offset == shard_offset  # this rank's rows, back to back
                assert member.slot_offset == slot_offset  # same on every rank: fixed-size slots
                shard_offset += spec.local_numel
                slot_offset += spec.slot_numel
                if spec.replicated:
                    continue
                # The rows this rank keeps must be exactly torch.chunk's piece for this rank (or nothing).
                values = torch.arange(member.numel).view(spec.shape)
                pieces = torch.chunk(values, world_size, dim=0)
                expected = pieces[rank] if rank < len(pieces) else values[:0]
                assert torch.equal(values[spec.row_start : spec.row_end], expected)
                assert spec.local_numel == expected.numel()
                # The slot must hold the largest piece any rank has.
                assert spec.slot_numel == max(piece.numel() for piece in pieces)
            assert chunk.shard_numel == shard_offset
            assert chunk.slot_numel == slot_offset


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_build_layout_ranks_cover_every_sharded_parameter_exactly_once(world_size):
    layouts = _layouts(world_size)
    for chunk_index, chunk in enumerate(layouts[0]):
        # How many ranks own each element of the gathered buffer.
        owners = torch.zeros(chunk.numel, dtype=torch.int64)
        for chunks in layouts:
            for member in chunks[chunk_index].members:
                spec = member.spec
                start = member.offset + (0 if spec.replicated else spec.row_start * spec.row_numel)
                owners[start : start + spec.local_numel] += 1
        # Sharded parameters: exactly one owner per element; 0-dim parameters: every rank owns them.
        expected = torch.ones(chunk.numel, dtype=torch.int64)
        for member in chunk.members:
            if member.spec.replicated:
                expected[member.offset] = world_size
        assert torch.equal(owners, expected)
        assert sum(chunks[chunk_index].shard_numel for chunks in layouts) == int(expected.sum())


@pytest.mark.parametrize("world_size", [1, 4])
def test_build_layout_replicates_zero_dim_parameters(world_size):
    for rank, chunks in enumerate(_layouts(world_size)):
        (member,) = [member for chunk in chunks for member in chunk.members if member.name == "scale"]
        assert member.spec.replicated
        assert member.spec.rank == rank
        assert member.spec.local_numel == member.spec.slot_numel == member.numel == 1
        assert member.spec.local_shape == torch.Size(())


def test_build_layout_rank_without_rows_gets_an_empty_shard():
    # 2 rows over 4 ranks: torch.chunk gives ranks 0 and 1 a row each, ranks 2 and 3 nothing.
    named_shapes = [("small.weight", torch.Size((2, 3))), ("big.weight", torch.Size((8, 1)))]
    local_numels = []
    for rank in range(4):
        (chunk,) = build_layout(named_shapes, capacity=64, world_size=4, rank=rank)
        small, big = chunk.members
        local_numels.append(small.spec.local_numel)
        assert small.spec.local_shape == torch.Size((small.spec.local_rows, 3))
        # The next member's shard starts right after this rank's (possibly empty) rows.
        assert big.shard_offset == small.spec.local_numel
        # Slots stay fixed-size (one row of 3) even on ranks that own nothing.
        assert big.slot_offset == 3
        assert chunk.shard_numel == small.spec.local_numel + 2
        assert chunk.slot_numel == 3 + 2
    assert local_numels == [3, 3, 0, 0]


# ---------------------------------------------------------------------------------------------------------------
# check_chunk_numel
# ---------------------------------------------------------------------------------------------------------------


def test_check_chunk_numel_names_the_largest_parameter_and_the_minimum():
    named_shapes = [("encoder.weight", torch.Size((4, 4))), ("decoder.weight", torch.Size((6, 5)))]
    with pytest.raises(ValueError) as caught:
        check_chunk_numel(29, named_shapes)
    message = str(caught.value)
    assert "'decoder.weight'" in message, message
    assert "chunk_numel >= 30" in message, message
    assert "chunk_numel=None" in message, message  # the alternative fix: let the search choose
    check_chunk_numel(30, named_shapes)  # exactly the largest parameter is enough
    check_chunk_numel(1, [])  # nothing to hold


# ---------------------------------------------------------------------------------------------------------------
# Chunk states
# ---------------------------------------------------------------------------------------------------------------

# The edges of [Note: chunk states] in chunk.py, written out independently so a change to the table is noticed.
DOCUMENTED_TRANSITIONS = {
    (ChunkState.SHARDED, ChunkState.GATHERING),
    (ChunkState.SHARDED, ChunkState.GATHERED),
    (ChunkState.GATHERING, ChunkState.GATHERED),
    (ChunkState.GATHERED, ChunkState.COMPUTING),
    (ChunkState.GATHERED, ChunkState.AWAITING_GRADIENTS),
    (ChunkState.GATHERED, ChunkState.SHARDED),
    (ChunkState.COMPUTING, ChunkState.GATHERED),
    (ChunkState.AWAITING_GRADIENTS, ChunkState.GATHERED),
    (ChunkState.AWAITING_GRADIENTS, ChunkState.SHARDED),
}
ALL_PAIRS = list(itertools.product(ChunkState, ChunkState))


def test_legal_transitions_table_matches_the_documented_state_machine():
    table = {(current, target) for current, targets in LEGAL_TRANSITIONS.items() for target in targets}
    assert table == DOCUMENTED_TRANSITIONS
    assert set(LEGAL_TRANSITIONS) == set(ChunkState)  # every state has an entry (no KeyError in check_transition)


@pytest.mark.parametrize(("current", "target"), sorted(DOCUMENTED_TRANSITIONS, key=str))
def test_check_transition_accepts_legal_moves(current, target):
    check_transition(3, current, target)


@pytest.mark.parametrize(
    ("current", "target"), [pair for pair in ALL_PAIRS if pair not in DOCUMENTED_TRANSITIONS], ids=str
)
def test_check_transition_rejects_illegal_moves_naming_both_states(current, target):
    with pytest.raises(RuntimeError) as caught:
        check_transition(3, current, target)
    message = str(caught.value)
    assert f"{current.value!r} -> {target.value!r}" in message, message
    assert "chunk 3" in message, message


def test_chunk_move_updates_state_only_when_legal():
    (spec,) = build_layout([("weight", torch.Size((2, 2)))], capacity=4, world_size=1, rank=0)
    shard = torch.zeros(spec.shard_numel)
    chunk = Chunk(spec, shard, shard, Location.COMPUTE, Location.COMPUTE, parameters=[])
    assert chunk.state is ChunkState.SHARDED and not chunk.is_gathered
    chunk.move(ChunkState.GATHERED)
    assert chunk.state is ChunkState.GATHERED and chunk.is_gathered
    with pytest.raises(RuntimeError, match="illegal state transition"):
        chunk.move(ChunkState.GATHERING)
    assert chunk.state is ChunkState.GATHERED  # a refused move leaves the state untouched
