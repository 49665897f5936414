"""Techniques attached as hooks (``parallel/attached.py`` [Note: techniques attach as hooks]), in one process.

With a tensor-parallel group of one, split-gather's hooks are all attached but each collective is the identity, so
the model must compute exactly what it computed before; removing the hooks must give the module back as it was.
The two-rank runs (split and gathered sequences, Ulysses' exchanges) are in
``tests/distributed/test_hybrid_attached_techniques.py``.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_colossal.demo.model import GPT, GPTConfig
from lightning_colossal.demo.parallel_policy import GPTPolicy
from lightning_colossal.parallel.attached import AttachedTechniques
from lightning_colossal.parallel.tensor_parallel import ParallelContext

ALONE_SPLIT_GATHER = ParallelContext(tp_group=None, tp_mesh=None, sp_group=None, split_gather=True)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=32, block_size=16, num_layers=2, num_heads=4, embed_dim=32))


def _hooked_modules(model: nn.Module) -> list[str]:
    """Modules holding any forward hook or any of torch's composable-API state."""
    return [
        name
        for name, module in model.named_modules()
        if module._forward_pre_hooks
        or module._forward_hooks
        or any(key.startswith("__composable_api") for key in vars(module))
    ]


def _output_and_gradients(model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    output = model(inputs)
    logits = output if isinstance(output, torch.Tensor) else output.logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {name: parameter.grad.clone() for name, parameter in model.named_parameters()}


def _assert_same_run(got: Any, expected: Any) -> None:
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    assert got[1].keys() == expected[1].keys()
    for name, gradient in expected[1].items():
        torch.testing.assert_close(got[1][name], gradient, rtol=1e-6, atol=1e-7, msg=name)


def test_gpt_techniques_are_hooks_that_leave_the_model_as_printed_and_come_off():
    model = _gpt()
    printed, names = repr(model), [name for name, _ in model.named_parameters()]
    inputs = torch.randint(0, 32, (2, 16))
    before = _output_and_gradients(model, inputs)

    policy = GPTPolicy()
    plan = policy.parallelize(model, ALONE_SPLIT_GATHER)
    recomputed = policy.wrap_layers_for_recomputation(model)
    # No wrapper module: parameters keep their names and the model's own forward runs; print(model) names what was
    # attached on the modules carrying it, and class names and isinstance stay the model's.
    assert repr(model) != printed
    assert "attached: activation checkpointing" in repr(model.blocks[0]).splitlines()[1]
    assert "attached: sequence parallelism: this rank's positions" in repr(model.position_embedding)
    assert type(model.blocks[0]).__name__ == "Block" and isinstance(model.blocks[0], type(_gpt().blocks[0]))
    assert [name for name, _ in model.named_parameters()] == names
    assert "forward" not in vars(model) and not any("forward" in vars(module) for module in model.modules())
    # What was attached where, in words.
    assert plan.attached.techniques_on(model.position_embedding) == ["sequence parallelism: this rank's positions"]
    assert recomputed.techniques_on(model.blocks[0]) == ["activation checkpointing"]
    assert "Block: activation checkpointing" in repr(recomputed)
    _assert_same_run(_output_and_gradients(model, inputs), before)

    recomputed.remove()
    plan.attached.remove()
    assert len(plan.attached) == len(recomputed) == 0
    assert _hooked_modules(model) == []
    # Every module has its own class back and prints as before.
    assert repr(model) == printed
    assert {type(module) for module in model.modules()} == {type(module) for module in _gpt().modules()}
    _assert_same_run(_output_and_gradients(model, inputs), before)
    # Taken off completely: torch's composable checkpoint accepts the layers again.
    again = policy.wrap_layers_for_recomputation(model)
    _assert_same_run(_output_and_gradients(model, inputs), before)
    again.remove()
    assert _hooked_modules(model) == []


def test_checkpointed_layers_run_again_in_backward():
    model = _gpt()
    calls = []
    # A pre-hook: torch stops a recomputation as soon as it has what backward needs, before the block's end.
    model.blocks[0].mlp.register_forward_pre_hook(lambda module, args: calls.append(args[0].shape))
    recomputed = GPTPolicy().wrap_layers_for_recomputation(model)
    model(torch.randint(0, 32, (2, 16))).sum().backward()
    assert len(calls) == 2  # the forward, then its recomputation in backward
    recomputed.remove()
    calls.clear()
    model(torch.randint(0, 32, (2, 16))).sum().backward()
    assert len(calls) == 1


def test_removing_takes_off_the_last_attached_first_and_extend_moves_hooks():
    layer = nn.Linear(4, 4)
    order: list[str] = []
    first, second = AttachedTechniques(), AttachedTechniques()
    first.before_forward(layer, "one", lambda module, args, kwargs: order.append("one"))
    second.after_forward(layer, "two", lambda module, args, output: order.append("two"))
    first.extend(second)
    assert len(second) == 0 and first.techniques_on(layer) == ["one", "two"]
    layer(torch.zeros(1, 4))
    assert order == ["one", "two"]
    first.remove()
    assert not layer._forward_pre_hooks and not layer._forward_hooks and repr(first) == "AttachedTechniques()"


def _llama(tie_weights: bool = False) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
        attn_implementation="eager",
        tie_word_embeddings=tie_weights,
    )
    return LlamaForCausalLM(config)


def test_huggingface_split_gather_runs_the_library_forward_with_hooks_that_come_off():
    pytest.importorskip("transformers")
    from lightning_colossal.parallel.huggingface import HuggingFacePlanPolicy

    model = _llama()
    reference = copy.deepcopy(model)
    base_forward = type(model.model).forward
    inputs = torch.randint(0, 64, (2, 16))
    before = _output_and_gradients(reference, inputs)

    policy = HuggingFacePlanPolicy()
    plan = policy.parallelize(model, ALONE_SPLIT_GATHER)
    recomputed = policy.wrap_layers_for_recomputation(model)
    assert "attached: split-gather: split the sequence, activation checkpointing" in repr(model.model.layers[0])
    assert "attached: split-gather: no KV cache" in repr(model.model).splitlines()[1]
    assert (
        type(model.model).__name__ == "LlamaModel"
        and type(model.model).forward is base_forward
        and "forward" not in vars(model.model)
    )
    assert plan.attached.techniques_on(model.model.layers[0]) == ["split-gather: split the sequence"]
    assert plan.attached.techniques_on(model.model.layers[1].self_attn) == ["split-gather: gather the sequence"]
    assert plan.attached.techniques_on(model.model.norm) == ["split-gather: gather the sequence for the whole head"]
    _assert_same_run(_output_and_gradients(model, inputs), before)
    # Without a KV cache, as the split sequence needs, whatever the config says.
    assert model.config.use_cache and model(inputs).past_key_values is None
    from transformers import DynamicCache

    with pytest.raises(ValueError, match="without a KV cache"):
        model(inputs, cache=DynamicCache(config=model.config))

    recomputed.remove()
    plan.attached.remove()
    assert _hooked_modules(model) == _hooked_modules(reference)
    assert repr(model) == repr(reference)
    _assert_same_run(_output_and_gradients(model, inputs), before)


def test_a_module_with_a_listed_technique_pickles_and_copies_as_its_own_class():
    import pickle

    layer = nn.Linear(3, 3)
    attached = AttachedTechniques()
    attached.changed(layer, "a setting swapped", lambda: None)
    assert "attached: a setting swapped" in repr(layer) and type(layer) is not nn.Linear
    for copied in (pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)):
        assert type(copied) is nn.Linear and "_attached_techniques" not in vars(copied)
        assert torch.equal(copied.weight, layer.weight) and repr(copied) == repr(nn.Linear(3, 3))
    assert "attached: a setting swapped" in repr(layer)  # the original keeps its listing
    attached.remove()
    assert type(layer) is nn.Linear
