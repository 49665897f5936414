"""The planner's ring-attention axis: the ring rows it weighs, activations per rank against the tensors one ring
rank really saves, and the bytes it says the ring sends (measured on live ranks in
``tests/distributed/test_ring_attention.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.distributed.ring_attention import ring_attention
from lightning_colossal.planning.activations import Workload, activation_estimate, ring_exchange_bytes
from lightning_colossal.planning.model_state import OPTIMIZERS, Training
from lightning_colossal.planning.planner import Hardware, make_plan
from lightning_colossal.planning.sources import DemoOverrides, LayerShape, demo_model, parameter_count_model
from tests.unit.test_plan import ACTIVATION_TOLERANCE, saved_bytes

GIB = 2**30
ADAMW = OPTIMIZERS["adamw"]


class _LocalRing(torch.nn.Module):
    """Ring attention over no group: what one ring rank computes and saves for its own tokens."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(query.shape[2])
        return ring_attention(query, key, value, None, query_positions=positions, key_positions=positions)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("sp_size", [2, 4])
def test_activations_per_ring_rank_match_what_one_rank_saves(precision, sp_size):
    """A ring rank saves, for its ``1 / sp_size`` of the tokens, what the estimate says; the blocks of the other
    ranks pass through without being kept (the ring's own autograd function saves only local tensors)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=3, embed_dim=64, num_heads=4, vocab_size=256, block_size=64))
    for block in model.blocks:
        block.attn.core = _LocalRing()
    model = model.to(torch.bfloat16) if precision == "bf16-true" else model
    tokens = torch.randint(0, 256, (4, 64 // sp_size))

    def forward() -> None:
        F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())

    shape = demo_model(DemoOverrides(layers=3, hidden=64, heads=4, vocab=256, block_size=64))
    estimate = activation_estimate(shape, Training(precision, ADAMW, "cpu"), Workload(4, 64), sp_size=sp_size)
    measured = saved_bytes(model, forward, precision)
    assert abs(estimate.total / measured - 1) <= ACTIVATION_TOLERANCE, (precision, estimate.total, measured)
    whole = activation_estimate(shape, Training(precision, ADAMW, "cpu"), Workload(4, 64))
    assert estimate.layers < whole.layers / sp_size * 1.2  # the layers' share falls as 1 / sp_size


def test_ring_exchange_bytes():
    shape = demo_model(DemoOverrides(layers=2, hidden=64, heads=4, vocab=256, block_size=64))
    training = Training("bf16-mixed", ADAMW, "cpu")
    # 2 (keys, values) * 64 wide * 4 * 64 / 4 tokens per rank; 3 hops forward and back at 2 bytes, 4 hops at 4 bytes.
    block = 2 * 64 * 4 * 64 // 4
    assert ring_exchange_bytes(shape, training, Workload(4, 64), tp_size=1, sp_size=4) == block * (2 * 3 * 2 + 4 * 4)
    assert ring_exchange_bytes(shape, training, Workload(4, 64), tp_size=2, sp_size=4) == block * 28 // 2
    assert ring_exchange_bytes(shape, training, Workload(4, 64), tp_size=1, sp_size=1) == 0


def _plan(model: Any, sequence: int) -> Any:
    hardware = Hardware(devices_per_node=4, nodes=1, device_memory=80 * GIB, host_memory=512 * GIB)
    return make_plan(model, hardware, Training("bf16-mixed", ADAMW, "cuda"), Workload(1, sequence))


def test_the_planner_weighs_ring_rows_for_the_demo_gpt_only():
    plan = _plan(demo_model(DemoOverrides(block_size=4096)), 4096)
    by_label = {evaluation.setting.label: evaluation for evaluation in plan.evaluations}
    ring2, ring4 = by_label["colossal_hybrid ring sp=2 zero1"], by_label["colossal_hybrid ring sp=4 zero1"]
    assert ring4.how == 'HybridParallelStrategy(sp_size=4, sequence_parallel="ring", zero_stage=1)'
    assert ring4.activations.layers < ring2.activations.layers < by_label["colossal_zero1"].activations.layers
    assert any("per layer per micro-batch around the ring" in note for note in ring4.notes)
    odd = _plan(demo_model(DemoOverrides(block_size=4096)), 4092)
    assert any("divisible by 2 * sp_size = 8" in note for evaluation in odd.evaluations for note in evaluation.notes)
    # Only the demo GPT's policy installs ring attention.
    other = _plan(parameter_count_model(LayerShape(parameters=7 * 10**9, layers=32, hidden=4096)), 4096)
    assert not any("ring" in evaluation.setting.label for evaluation in other.evaluations)
