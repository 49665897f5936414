"""The pure parts of ``benchmarks.capacity``: the depth search, the fit verdict, the ratio and the planner bracket.

No training and no process group: fake ``fits`` functions stand in for the runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.capacity.search import (
    MIB,
    STRATEGIES,
    classify,
    largest_predicted,
    parse_arguments,
    predicted_device_bytes,
    ratio_to,
    search_largest,
    table_rows,
)


def _counting(limit: int) -> tuple[Any, list[int]]:
    """A monotone ``fits``: depths up to ``limit`` fit; records every depth asked."""
    asked: list[int] = []

    def fits(layers: int) -> bool:
        asked.append(layers)
        return layers <= limit

    return fits, asked


@pytest.mark.parametrize("limit", [1, 2, 5, 7, 13, 40, 63])
@pytest.mark.parametrize("guess", [1, 5, 12, 64])
def test_search_finds_the_boundary_from_any_guess(limit: int, guess: int) -> None:
    fits, asked = _counting(limit)
    assert search_largest(fits, guess, max_layers=64) == (limit, limit + 1)
    assert len(asked) == len(set(asked)), "no depth is run twice"


def test_an_exact_guess_costs_two_runs() -> None:
    fits, asked = _counting(5)
    assert search_largest(fits, 5, max_layers=64) == (5, 6)
    assert asked == [5, 6]


def test_search_reports_the_cap_and_the_floor() -> None:
    fits, _ = _counting(100)
    assert search_largest(fits, 3, max_layers=10) == (10, None)  # the cap, not the budget, bounds it
    nothing, _ = _counting(0)
    assert search_largest(nothing, 4, max_layers=10) == (None, 1)


def _rank(**changes: Any) -> dict[str, Any]:
    rank = {"error": None, "steps_done": 3, "finite": True, "peak_device_bytes": 10 * MIB}
    return {**rank, **changes}


def test_classify_names_why_a_run_does_not_fit() -> None:
    budget = 64 * MIB
    assert classify([_rank(), _rank()], 2, 3, budget) == (True, "fits")
    assert classify([_rank(), _rank(peak_device_bytes=budget + 1)], 2, 3, budget)[1].endswith("> B")
    assert classify([_rank(peak_device_bytes=budget)], 1, 3, budget)[0], "exactly B fits"
    assert classify([_rank()], 2, 3, budget)[1].startswith("only 1 of 2 ranks")
    assert classify([_rank(error="BudgetTooSmall: too small\nmore"), _rank()], 2, 3, budget) == (
        False,
        "BudgetTooSmall: too small",
    )
    assert classify([_rank(steps_done=2), _rank()], 2, 3, budget) == (False, "trained 2 of 3 steps")
    assert classify([_rank(finite=False), _rank()], 2, 3, budget) == (False, "a loss was not finite")


def test_ratio_and_table() -> None:
    results = {
        "colossal_ddp": {
            "largest": {"parameters": 4_000_000, "layers": 5, "peak_device_bytes": 63 * MIB, "step_seconds": 0.5},
            "first_failing": {
                "parameters": 4_800_000,
                "layers": 6,
                "peak_device_bytes": 70 * MIB,
                "reason": "device model state peaked at 70.00 MiB > B",
            },
        },
        "colossal_gemini_auto": {
            "largest": {"parameters": 36_000_000, "layers": 45, "peak_device_bytes": 50 * MIB, "step_seconds": 3.0},
            "first_failing": None,
        },
        "colossal_zero2": {"largest": None, "first_failing": {"parameters": 1, "layers": 1, "reason": "x"}},
    }
    assert ratio_to(results, "colossal_gemini_auto", "colossal_ddp") == pytest.approx(9.0)
    assert ratio_to(results, "colossal_zero2", "colossal_ddp") is None
    rows = table_rows(results, 64, 45)
    assert len(rows) == 5
    assert "9.00x" in rows[3] and "search cap" in rows[3]
    assert "| none |" in rows[4]


def test_planner_bracket_grows_with_depth_and_matches_16_psi_for_ddp() -> None:
    arguments = parse_arguments(["--budget-mib", "64"])
    ddp = STRATEGIES["colossal_ddp"]
    sizes = [predicted_device_bytes(ddp, arguments, layers) for layers in (1, 2, 3)]
    assert sizes == sorted(sizes)
    per_layer = sizes[1] - sizes[0]
    assert per_layer == 16 * 789_760  # one d256 block: 12·256² weights + 13·256 biases and norm weights, 16 B each
    assert largest_predicted(lambda layers: predicted_device_bytes(ddp, arguments, layers), 64 * MIB, 64) == 5


def test_gemini_peak_is_a_bound_from_above_and_ddp_keeps_its_samples() -> None:
    from benchmarks.capacity.ranks import DeviceBytesProbe, peak_device_bytes

    probe = DeviceBytesProbe()
    probe.peak = {"total": 10 * MIB}
    probe.resident_peak = 8 * MIB
    # Shards held outside the working set plus the engine's exact working-set peak: above what sampling saw.
    gemini = peak_device_bytes(probe, {"peak_working_set_bytes": 5 * MIB})
    assert gemini["peak_device_bytes"] == 13 * MIB and gemini["peak_source"] == "bound"
    assert peak_device_bytes(probe, {"peak_working_set_bytes": 1 * MIB})["peak_source"] == "sampled"
    assert peak_device_bytes(probe, {}) == {"peak_device_bytes": 10 * MIB, "peak_source": "sampled"}
