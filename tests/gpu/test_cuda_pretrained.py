"""CUDA-only check of `pretrained_on_meta` (skipped without a GPU): a Hugging Face Llama read from its safetensors
files straight into a meta-device model, under the strategies that materialise such models on a GPU (FSDP2 with and
without CPU offload, Gemini with everything offloaded, hybrid), starts from exactly the files' weights and trains like
`from_pretrained` built eagerly. Each run is a fresh interpreter."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.fresh_interpreter import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
transformers = pytest.importorskip("transformers")

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from torch.utils.data import DataLoader
    from lightning_colossal.demo.data import RandomTokenDataset
    from tests.distributed.oracle import quiet_trainer
    from tests.distributed.test_huggingface_pretrained_on_meta import MetaPretrainedLlamaModule, _float_copy, _strategy

    kind, offload, directory, out = sys.argv[1], sys.argv[2] == "offload", sys.argv[3], sys.argv[4]
    arguments = {"cpu_offload": True} if kind == "fsdp" and offload else {"offload": True} if offload else {}
    results = {}
    for eager in (False, True):
        module = MetaPretrainedLlamaModule(directory, eager)
        loader = DataLoader(RandomTokenDataset(num_samples=8, block_size=16, vocab_size=64, seed=2), batch_size=2)
        trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=_strategy(kind, arguments), max_steps=2)
        trainer.fit(module, train_dataloaders=loader)
        results["eager" if eager else "meta"] = {
            "starting": module.starting_state,
            "trained": _float_copy(trainer.strategy.full_model_state_dict()),
        }
    torch.save(results, out)
    """
)


@pytest.mark.parametrize(
    ("kind", "offload"), [("fsdp", "offload"), ("fsdp", "plain"), ("gemini", "offload"), ("hybrid", "plain")]
)
def test_pretrained_on_meta_on_cuda_starts_from_the_files_and_trains_like_from_pretrained(tmp_path, kind, offload):
    torch.manual_seed(3)
    from tests.distributed.test_huggingface import tiny_llama_config

    config = tiny_llama_config()
    config.num_key_value_heads = 2
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "pretrained", max_shard_size="20KB")
    stored = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "pretrained").state_dict()
    run_script(tmp_path, SCRIPT, kind, offload, str(tmp_path / "pretrained"), str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt")
    for name, tensor in results["meta"]["starting"].items():
        torch.testing.assert_close(tensor, stored[name.removeprefix("model.")].float(), rtol=0, atol=0, msg=name)
    trained, starting = results["meta"]["trained"], results["meta"]["starting"]
    assert any(not torch.equal(trained[name], starting[name]) for name in starting), "nothing trained"
    for name, tensor in results["eager"]["trained"].items():
        torch.testing.assert_close(trained[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
