"""Pretrained Hugging Face weights into a meta-device model (`lightning_colossal.huggingface.pretrained_on_meta`):
every strategy starts from exactly the files' weights, trains exactly like `from_pretrained` built eagerly, and under
the sharded strategies each rank reads only its pieces from the safetensors files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed.test_huggingface import LlamaModule, tiny_llama_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# The tiny Llama below (tied head, two key/value heads) stores 90,752 bytes (float32, the tied head once).
WHOLE_MODEL_BYTES = 90_752
# Gemini and FSDP: every tensor's rows split in two (every first dimension is even).
HALF_OF_EVERY_TENSOR = WHOLE_MODEL_BYTES // 2
# Hybrid tp2: the embedding (8,192) and the five norms (640) whole, every projection of both layers halved (40,960).
TENSOR_PARALLEL_PIECES = 8_192 + 640 + 40_960


class MetaPretrainedLlamaModule(LlamaModule):
    """Builds the model on the meta device from the pretrained directory; the engine reads each rank's pieces."""

    def __init__(self, directory: str, eager: bool) -> None:
        super().__init__()
        self.directory = directory
        self.eager = eager
        self.starting_state: dict[str, torch.Tensor] = {}

    def configure_model(self) -> None:
        from lightning_colossal.huggingface import pretrained_on_meta

        if self.model is None:
            if self.eager:
                self.model = transformers.AutoModelForCausalLM.from_pretrained(self.directory)
            else:
                self.model = pretrained_on_meta(self.directory, transformers.AutoModelForCausalLM)

    def on_train_start(self) -> None:
        # After set-up, before the first step: the whole weights gathered from the shards (a collective).
        self.starting_state = _float_copy(self.trainer.strategy.full_model_state_dict())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _float_copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().float().clone() for name, tensor in state.items()}


def _strategy(kind: str, arguments: dict[str, Any]) -> Any:
    from lightning_colossal import (
        ColossalDDPStrategy,
        ColossalFSDPStrategy,
        GeminiStrategy,
        HybridParallelStrategy,
        ZeroStrategy,
    )
    from lightning_colossal.config import StaticPlacement

    if arguments.get("offload"):  # parameter shards, masters and optimizer state in CPU memory
        placement = StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)
        arguments = {**{key: value for key, value in arguments.items() if key != "offload"}, "placement": placement}
    classes = {
        "ddp": ColossalDDPStrategy,
        "zero": ZeroStrategy,
        "gemini": GeminiStrategy,
        "fsdp": ColossalFSDPStrategy,
        "hybrid": HybridParallelStrategy,
    }
    return classes[kind](**arguments)


def _fit(strategy_spec: tuple[str, dict[str, Any]], directory: str, eager: bool) -> MetaPretrainedLlamaModule:
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from tests.distributed.oracle import quiet_trainer

    module = MetaPretrainedLlamaModule(directory, eager)
    loader = DataLoader(RandomTokenDataset(num_samples=8, block_size=16, vocab_size=64, seed=2), batch_size=2)
    trainer = quiet_trainer(strategy=_strategy(*strategy_spec), devices=torch.distributed.get_world_size(), max_steps=2)
    trainer.fit(module, train_dataloaders=loader)
    return module


def meta_and_eager_body(strategy_spec: tuple[str, dict[str, Any]], directory: str) -> dict[str, Any]:
    """The same two SGD steps from the meta-device build and from an eager `from_pretrained` build."""
    from lightning_colossal.engine_parts.pretrained import READS

    READS.reset()
    meta = _fit(strategy_spec, directory, eager=False)
    bytes_read = READS.bytes
    meta_trained = _float_copy(meta.trainer.strategy.full_model_state_dict())
    tied = meta.model.lm_head.weight is meta.model.model.embed_tokens.weight
    eager = _fit(strategy_spec, directory, eager=True)
    return {
        "bytes_read": bytes_read,
        "starting": meta.starting_state,
        "trained": meta_trained,
        "eager_starting": eager.starting_state,
        "eager_trained": _float_copy(eager.trainer.strategy.full_model_state_dict()),
        "tied": tied,
    }


@pytest.fixture(scope="module")
def pretrained_directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama saved as several safetensors files with an index, as large models are."""
    torch.manual_seed(3)
    config = tiny_llama_config()
    config.num_key_value_heads = 2  # tensor parallelism over two ranks splits the key/value heads
    directory = tmp_path_factory.mktemp("pretrained")
    transformers.LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="20KB")
    assert (directory / "model.safetensors.index.json").is_file()
    return directory


def _stored_tensors(directory: Path) -> dict[str, torch.Tensor]:
    stored: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        stored.update(safetensors_torch.load_file(path))
    return stored


STRATEGIES = {
    "ddp": (("ddp", {}), WHOLE_MODEL_BYTES),
    "zero2": (("zero", {"stage": 2}), WHOLE_MODEL_BYTES),
    "gemini": (("gemini", {"chunk_numel": 3000}), HALF_OF_EVERY_TENSOR),
    "gemini_offload": (("gemini", {"chunk_numel": 3000, "offload": True}), HALF_OF_EVERY_TENSOR),
    "fsdp": (("fsdp", {}), HALF_OF_EVERY_TENSOR),
    "hybrid_tp2": (("hybrid", {"tp_size": 2}), TENSOR_PARALLEL_PIECES),
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_pretrained_on_meta_reads_only_each_ranks_pieces(rank_pool_2, pretrained_directory, name):
    strategy_spec, expected_bytes = STRATEGIES[name]
    results = rank_pool_2.run(meta_and_eager_body, strategy_spec, str(pretrained_directory))
    stored = _stored_tensors(pretrained_directory)
    assert sum(tensor.numel() * tensor.element_size() for tensor in stored.values()) == WHOLE_MODEL_BYTES
    for result in results:
        assert result["tied"], "the head must stay tied to the embedding"
        assert result["bytes_read"] == expected_bytes
        starting = result["starting"]
        # Bit for bit the files' values; the tied head (absent from the files) is the embedding.
        for key, tensor in stored.items():
            torch.testing.assert_close(starting[f"model.{key}"], tensor, rtol=0, atol=0, msg=key)
        torch.testing.assert_close(
            starting["model.lm_head.weight"], stored["model.embed_tokens.weight"], rtol=0, atol=0
        )
        # Training from the meta build is exactly training from the eager from_pretrained build.
        assert set(result["trained"]) == set(result["eager_trained"])
        for key, tensor in result["eager_trained"].items():
            torch.testing.assert_close(result["trained"][key], tensor, rtol=0, atol=0, msg=key)
        assert any(not torch.equal(result["trained"][key], starting[key]) for key in starting), "nothing trained"
