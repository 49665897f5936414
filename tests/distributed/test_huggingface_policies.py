"""The built-in tensor-parallel family plans (``parallel/huggingface/families.py``) at tp2, one forward and backward.

Each case splits a tiny Hugging Face model over 2 gloo ranks with the policy ``find_policy`` picks (no strategy, no
optimizer) and compares the loss and every parameter's whole gradient (split ones gathered, partial ones summed as
the engine does) with the unsplit model's on the same batch. This covers config variants the zoo
(``test_huggingface_zoo.py``, the families' default configs trained end to end) does not: Falcon's three attention
layouts and ALiBi, T5's gated MLP, Phi-3 with as many key/value heads as query heads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

VOCAB = 64
#: Weights large enough that attention is far from uniform: a per-head bias (ALiBi) given to the wrong heads changes
#: the gradients by far more than the tolerance (at the default 0.02, by ~1e-5).
STRONG_INIT = 0.3


def _falcon(**overrides: Any) -> nn.Module:
    settings: dict[str, Any] = {
        "vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "hidden_dropout": 0.0, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0, "bias": True,
        "initializer_range": STRONG_INIT,
    }  # fmt: skip
    settings.update(overrides)
    return transformers.FalconForCausalLM(transformers.FalconConfig(**settings))


def _t5_gated() -> nn.Module:
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1, num_heads=4,
        dropout_rate=0.0, feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(config)


def _phi3_full_heads() -> nn.Module:
    config = transformers.Phi3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=32, pad_token_id=0, bos_token_id=0, eos_token_id=0,
        initializer_range=STRONG_INIT,
    )  # fmt: skip
    return transformers.Phi3ForCausalLM(config)


def _bloom() -> nn.Module:
    config = transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=STRONG_INIT,
    )  # fmt: skip
    return transformers.BloomForCausalLM(config)


CASES: dict[str, Callable[[], nn.Module]] = {
    "bloom": _bloom,
    "falcon-multi-query": lambda: _falcon(),
    "falcon-multi-query-alibi": lambda: _falcon(alibi=True),
    "falcon-multi-head": lambda: _falcon(multi_query=False),
    "falcon-new-architecture": lambda: _falcon(new_decoder_architecture=True, num_kv_heads=2),
    "t5-gated": _t5_gated,
    "phi3-full-heads": _phi3_full_heads,
}


def _batch(case: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    input_ids = torch.randint(2, VOCAB, (2, 8), generator=generator)
    if case.startswith("t5"):
        return {"input_ids": input_ids, "labels": torch.randint(2, VOCAB, (2, 8), generator=generator)}
    return {"input_ids": input_ids, "labels": input_ids}


def whole_gradients_body(case: str) -> dict[str, Any]:
    """On each rank: the unsplit model's loss and gradients, and the split model's, made whole."""
    from lightning_colossal.parallel.policies import find_policy
    from lightning_colossal.parallel.tensor_parallel import ParallelContext, full_from_shards

    torch.manual_seed(3)
    whole = CASES[case]()
    split = copy.deepcopy(whole)
    whole_loss = whole(**_batch(case)).loss
    whole_loss.backward()
    group = torch.distributed.group.WORLD
    model, policy = find_policy(split, None)
    plan = policy.parallelize(model, ParallelContext(tp_group=group, tp_mesh=None, sp_group=None))
    split_loss = split(**_batch(case)).loss
    split_loss.backward()
    partial = {id(parameter) for parameter in plan.partial_gradients}
    gradients = {}
    for name, parameter in split.named_parameters():
        gradient = parameter.grad.detach().clone()
        if id(parameter) in partial:
            torch.distributed.all_reduce(gradient, group=group)
        placement = plan.placements.get(id(parameter))
        gradients[name] = gradient if placement is None else full_from_shards(gradient, placement, group)
    expected = {name: parameter.grad for name, parameter in whole.named_parameters()}
    return {
        "policy": policy.name,
        "losses": (whole_loss.item(), split_loss.item()),
        "gradients": gradients,
        "expected": expected,
    }


@pytest.mark.parametrize("case", list(CASES))
def test_split_model_computes_the_whole_models_loss_and_gradients(rank_pool_2, case):
    for result in rank_pool_2.run(whole_gradients_body, case, timeout=60):
        assert "family plans" in result["policy"]
        whole_loss, split_loss = result["losses"]
        assert split_loss == pytest.approx(whole_loss, rel=1e-5)
        assert set(result["gradients"]) == set(result["expected"])
        torch.testing.assert_close(result["gradients"], result["expected"], rtol=1e-4, atol=1e-5)


def test_bloom_slicing_its_own_output_weights_is_refused_with_the_fix():
    from lightning_colossal.parallel.huggingface import FAMILY_PLANS

    config = transformers.BloomConfig(n_head=4, hidden_size=32, pretraining_tp=2, slow_but_exact=True)
    with pytest.raises(ValueError, match="slow_but_exact=False"):
        FAMILY_PLANS["bloom"](config)
