"""The region check decides by the order modules run (``parallel/regions.py`` [Note: regions by the order modules
run]), in one process: split layers over a group of one rank run like plain ones, so the hooks see the real order."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_colossal.parallel.policy import (
    ParallelPlan,
    check_tensor_parallel_regions,
    column_parallel,
    row_parallel,
)
from lightning_colossal.parallel.tensor_parallel import ParallelContext

ALONE = ParallelContext(tp_group=None, tp_mesh=None, sp_group=None)


def split_sequential(*steps: nn.Module) -> tuple[nn.Sequential, ParallelPlan]:
    """``nn.Sequential(Linear, LayerNorm, Linear [colwise], <steps>, Linear [rowwise])``, split."""
    plan = ParallelPlan()
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.LayerNorm(4),
        column_parallel(nn.Linear(4, 8), ALONE, plan),
        *steps,
        row_parallel(nn.Linear(8, 4), ALONE, plan),
    )
    check_tensor_parallel_regions(model, plan)
    return model, plan


def test_layers_before_the_split_are_candidates_only_until_the_first_forward_shows_them_outside():
    model, plan = split_sequential(nn.ReLU())
    assert plan.region_trace is not None  # nesting alone puts 0 and 1 in the Sequential's region
    assert sorted(name for name, _ in plan.region_trace.candidates.values()) == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.weight",
    ]
    model(torch.randn(2, 4)).sum().backward()
    plan.region_trace.settle()  # ran before the column-parallel layer: nothing refused
    assert all(not module._forward_pre_hooks and not module._forward_hooks for module in model.modules())


def test_a_norm_run_between_the_split_layers_is_refused_before_it_runs():
    model, plan = split_sequential(nn.LayerNorm(8))
    with pytest.raises(ValueError, match=r"\['3.weight', '3.bias'\] after a column-parallel layer") as raised:
        model(torch.randn(2, 4))
    assert "0.weight" not in str(raised.value) and "plan.add_partial_gradients" in str(raised.value)
    assert all(not module._forward_pre_hooks and not module._forward_hooks for module in model.modules())


def test_a_candidate_that_never_ran_is_refused_when_the_trace_is_settled():
    class SkipsItsNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.LayerNorm(4)
            self.inner = nn.Linear(4, 4)

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return self.inner(hidden)

    model, plan = split_sequential(nn.ReLU())
    model[0] = SkipsItsNorm()
    plan.region_trace = None
    check_tensor_parallel_regions(model, plan)
    assert plan.region_trace is not None
    model(torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"\['0.unused.weight', '0.unused.bias'\].*did not run in the first forward"):
        plan.region_trace.settle()


def test_declared_parameters_need_no_trace():
    plan = ParallelPlan()
    norm = nn.LayerNorm(8)
    plan.add_partial_gradients(norm.parameters())
    model = nn.Sequential(
        column_parallel(nn.Linear(4, 8), ALONE, plan), norm, row_parallel(nn.Linear(8, 4), ALONE, plan)
    )
    check_tensor_parallel_regions(model, plan)
    assert plan.region_trace is None
