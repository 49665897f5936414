"""Gemini's placement decisions from byte counts, and the placement settings that feed them.

Pure logic: no devices, no process group.
"""

from __future__ import annotations

import math
import random
import re

import pytest

from lightning_colossal.config import AutoPlacement, GeminiConfig, StaticPlacement
from lightning_colossal.gemini.placement import (
    BudgetTooSmall,
    NextUse,
    PlacementPlan,
    auto_plan,
    choose_evictions,
    leading_share,
    next_use_distance,
    static_plan,
)

# ---------------------------------------------------------------------------------------------------------------
# leading_share / static_plan / auto_plan
# ---------------------------------------------------------------------------------------------------------------

CHUNK_BYTES = [100, 200, 300, 400]  # total 1000


@pytest.mark.parametrize(
    ("fraction", "expected"),
    [
        (0.0, set()),
        (0.25, {0}),  # 100 fits 250, 100 + 200 does not
        (0.3, {0, 1}),  # exactly at the limit counts as fitting
        (0.6, {0, 1, 2}),
        (0.99, {0, 1, 2}),  # the last chunk does not fit 990
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_leading_share_takes_the_first_chunks_that_fit(fraction, expected):
    assert leading_share(CHUNK_BYTES, fraction) == frozenset(expected)


def test_leading_share_is_a_prefix():
    # 20% of 65 is 13: chunk 0 (10) fits, chunk 1 (50) does not. Chunk 2 (5) would fit the room left but must not
    # be taken: the share is "the first chunks in order", a prefix.
    assert leading_share([10, 50, 5], 0.2) == frozenset({0})


def test_static_plan_keeps_the_last_chunks_gathered():
    # 1 - 0.5 = half the bytes stay gathered: the last chunk (400) fits 500, adding 300 does not.
    plan = static_plan(CHUNK_BYTES, StaticPlacement(shard_param_frac=0.5))
    assert plan.keep_gathered == frozenset({3})
    # 1 - 0.3 = 700: the last two chunks (400 + 300) fit exactly.
    plan = static_plan(CHUNK_BYTES, StaticPlacement(shard_param_frac=0.3))
    assert plan.keep_gathered == frozenset({2, 3})


def test_static_plan_offloads_the_first_chunks():
    placement = StaticPlacement(shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=0.5)
    assert static_plan(CHUNK_BYTES, placement) == PlacementPlan(
        keep_gathered=frozenset(),
        offload_optimizer=frozenset({0, 1, 2, 3}),
        offload_parameters=frozenset({0, 1}),  # 100 + 200 fit 500, + 300 does not
    )
    plan = static_plan(CHUNK_BYTES, StaticPlacement(offload_optim_frac=0.6))
    assert plan.offload_optimizer == frozenset({0, 1, 2})


def test_static_plan_extreme_fractions():
    nothing = frozenset()
    everything = frozenset(range(len(CHUNK_BYTES)))
    # The default is ZeRO-3 on the device: everything sharded, nothing offloaded.
    assert static_plan(CHUNK_BYTES, StaticPlacement()) == PlacementPlan(nothing, nothing, nothing)
    # shard_param_frac=0 keeps every chunk gathered (ZeRO-2-like); full optimizer offload.
    placement = StaticPlacement(shard_param_frac=0.0, offload_optim_frac=1.0)
    assert static_plan(CHUNK_BYTES, placement) == PlacementPlan(everything, everything, nothing)
    placement = StaticPlacement(shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0)
    assert static_plan(CHUNK_BYTES, placement) == PlacementPlan(nothing, everything, everything)


def test_auto_plan_offloads_every_optimizer_and_keeps_parameters_on_the_device_without_a_budget():
    assert auto_plan(3, budgeted=False) == PlacementPlan(frozenset(), frozenset({0, 1, 2}), frozenset(), frozenset())
    assert auto_plan(0, budgeted=False) == PlacementPlan(frozenset(), frozenset(), frozenset(), frozenset())


def test_auto_plan_under_a_budget_starts_every_shard_off_the_device_but_parks_none():
    plan = auto_plan(3, budgeted=True)
    assert plan.start_offloaded == frozenset({0, 1, 2})
    assert plan.offload_parameters == frozenset(), "parked shards could never come back onto the device"
    assert plan.offload_optimizer == frozenset({0, 1, 2})


# ---------------------------------------------------------------------------------------------------------------
# next_use_distance
# ---------------------------------------------------------------------------------------------------------------

# Chunks used by each op of one step; the step repeats.
SEQUENCE = [frozenset({0}), frozenset({1}), frozenset({0, 2}), frozenset({3})]


@pytest.mark.parametrize(
    ("position", "chunk", "expected"),
    [
        (0, 1, 1),  # the very next op
        (0, 0, 2),  # op 2 uses it again; op 0 itself does not count
        (2, 0, 2),  # wraps around: op 3, then op 0 of the next step
        (3, 2, 3),  # wraps around: ops 0, 1, 2
        (1, 1, 4),  # used only at the current op: a whole step away
        (0, 9, math.inf),  # never used
    ],
)
def test_next_use_distance(position, chunk, expected):
    assert next_use_distance(SEQUENCE, position, chunk) == expected


def test_next_use_distance_of_an_empty_sequence_is_never():
    assert next_use_distance([], 0, 0) == math.inf


def test_next_use_index_answers_as_the_scan_does():
    # Random traces, every position (the replay cursor starts at -1) and chunk, unused chunks included.
    generator = random.Random(0)
    for _ in range(30):
        length = generator.randint(1, 40)
        sequence = [frozenset(generator.sample(range(12), generator.randint(0, 3))) for _ in range(length)]
        index = NextUse(sequence)
        for position in range(-1, length):
            for chunk in range(14):
                assert index.distance(position, chunk) == next_use_distance(sequence, position, chunk)
    assert NextUse([]).distance(0, 0) == math.inf


# ---------------------------------------------------------------------------------------------------------------
# choose_evictions
# ---------------------------------------------------------------------------------------------------------------


def test_choose_evictions_evicts_nothing_when_the_module_fits():
    # free = 1000 - 100 - 300 = 600, exactly what is needed.
    evictions = choose_evictions(
        {0: 100}, needed_bytes=600, resident_bytes=300, non_model_bytes=100, budget=1000, next_use={0: 1}
    )
    assert evictions == []


def test_choose_evictions_evicts_farthest_next_use_first_and_stops_when_enough():
    # free = 1000 - 0 - 900 = 100; 250 needed, so 150 more: two 100-byte chunks, the two used last.
    evictable = {0: 100, 1: 100, 2: 100}
    next_use = {0: 5, 1: 2, 2: 9}
    assert choose_evictions(evictable, 250, 900, 0, 1000, next_use) == [2, 0]
    # The farthest chunk alone frees enough: the nearer one stays, even though it is bigger.
    assert choose_evictions({0: 500, 1: 200}, 250, 900, 0, 1000, {0: 1, 1: 3}) == [1]


def test_choose_evictions_treats_a_missing_next_use_as_never():
    assert choose_evictions({0: 100, 1: 100}, 150, 900, 0, 1000, next_use={0: 7}) == [1]


def test_choose_evictions_breaks_ties_by_chunk_index():
    # Insertion order of the mapping must not matter, only the index.
    evictable = {5: 100, 2: 100, 7: 100}
    next_use = {5: 3, 2: 3, 7: 3}
    assert choose_evictions(evictable, 300, 900, 0, 1000, next_use) == [2, 5]


def test_choose_evictions_raises_with_the_budget_that_would_suffice():
    evictable = {0: 100, 1: 200}
    needed, resident, non_model = 500, 400, 300
    # Even with every evictable chunk gone, the module needs its bytes, the unevictable residents and activations.
    required = needed + non_model + resident - sum(evictable.values())  # 900
    with pytest.raises(BudgetTooSmall) as caught:
        choose_evictions(evictable, needed, resident, non_model, required - 1, {0: 1, 1: 2})
    assert isinstance(caught.value, ValueError)  # callers may catch it as a plain configuration error
    message = str(caught.value)
    assert f"at least {required}" in message, message
    assert "AutoPlacement(compute_memory_budget=...)" in message, message
    # The number is tight: that budget works, by evicting everything.
    assert choose_evictions(evictable, needed, resident, non_model, required, {0: 1, 1: 2}) == [1, 0]


def test_choose_evictions_raises_when_nothing_can_be_evicted():
    with pytest.raises(BudgetTooSmall, match="at least 120"):
        choose_evictions({}, needed_bytes=100, resident_bytes=0, non_model_bytes=20, budget=100, next_use={})


# ---------------------------------------------------------------------------------------------------------------
# Settings validation
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["shard_param_frac", "offload_optim_frac", "offload_param_frac"])
@pytest.mark.parametrize("value", [-0.1, 1.5])
def test_static_placement_rejects_shares_outside_zero_one(name, value):
    kwargs = {"shard_param_frac": 1.0, "offload_optim_frac": 1.0, name: value}
    with pytest.raises(ValueError, match=re.escape(f"StaticPlacement({name}={value}): pass a share in [0, 1]")):
        StaticPlacement(**kwargs)


@pytest.mark.parametrize(("shard_param_frac", "offload_optim_frac"), [(0.5, 1.0), (1.0, 0.5), (0.0, 0.0)])
def test_static_placement_parameter_offload_needs_full_sharding_and_optimizer_offload(
    shard_param_frac, offload_optim_frac
):
    with pytest.raises(ValueError) as caught:
        StaticPlacement(
            shard_param_frac=shard_param_frac, offload_optim_frac=offload_optim_frac, offload_param_frac=0.25
        )
    message = str(caught.value)
    assert "needs shard_param_frac=1.0 and offload_optim_frac=1.0" in message, message
    assert "Raise both to 1.0 or set offload_param_frac=0" in message, message


def test_static_placement_accepts_the_boundaries():
    StaticPlacement(shard_param_frac=0.0, offload_optim_frac=0.0, offload_param_frac=0.0)
    StaticPlacement(shard_param_frac=1.0, offload_optim_frac=1.0, offload_param_frac=1.0)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"warmup_non_model_data_ratio": 1.0}, "warmup_non_model_data_ratio=1.0): pass a share in [0, 1)"),
        ({"warmup_non_model_data_ratio": -0.1}, "warmup_non_model_data_ratio=-0.1): pass a share in [0, 1)"),
        ({"steady_compute_cap_ratio": 0.0}, "steady_compute_cap_ratio=0.0): pass a share in (0, 1]"),
        ({"steady_compute_cap_ratio": 1.1}, "steady_compute_cap_ratio=1.1): pass a share in (0, 1]"),
        ({"compute_memory_budget": 0}, "pass a positive number of bytes or None"),
        ({"compute_memory_budget": -1}, "pass a positive number of bytes or None"),
    ],
)
def test_auto_placement_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        AutoPlacement(**kwargs)


def test_auto_placement_accepts_the_boundaries():
    AutoPlacement(warmup_non_model_data_ratio=0.0, steady_compute_cap_ratio=1.0, compute_memory_budget=1)
    AutoPlacement(compute_memory_budget=None)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"chunk_numel": 0}, "chunk_numel=0: pass a positive number of elements or None"),
        ({"min_chunk_numel": 0}, "min_chunk_numel=0: pass a positive integer"),
        ({"search_step_numel": 0}, "search_step_numel=0: pass a positive integer"),
        ({"init_window_bytes": 0}, "init_window_bytes=0: pass a positive integer"),
        ({"search_range_numel": -1}, "search_range_numel=-1: pass an integer >= 0"),
        ({"max_prefetch": -1}, "max_prefetch=-1: pass an integer >= 0"),
        ({"communication": "nccl"}, "pass 'auto', 'all_reduce' or 'scatter_gather'"),
    ],
)
def test_gemini_config_rejects_bad_values(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        GeminiConfig(**kwargs)


def test_gemini_config_rejects_a_placement_that_is_not_a_placement_object():
    # A string like the strategy's CLI name is a common mistake; the message shows the objects to pass instead.
    with pytest.raises(TypeError, match=re.escape("pass StaticPlacement(...) or AutoPlacement(...)")):
        GeminiConfig(placement="static")  # type: ignore[arg-type]


def test_gemini_config_accepts_both_placements_and_a_fixed_chunk_size():
    assert isinstance(GeminiConfig().placement, StaticPlacement)
    config = GeminiConfig(placement=AutoPlacement(compute_memory_budget=2**30), chunk_numel=1, max_prefetch=0)
    assert isinstance(config.placement, AutoPlacement)
    assert config.chunk_numel == 1
