"""Sequence parallelism and activation checkpointing attached as hooks (``parallel/attached.py`` [Note: techniques
attach as hooks]) on two ranks: ``colossal_hybrid`` with ``activation_checkpointing=True`` against the
single-process oracle, and Ulysses' exchanges attached to and taken off the demo GPT.

Activation checkpointing recomputes each layer in backward by calling it again, so the hooks on and inside the layer
run a second time: split-gather's split before a Hugging Face decoder's first layer must leave the shard it already
made alone, and the gathers and Ulysses' exchanges inside the layer must run again.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import hybrid_bodies as bodies
from tests.distributed.test_hybrid_oracle import _assert_matches

STEPS = 3

CHECKPOINTED = {
    "gpt_tp2": ({"tp_size": 2}, {}),
    "gpt_tp2_split_gather": ({"tp_size": 2, "sequence_parallel": "split_gather"}, {}),
    "gpt_sp2_ulysses": ({"sp_size": 2}, {}),
    "gpt_pp2": ({"pp_size": 2, "num_microbatches": 2}, {}),
    "llama_tp2_split_gather": ({"tp_size": 2, "sequence_parallel": "split_gather"}, {"kind": "llama"}),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTED))
def test_activation_checkpointing_trains_like_one_process(rank_pool_2, case):
    strategy_kwargs, module_kwargs = CHECKPOINTED[case]
    if module_kwargs.get("kind") == "llama":
        pytest.importorskip("transformers")
    strategy_kwargs = {**strategy_kwargs, "activation_checkpointing": True}
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, module_kwargs, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, **module_kwargs))


def ulysses_attached_and_removed_body() -> dict[str, Any]:
    """The GPT before, under and after Ulysses over the world's two ranks, on the same tokens."""
    from lightning_colossal.demo.model import GPT, GPTConfig
    from lightning_colossal.demo.parallel_policy import GPTPolicy
    from lightning_colossal.parallel.tensor_parallel import ParallelContext

    rank = torch.distributed.get_rank()
    torch.manual_seed(0)  # the same model and tokens on both ranks
    model = GPT(GPTConfig(vocab_size=32, block_size=16, num_layers=2, num_heads=4, embed_dim=32))
    tokens = torch.randint(0, 32, (2, 16))
    printed = repr(model)
    with torch.no_grad():
        before = model(tokens)
        plan = GPTPolicy().parallelize(
            model, ParallelContext(tp_group=None, tp_mesh=None, sp_group=torch.distributed.group.WORLD)
        )
        attached = {
            name: plan.attached.techniques_on(model.get_submodule(name))
            for name in ("blocks.1.attn.qkv", "blocks.1.attn.proj", "position_embedding")
        }
        printed_under_ulysses = repr(model)
        # Each rank holds its slice of every sequence; attention still sees every token.
        under_ulysses = model(tokens.chunk(2, dim=1)[rank])
        plan.attached.remove()
        after = model(tokens)
    hooked = [name for name, module in model.named_modules() if module._forward_pre_hooks or module._forward_hooks]
    return {
        "under_ulysses": (under_ulysses, before.chunk(2, dim=1)[rank]),
        "after": (after, before),
        "attached": attached,
        # print(model) names the exchanges while attached, and prints as before once they are off.
        "printed_under_ulysses": printed_under_ulysses,
        "printed_unchanged": printed == repr(model),
        "hooked_after_removal": hooked,
    }


def test_ulysses_exchanges_are_hooks_that_come_off(rank_pool_2):
    results = rank_pool_2.run(ulysses_attached_and_removed_body, timeout=120)
    for result in results:
        torch.testing.assert_close(*result["under_ulysses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(*result["after"], rtol=0, atol=0)
        assert result["attached"] == {
            "blocks.1.attn.qkv": ["Ulysses: sequence shards to head shards"],
            "blocks.1.attn.proj": ["Ulysses: head shards to sequence shards"],
            "position_embedding": ["sequence parallelism: this rank's positions"],
        }
        assert "attached: Ulysses: sequence shards to head shards" in result["printed_under_ulysses"]
        assert result["printed_unchanged"]
        assert result["hooked_after_removal"] == []
