"""Hugging Face ``generate()`` inside Lightning's evaluation and prediction steps, under every strategy.

Decoding after (or during) fine-tuning is an everyday workflow: greedy tokens must equal single-process PyTorch's.
Under ``colossal_hybrid`` with tensor parallelism the LM head's logits were vocabulary-sharded DTensors in every step,
so ``generate()`` failed mixing its argmax with plain tensors; outside training they are now whole and plain
(``HybridEngine.whole_logits``), while training keeps them sharded for the vocabulary-parallel cross-entropy.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule
from torch.utils.data import DataLoader

from tests.distributed.oracle import quiet_trainer

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 5


def prompts() -> torch.Tensor:
    from tests.distributed.test_huggingface_zoo import VOCAB

    return torch.randint(2, VOCAB, (4, 4), generator=torch.Generator().manual_seed(3))


def greedy(model: Any, batch: torch.Tensor) -> torch.Tensor:
    return model.generate(input_ids=batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)


class Generating(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model: Any = None
        self.generated: list[torch.Tensor] = []

    def configure_model(self) -> None:
        from tests.distributed.test_huggingface_zoo import new_model

        if self.model is None:
            self.model = new_model("llama")

    def predict_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        return greedy(self.model, batch)

    def validation_step(self, batch: torch.Tensor, batch_index: int) -> None:
        self.generated.append(greedy(self.model, batch))


def generation_body(strategy_name: str, stage: str) -> list[list[list[int]]]:
    from tests.distributed.test_huggingface_zoo import make_strategy

    module = Generating()
    trainer = quiet_trainer(strategy=make_strategy(strategy_name, "llama"), devices=2, use_distributed_sampler=False)
    loader = DataLoader(prompts(), batch_size=2)
    if stage == "predict":
        return [tokens.tolist() for tokens in trainer.predict(module, dataloaders=loader)]
    trainer.validate(module, dataloaders=loader, verbose=False)
    return [tokens.tolist() for tokens in module.generated]


ROWS = [
    *[pytest.param(name, "predict", id=f"{name}-predict") for name in ("ddp", "zero2", "gemini", "fsdp", "hybrid")],
    pytest.param("gemini", "validate", id="gemini-validate"),
    pytest.param("hybrid", "validate", id="hybrid-validate"),
]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("strategy_name", "stage"), ROWS)
def test_generate_equals_single_process_greedy_decoding(rank_pool_2, strategy_name, stage):
    from tests.distributed.test_huggingface_zoo import new_model

    model = new_model("llama").eval()
    with torch.no_grad():
        expected = [greedy(model, batch).tolist() for batch in prompts().split(2)]
    assert all(len(row) == 4 + NEW_TOKENS for batch in expected for row in batch)
    for generated in rank_pool_2.run(generation_body, strategy_name, stage, timeout=120):
        assert generated == expected
