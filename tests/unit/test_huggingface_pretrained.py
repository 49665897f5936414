"""`pretrained_on_meta` in one process: key matching (base-model prefix, tied head), parameters the files lack, and
the errors that say the fix. The strategies' reads are tested in tests/distributed/test_huggingface_pretrained_on_meta.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_colossal.engine_parts.pretrained import READS, materialise_whole
from lightning_colossal.huggingface import pretrained_on_meta

transformers = pytest.importorskip("transformers")


def _config(tied: bool) -> object:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=16,
        tie_word_embeddings=tied,
    )


def _materialised(model: nn.Module) -> nn.Module:
    root = nn.Module()
    root.model = model
    materialise_whole(root, torch.device("cpu"))
    return model


def test_a_base_model_checkpoint_fills_the_task_model_and_its_tied_head(tmp_path):
    torch.manual_seed(0)
    base = transformers.LlamaModel(_config(tied=True))
    base.save_pretrained(tmp_path)  # keys without the `model.` prefix, in one model.safetensors
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every tensor found: nothing to warn about
        model = pretrained_on_meta(tmp_path, transformers.LlamaForCausalLM)
    assert all(parameter.is_meta for parameter in model.parameters())
    READS.reset()
    _materialised(model)
    assert READS.bytes == sum(tensor.numel() * 4 for tensor in base.state_dict().values())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for name, tensor in base.state_dict().items():
        assert torch.equal(model.model.state_dict()[name], tensor), name
    # The rotary frequencies (a non-persistent buffer, never in the files) come from the model's initialiser.
    assert torch.equal(model.model.rotary_emb.inv_freq, base.rotary_emb.inv_freq)


def test_a_parameter_the_files_lack_is_drawn_with_a_warning_or_refused_when_strict(tmp_path):
    transformers.LlamaModel(_config(tied=False)).save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match=r"does not hold.*\['lm_head.weight'\]"):
        model = pretrained_on_meta(tmp_path, transformers.LlamaForCausalLM)
    assert model.pretrained_weights.absent_parameters == ("lm_head.weight",)
    torch.manual_seed(1)
    _materialised(model)
    assert torch.isfinite(model.lm_head.weight).all() and model.lm_head.weight.std() > 0
    with pytest.raises(ValueError, match=r"lm_head.weight.*strict=False"):
        pretrained_on_meta(tmp_path, transformers.LlamaForCausalLM, strict=True)


def test_a_directory_without_safetensors_says_how_to_make_them(tmp_path):
    _config(tied=True).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="save_pretrained"):
        pretrained_on_meta(tmp_path)


def test_dtype_overrides_the_configuration_and_values_are_converted(tmp_path):
    torch.manual_seed(0)
    source = transformers.LlamaForCausalLM(_config(tied=True))
    source.save_pretrained(tmp_path)
    model = _materialised(pretrained_on_meta(tmp_path, dtype=torch.bfloat16))
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(model.model.embed_tokens.weight, source.model.embed_tokens.weight.to(torch.bfloat16))
