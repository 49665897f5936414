"""Every part of ``transformers`` the Hugging Face policies rely on beyond its documented API, one test each, on the
installed release ([Note: transformers internals] in ``parallel/huggingface/internals.py``).

A new ``transformers`` release that moves one of them fails the test named for it here, before the thirty oracle
tests that would fail downstream of it. In one process, on tiny models: no rank pool.
"""

from __future__ import annotations

import functools
import re
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lightning_colossal.parallel.huggingface import internals, sequence  # noqa: E402
from lightning_colossal.parallel.huggingface.base_model import base_model, no_cache  # noqa: E402
from lightning_colossal.parallel.huggingface.families import FAMILY_PLANS, _matching  # noqa: E402

REPOSITORY = Path(__file__).resolve().parents[2]
LENGTH = 8


def tiny_llama(**overrides) -> torch.nn.Module:
    settings = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    settings.update(overrides)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**settings))


@pytest.fixture
def registered():
    """Register attention and mask functions under a fresh name for one test; unregistered after it."""
    names = []

    def register(attention, mask):
        name = f"internals_test_{len(names)}"
        internals.register_attention(name, attention, mask, "This test")
        names.append(name)
        return name

    yield register
    for name in names:
        internals.unregister_attention(name)


# ------------------------------------------------------------------------------------------------ the range
def test_the_installed_transformers_is_in_the_tested_range():
    version = internals.installed_version()
    assert internals.within_tested_range(version), (
        f"transformers {version} is outside the tested range {internals.TESTED_TRANSFORMERS}: run the whole suite on"
        " it, then widen TESTED_TRANSFORMERS, the test extra in pyproject.toml and docs/huggingface.md together."
    )


def test_the_test_extra_and_the_docs_name_the_tested_range():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPOSITORY / "pyproject.toml").read_text())["project"]
    pinned = [line for line in project["optional-dependencies"]["test"] if line.startswith("transformers")]
    assert pinned == [f"transformers{internals.TESTED_TRANSFORMERS}"]
    assert f"transformers{internals.TESTED_TRANSFORMERS}" in (REPOSITORY / "docs" / "huggingface.md").read_text()


def test_an_untested_release_is_named_once_and_a_missing_internal_names_the_range(monkeypatch):
    monkeypatch.setattr(internals, "installed_version", lambda: "99.0.0")
    internals.warn_if_untested.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            internals.warn_if_untested()
            internals.warn_if_untested()
        assert len(caught) == 1 and "transformers 99.0.0 is installed" in str(caught[0].message)
    finally:
        internals.warn_if_untested.cache_clear()
    from transformers.loss import loss_utils

    monkeypatch.delitem(loss_utils.LOSS_MAPPING, "ForCausalLM")
    with pytest.raises(internals.TransformersInternalsError, match=re.escape(internals.TESTED_TRANSFORMERS)):
        internals.causal_lm_loss("Sequence parallelism")


# ------------------------------------------------------------------------------------------------ attention
def test_a_registered_attention_is_what_a_model_runs_and_is_gone_once_unregistered(registered):
    """Sequence parallelism swaps ``config._attn_implementation`` for a name it registered: the model's attention
    function and mask builder are then looked up under it, with the arguments the Ulysses and ring functions take."""
    seen = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        seen["attention"] = (query.shape, key.shape, attention_mask, scaling, dropout)
        output, _ = internals.sdpa_attention("This test")(module, query, key, value, None, scaling=scaling, **kwargs)
        return output, None

    def mask(*, batch_size, q_length, kv_length, mask_function, attention_mask=None, device="cpu", **kwargs):
        seen["mask"] = (batch_size, q_length, kv_length, callable(mask_function), attention_mask)
        return "the mask"

    model = tiny_llama()
    name = registered(attention, mask)
    model.config._attn_implementation = name
    tokens = torch.randint(0, 64, (2, LENGTH))
    model(input_ids=tokens)
    heads, kv_heads, dim = 4, 2, 8
    assert seen["attention"][:3] == ((2, heads, LENGTH, dim), (2, kv_heads, LENGTH, dim), "the mask")
    assert seen["mask"] == (2, LENGTH, LENGTH, True, None)
    assert type(model)._supports_attention_backend  # what sequence.uses_attention_interface reads
    assert internals.is_registered(name)
    internals.unregister_attention(name)
    assert not internals.is_registered(name)


def test_the_attention_functions_take_grouped_key_value_heads_and_return_sequence_major():
    """``sdpa_attention_forward`` takes ``[batch, heads, sequence, dim]`` with fewer key/value heads (grouped by
    ``module.num_key_value_groups``, which Ulysses changes for replicated heads and the Falcon plan recounts) and
    returns ``[batch, sequence, heads, dim]``, as the ring and Ulysses functions do."""
    attention = tiny_llama().model.layers[0].self_attn
    assert attention.num_key_value_groups == 2
    query, key, value = torch.randn(1, 4, LENGTH, 8), torch.randn(1, 2, LENGTH, 8), torch.randn(1, 2, LENGTH, 8)
    output, _ = internals.sdpa_attention("This test")(attention, query, key, value, None, scaling=0.5, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), is_causal=True, scale=0.5
    )
    torch.testing.assert_close(output, expected.transpose(1, 2))


def test_falcon_multi_query_attention_caches_a_count_the_split_recounts():
    falcon = transformers.FalconForCausalLM(
        transformers.FalconConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    attention = falcon.transformer.h[0].self_attention
    assert (attention.num_heads, attention.num_kv_heads) == (4, 1)
    if hasattr(attention, "num_key_value_groups"):  # 5.25: Falcon runs the shared attention functions
        assert attention.num_key_value_groups == 4


@pytest.mark.parametrize("model_type", sorted(FAMILY_PLANS))
def test_each_family_has_the_attention_attributes_its_plan_divides(model_type):
    config = transformers.AutoConfig.for_model(model_type)
    for attribute, value in dict(
        hidden_size=32, d_model=32, d_kv=8, d_ff=64, intermediate_size=64, num_attention_heads=4, num_heads=4,
        n_head=4, num_key_value_heads=2, num_hidden_layers=1, num_layers=1, n_layer=1, ffn_dim=64, vocab_size=64,
        image_size=8, patch_size=4, num_experts=2, word_embed_proj_dim=32, pad_token_id=0,
    ).items():  # fmt: skip
        if hasattr(config, attribute):
            setattr(config, attribute, value)
    model = transformers.AutoModel.from_config(config)
    family = FAMILY_PLANS[model_type](config)
    base, _ = base_model(model)
    for pattern, attributes in family.head_attributes.items():
        modules = _matching(base, pattern)
        assert modules or pattern.endswith("EncDecAttention"), pattern
        for module in modules:
            for attribute in attributes:
                assert isinstance(getattr(module, attribute, None), int), f"{type(module).__name__}.{attribute}"
    for pattern, attributes in family.local_config.items():
        for module in _matching(base, pattern):
            for attribute in attributes:
                assert hasattr(module.config, attribute), f"{type(module).__name__}.config.{attribute}"
    for pattern, (query_heads, key_value_heads) in family.key_value_groups.items():
        for module in _matching(base, pattern):
            assert hasattr(module, query_heads) and hasattr(module, key_value_heads)


# ------------------------------------------------------------------------------------------------ masks
def _ring_reading(registered, config, attention_mask, position_ids, builder) -> sequence.RingMask:
    """What the ring mask function reads of the mask ``builder`` asks for, through the real mask-making path."""
    name = registered(lambda *args, **kwargs: None, functools.partial(sequence._ring_mask, None))
    config._attn_implementation = name
    arguments = dict(config=config, inputs_embeds=torch.zeros(2, LENGTH, 4), attention_mask=attention_mask)
    arguments.update(no_cache(builder))
    return builder(**arguments, position_ids=position_ids)


def test_mask_functions_are_index_based_and_read_as_causal_sliding_or_bidirectional(registered):
    """The ring mask function evaluates ``mask_function`` on index tensors to tell the three patterns apart."""
    create_causal_mask, create_sliding_window_causal_mask = internals.causal_mask_builders("This test")
    positions = torch.arange(LENGTH).unsqueeze(0)
    padding = torch.ones(2, LENGTH, dtype=torch.bool)
    causal = _ring_reading(registered, tiny_llama().config, padding, positions, create_causal_mask)
    assert (causal.causal, causal.sliding_window) == (True, None)
    windowed_config = transformers.MistralConfig(sliding_window=3, attn_implementation="sdpa")
    windowed = _ring_reading(registered, windowed_config, padding, positions, create_sliding_window_causal_mask)
    assert (windowed.causal, windowed.sliding_window) == (True, 3)
    from transformers.masking_utils import create_bidirectional_mask

    both_ways = _ring_reading(registered, tiny_llama().config, padding, positions, create_bidirectional_mask)
    assert both_ways.causal is False


def test_without_a_padding_mask_positions_that_jump_are_read_as_packed_sequences(registered):
    """[Note: ring attention is always given a padding mask]: a zigzag slice's positions jump; without a mask the
    mask asked for is the packed-sequence one, with the bool mask ring attention supplies it is plain causal, and that
    mask reaches the mask function as the same tensor (so it is read as no padding)."""
    create_causal_mask, _ = internals.causal_mask_builders("This test")
    zigzag = torch.cat([torch.arange(4), torch.arange(12, 16)]).unsqueeze(0)
    with pytest.raises(ValueError, match="another mask pattern"):
        _ring_reading(registered, tiny_llama().config, None, zigzag, create_causal_mask)
    supplied = sequence._no_padding(torch.Size((2, LENGTH)), torch.device("cpu"))
    reading = _ring_reading(registered, tiny_llama().config, supplied, zigzag, create_causal_mask)
    assert reading.causal and reading.padding is None
    real_padding = torch.ones(2, LENGTH, dtype=torch.bool)
    assert _ring_reading(registered, tiny_llama().config, real_padding, zigzag, create_causal_mask).padding is not None


def test_the_mask_builders_take_what_the_mask_interface_hands_on(registered):
    """Ulysses builds the whole sequence's mask with the configured implementation's builder from the keyword
    arguments ``transformers`` gave its registered mask function."""
    handed = {}

    def mask(**kwargs):
        handed.update(kwargs)
        return internals.mask_builder("sdpa", "This test")(**kwargs)

    config = tiny_llama().config
    padding = torch.ones(2, LENGTH, dtype=torch.long)
    padding[0, -3:] = 0
    create_causal_mask, _ = internals.causal_mask_builders("This test")
    arguments = dict(config=config, inputs_embeds=torch.zeros(2, LENGTH, 4), attention_mask=padding)
    arguments.update(no_cache(create_causal_mask))
    expected = create_causal_mask(**arguments)
    config._attn_implementation = registered(lambda *args, **kwargs: None, mask)
    built = create_causal_mask(**arguments)
    assert {"batch_size", "q_length", "kv_length", "attention_mask", "mask_function"} <= set(handed)
    assert torch.equal(built, expected)
    assert callable(internals.mask_builder("eager", "This test"))


# ------------------------------------------------------------------------------------------------ loss
def test_the_causal_lm_loss_takes_labels_shifted_already_and_the_count_to_divide_by():
    model = tiny_llama()
    loss_function = internals.causal_lm_loss("This test")
    assert model.loss_function is loss_function
    logits = torch.randn(1, LENGTH, 64)
    shifted = torch.randint(0, 64, (1, LENGTH))
    shifted[0, -1] = -100
    summed = torch.nn.functional.cross_entropy(logits[0, :-1], shifted[0, :-1], reduction="sum")
    loss = loss_function(logits, None, 64, shift_labels=shifted, num_items_in_batch=torch.tensor(3.5))
    torch.testing.assert_close(loss, summed / 3.5)


def test_no_cache_names_the_keyword_the_mask_builders_take():
    create_causal_mask, create_sliding_window_causal_mask = internals.causal_mask_builders("This test")
    for builder in (create_causal_mask, create_sliding_window_causal_mask):
        (keyword,) = no_cache(builder)
        assert keyword in ("cache", "past_key_values")
