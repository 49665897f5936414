"""Checkpoints out to Hugging Face: `consolidate --format huggingface` writes a directory that
`AutoModelForCausalLM.from_pretrained` loads, with the weights the strategy trained, in several safetensors shards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_colossal.consolidate import main as consolidate_main
from tests.distributed.test_huggingface import LlamaModule, tiny_llama_config

transformers = pytest.importorskip("transformers")


class TwoHeadLlamaModule(LlamaModule):
    """Two key/value heads, so tensor parallelism over 2 ranks can split them."""

    def configure_model(self) -> None:
        if self.model is None:
            config = tiny_llama_config()
            config.num_key_value_heads = 2
            self.model = transformers.LlamaForCausalLM(config)


def train_and_save_body(strategy_spec: tuple[str, dict[str, Any]], path: str) -> dict[str, torch.Tensor]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal import (
        ColossalDDPStrategy,
        ColossalFSDPStrategy,
        GeminiStrategy,
        HybridParallelStrategy,
        ZeroStrategy,
    )
    from lightning_colossal.demo.data import RandomTokenDataset
    from tests.distributed.oracle import quiet_trainer

    kind, arguments = strategy_spec
    strategy = {
        "ddp": ColossalDDPStrategy,
        "zero": ZeroStrategy,
        "gemini": GeminiStrategy,
        "fsdp": ColossalFSDPStrategy,
        "hybrid": HybridParallelStrategy,
    }[kind](**arguments)
    seed_everything(11, verbose=False)
    module = TwoHeadLlamaModule()
    loader = DataLoader(RandomTokenDataset(num_samples=16, block_size=16, vocab_size=64, seed=2), batch_size=4)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=2)
    trainer.fit(module, train_dataloaders=loader)
    trainer.save_checkpoint(path)
    return {name: tensor.detach().float().clone() for name, tensor in strategy.full_model_state_dict().items()}


@pytest.mark.parametrize(
    "strategy_spec",
    [("ddp", {}), ("zero", {"stage": 2}), ("gemini", {"chunk_numel": 3000}), ("fsdp", {}), ("hybrid", {"tp_size": 2})],
    ids=["ddp", "zero2", "gemini", "fsdp", "hybrid_tp2"],
)
def test_export_loads_with_from_pretrained(rank_pool_2, tmp_path, strategy_spec):
    path = tmp_path / "trained.ckpt"
    trained = rank_pool_2.run(train_and_save_body, strategy_spec, str(path))[0]
    output = tmp_path / "hf"
    # A small shard size forces several files and the index, as a large model gets.
    assert consolidate_main([str(path), str(output), "--format", "huggingface", "--max-shard-size", "20KB"]) == 0
    index = json.loads((output / "model.safetensors.index.json").read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 1 and all((output / name).is_file() for name in shard_files)
    assert json.loads((output / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(output)
    assert isinstance(loaded, transformers.LlamaForCausalLM)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight, "the tie survives the export"
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, trained[f"model.{name}"], rtol=0, atol=0)


def test_export_refuses_a_checkpoint_without_a_huggingface_model(tmp_path, capsys):
    from lightning_colossal.checkpoint.sharded import save_sharded

    path = tmp_path / "plain.ckpt"
    save_sharded(path, {"model": {"layer.weight": torch.ones(2, 2)}}, {"epoch": 0})
    assert consolidate_main([str(path), str(tmp_path / "out"), "--format", "huggingface"]) == 2
    assert "--config-dir" in capsys.readouterr().err
    config_dir = tmp_path / "config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text("{}")
    assert (
        consolidate_main([str(path), str(tmp_path / "out"), "--format", "huggingface", "--config-dir", str(config_dir)])
        == 0
    )
    assert Path(tmp_path / "out" / "model.safetensors").is_file()


class PretrainedLlamaModule(LlamaModule):
    """Loads the model the way Hugging Face users do: `from_pretrained` of a local directory in configure_model."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def configure_model(self) -> None:
        if self.model is None:
            self.model = transformers.AutoModelForCausalLM.from_pretrained(self.directory)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # A zero learning rate: after fit the weights must still be exactly the pretrained ones.
        return torch.optim.SGD(self.parameters(), lr=0.0)


def from_pretrained_body(strategy_spec: tuple[str, dict[str, Any]], directory: str) -> dict[str, torch.Tensor]:
    from torch.utils.data import DataLoader

    from lightning_colossal import (
        ColossalDDPStrategy,
        ColossalFSDPStrategy,
        GeminiStrategy,
        HybridParallelStrategy,
        ZeroStrategy,
    )
    from lightning_colossal.demo.data import RandomTokenDataset
    from tests.distributed.oracle import quiet_trainer

    kind, arguments = strategy_spec
    strategy = {
        "ddp": ColossalDDPStrategy,
        "zero": ZeroStrategy,
        "gemini": GeminiStrategy,
        "fsdp": ColossalFSDPStrategy,
        "hybrid": HybridParallelStrategy,
    }[kind](**arguments)
    module = PretrainedLlamaModule(directory)
    loader = DataLoader(RandomTokenDataset(num_samples=16, block_size=16, vocab_size=64, seed=2), batch_size=4)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=2)
    trainer.fit(module, train_dataloaders=loader)
    return {name: tensor.detach().float().clone() for name, tensor in strategy.full_model_state_dict().items()}


@pytest.mark.parametrize(
    "strategy_spec",
    [("ddp", {}), ("zero", {"stage": 2}), ("gemini", {"chunk_numel": 3000}), ("fsdp", {}), ("hybrid", {"tp_size": 2})],
    ids=["ddp", "zero2", "gemini", "fsdp", "hybrid_tp2"],
)
def test_from_pretrained_in_configure_model(rank_pool_2, tmp_path, strategy_spec):
    torch.manual_seed(3)
    config = tiny_llama_config()
    config.num_key_value_heads = 2
    pretrained = transformers.LlamaForCausalLM(config)
    pretrained.save_pretrained(tmp_path / "pretrained")
    results = rank_pool_2.run(from_pretrained_body, strategy_spec, str(tmp_path / "pretrained"))
    for result in results:
        for name, tensor in pretrained.state_dict().items():
            torch.testing.assert_close(result[f"model.{name}"], tensor, rtol=0, atol=0)
