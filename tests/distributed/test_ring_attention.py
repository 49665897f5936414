"""Ring attention (``distributed/ring_attention.py``) against one-process attention over the whole sequence: outputs
and query/key/value gradients, on 2 and 4 ranks, for the masks it supports."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

BATCH, HEADS, HEAD_DIM, LENGTH = 2, 4, 8, 16


def reference_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    causal: bool,
    sliding_window: int | None,
    key_padding: torch.Tensor | None,
) -> torch.Tensor:
    """Plain attention in natural token order with an explicit mask; rows that see nothing give zeros."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    positions = torch.arange(query.shape[2])
    visible = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool)
    if causal:
        visible &= positions[None, :] <= positions[:, None]
    if sliding_window is not None:
        visible &= positions[:, None] - positions[None, :] < sliding_window
    visible = visible[None, None]
    if key_padding is not None:
        visible = visible & key_padding[:, None, None, :]
    scores = (query @ key.transpose(-1, -2)) / math.sqrt(query.shape[-1])
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).nan_to_num(0.0)
    return weights @ value


def ring_body(case: dict[str, Any]) -> dict[str, float]:
    """Every rank: the whole inputs from one seed, its zigzag shard through ring attention, and the largest
    differences from the reference on its own tokens."""
    import torch.distributed as dist

    from lightning_colossal.distributed.ring_attention import ring_attention
    from lightning_colossal.parallel.sequence_layout import sequence_positions, shard_sequence

    size, rank = dist.get_world_size(), dist.get_rank()
    layout = case.get("layout", "zigzag")
    dtype = case.get("dtype", torch.float32)
    kv_heads = case.get("kv_heads", HEADS)
    generator = torch.Generator().manual_seed(1234)
    query = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=generator)
    key = torch.randn(BATCH, kv_heads, LENGTH, HEAD_DIM, generator=generator)
    value = torch.randn(BATCH, kv_heads, LENGTH, HEAD_DIM, generator=generator)
    output_gradient = torch.randn(BATCH, HEADS, LENGTH, HEAD_DIM, generator=generator)
    padding = None
    if case.get("padding"):
        padding = torch.rand(BATCH, LENGTH, generator=generator) > 0.3
        padding[1] = False  # a sequence of padding only: every row sees nothing
        padding[0, 0] = True
    whole = [tensor.to(dtype).double().requires_grad_() for tensor in (query, key, value)]
    expected = reference_attention(*whole, case.get("causal", True), case.get("window"), padding)
    expected.backward(output_gradient.to(dtype).double())

    def shard(tensor: torch.Tensor, dim: int = 2) -> torch.Tensor:
        return shard_sequence(tensor, dim, size, rank, layout)

    local = [shard(tensor).to(dtype).detach().requires_grad_() for tensor in (query, key, value)]
    positions = sequence_positions(LENGTH, size, rank, layout)
    output = ring_attention(
        *local,
        dist.group.WORLD,
        query_positions=positions,
        key_positions=positions,
        causal=case.get("causal", True),
        sliding_window=case.get("window"),
        key_padding=None if padding is None else shard(padding, 1),
    )
    output.backward(shard(output_gradient).to(dtype))
    assert output.dtype == dtype and all(tensor.grad.dtype == dtype for tensor in local)
    differences = {"output": (output.double() - shard(expected)).abs().max().item()}
    for name, mine, theirs in zip(("query", "key", "value"), local, whole, strict=True):
        differences[name] = (mine.grad.double() - shard(theirs.grad)).abs().max().item()
    differences["finite"] = float(all(torch.isfinite(t.grad).all() for t in local) and torch.isfinite(output).all())
    return differences


CASES = {
    "causal": {},
    "contiguous_layout": {"layout": "contiguous"},
    "not_causal": {"causal": False},
    "sliding_window": {"window": 5},
    "grouped_query": {"kv_heads": 2},
    "padding": {"padding": True},
    "bf16": {"dtype": torch.bfloat16, "kv_heads": 1, "window": 6},
}


def _assert_close(results: list[dict[str, float]], case: dict[str, Any]) -> None:
    tolerance = 3e-2 if case.get("dtype") == torch.bfloat16 else 1e-5
    for rank, differences in enumerate(results):
        assert differences.pop("finite") == 1.0, f"rank {rank}: non-finite output or gradient"
        for name, difference in differences.items():
            assert difference < tolerance, f"rank {rank}: {name} differs by {difference}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_ring_attention_on_two_ranks_matches_one_process(rank_pool_2, name):
    case = CASES[name]
    _assert_close(rank_pool_2.run(ring_body, case, timeout=120), case)


@pytest.mark.parametrize(
    "name",
    ["causal", pytest.param("padding", marks=pytest.mark.slow), pytest.param("grouped_query", marks=pytest.mark.slow)],
)
def test_ring_attention_on_four_ranks_matches_one_process(rank_pool_4, name):
    case = {**CASES[name], "window": 7} if name == "grouped_query" else CASES[name]
    _assert_close(rank_pool_4.run(ring_body, case, timeout=120), case)


def test_ring_attention_alone_is_local_attention():
    """No group: plain attention, the same code path, still differentiable."""
    from lightning_colossal.distributed.ring_attention import ring_attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(1, 2, 6, 4, generator=generator, requires_grad=True) for _ in range(3))
    positions = torch.arange(6)
    output = ring_attention(query, key, value, None, query_positions=positions, key_positions=positions)
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
    torch.testing.assert_close(output, expected)
    gradients = torch.autograd.grad(output.sum(), (query, key, value))
    expected_gradients = torch.autograd.grad(expected.sum(), (query, key, value))
    for mine, theirs in zip(gradients, expected_gradients, strict=True):
        torch.testing.assert_close(mine, theirs)


def sent_bytes_body(dtype: torch.dtype) -> int:
    """Every rank: the bytes its ring exchanges send in one forward and backward (key/value blocks and gradient
    accumulators, told apart from the positions' all-gather by their tags)."""
    import torch.distributed as dist

    from lightning_colossal.distributed import ring_attention as module
    from lightning_colossal.parallel.sequence_layout import sequence_positions

    size, rank = dist.get_world_size(), dist.get_rank()
    local = LENGTH // size
    query, key, value = (torch.randn(BATCH, HEADS, local, HEAD_DIM, dtype=dtype, requires_grad=True) for _ in "qkv")
    positions = sequence_positions(LENGTH, size, rank, "zigzag")
    sent = []
    original = dist.isend

    def counting(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("tag") in (module._BLOCK_TAG, module._GRADIENT_TAG):
            sent.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    dist.isend = counting
    try:
        output = module.ring_attention(
            query, key, value, dist.group.WORLD, query_positions=positions, key_positions=positions
        )
        output.sum().backward()
    finally:
        dist.isend = original
    return sum(sent)


@pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)], ids=["fp32", "bf16"]
)
def test_the_planner_counts_the_bytes_the_ring_sends(rank_pool_4, dtype):
    from lightning_colossal.planning.activations import Workload, ring_exchange_bytes
    from lightning_colossal.planning.model_state import OPTIMIZERS, Training
    from lightning_colossal.planning.sources import DemoOverrides, demo_model

    shape = demo_model(DemoOverrides(layers=1, hidden=HEADS * HEAD_DIM, heads=HEADS, block_size=LENGTH))
    training = Training("32-true" if dtype == torch.float32 else "bf16-true", OPTIMIZERS["adamw"], "cpu")
    expected = ring_exchange_bytes(shape, training, Workload(BATCH, LENGTH), tp_size=1, sp_size=4)
    assert rank_pool_4.run(sent_bytes_body, dtype, timeout=120) == [expected] * 4


def test_ring_attention_computes_in_fp32_under_autocast():
    """Autocast would run the blocks' matmuls in bf16; the ring turns it off, so 16-bit inputs give the same bits
    inside and outside autocast."""
    from lightning_colossal.distributed.ring_attention import ring_attention

    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(2, 4, 16, 8, generator=generator).bfloat16().requires_grad_() for _ in range(3)]
    positions = torch.arange(16)

    def run() -> list[torch.Tensor]:
        output = ring_attention(*inputs, None, query_positions=positions, key_positions=positions)
        return [output, *torch.autograd.grad(output.float().square().sum(), inputs)]

    plain = run()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = run()
    for expected, got in zip(plain, autocast, strict=True):
        assert torch.equal(expected, got)
