"""Hugging Face `transformers` models under our strategies: a tiny Llama built from a config (no download)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule

from lightning_colossal import ColossalDDPStrategy, GeminiStrategy, ZeroStrategy
from tests.distributed.oracle import float_state, quiet_trainer

transformers = pytest.importorskip("transformers")

STEPS = 4


def tiny_llama_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


class LlamaModule(LightningModule):
    """Builds the model in configure_model, as sharded strategies expect."""

    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = transformers.LlamaForCausalLM(tiny_llama_config())

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        input_ids, _ = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


def llama_body(strategy_name: str, path: str) -> dict[str, torch.Tensor]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset

    seed_everything(11, verbose=False)
    module = LlamaModule()
    strategies = {
        "ddp": ColossalDDPStrategy,
        "zero2": lambda: ZeroStrategy(stage=2),
        # ~3k-element chunks: the tied embedding shares a chunk, each decoder layer spans several.
        "gemini": lambda: GeminiStrategy(chunk_numel=3000, max_prefetch=1),
    }
    strategy = strategies[strategy_name]()
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=2), batch_size=4)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=STEPS)
    trainer.fit(module, train_dataloaders=loader)
    trainer.save_checkpoint(path)
    return float_state(module)


@pytest.fixture(scope="module")
def llama_ddp_reference(rank_pool_2, tmp_path_factory) -> dict[str, torch.Tensor]:
    return rank_pool_2.run(llama_body, "ddp", str(tmp_path_factory.mktemp("ddp") / "ddp.ckpt"))[0]


@pytest.mark.parametrize("strategy_name", ["zero2", "gemini"])
def test_llama_trains_like_ddp_and_consolidates_to_hf_names(rank_pool_2, tmp_path, llama_ddp_reference, strategy_name):
    from lightning_colossal.checkpoint import consolidate

    reference = llama_ddp_reference
    path = tmp_path / f"{strategy_name}.ckpt"
    results = rank_pool_2.run(llama_body, strategy_name, str(path))
    # Gemini averages over ranks per chunk in fp32 like ZeRO-2: agreement up to reassociation.
    torch.testing.assert_close(results[0], reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
    # The consolidated weights with the LightningModule prefix stripped load strictly into a fresh HF model.
    weights_file = consolidate(path, tmp_path / "llama.pt", weights_only=True, strip_prefix="model.")
    weights = torch.load(weights_file, weights_only=True)
    fresh = transformers.LlamaForCausalLM(tiny_llama_config())
    fresh.load_state_dict(weights, strict=True)
    for name, tensor in fresh.state_dict().items():
        torch.testing.assert_close(tensor, results[0][f"model.{name}"], rtol=0, atol=0)
