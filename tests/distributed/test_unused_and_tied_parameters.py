"""Parameters without a gradient on some or all ranks, and tied parameters, under every data-parallel strategy.

Issue 14 ("correct or refused, never silently wrong"). Two rows, each compared with single-process PyTorch on the
same global batches (the oracle pattern of ``tests/distributed/oracle.py``):

- **Unused parameters.** A mixture of experts whose routing is fixed by the data: one expert gets tokens on rank 0
  only (rank 1 contributes zero to its average), one gets none anywhere (its gradient is ``None`` in single-process
  torch, so neither SGD nor AdamW steps it, weight decay included), one gets tokens on rank 1 at one step only.
  Experts without tokens are not called at all, so the ranks run different sets of modules (what Hugging Face MoE
  layers do). Then a tiny Switch Transformers (encoder-decoder MoE, tied embeddings).
- **Tied parameters.** BERT masked-LM (word embeddings tied to the decoder) and the demo GPT with ``tie_weights``;
  the tie must survive ``fit`` (one Parameter object).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from unittest import mock

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_colossal import ColossalDDPStrategy, ColossalFSDPStrategy, GeminiStrategy, ZeroStrategy
from tests.distributed.oracle import float_state, quiet_trainer

WORLD_SIZE = 2
STEPS = 3
FEATURES = 6
WIDTH = 8
NUM_EXPERTS = 4
BATCH = 4
EXACT = {"rtol": 1e-5, "atol": 1e-6}


class FSDPWithoutUnusedReduction(ColossalFSDPStrategy):
    """colossal_fsdp as on torch without ``set_reduce_scatter_unused_params`` (2.11): every rank's reduce-scatter gets
    the same parameters from the zero terms ``UnusedGradientTracker`` adds to the loss instead."""

    def setup(self, trainer: Any) -> None:
        with mock.patch(
            "lightning_colossal.strategies.fsdp.include_unused_parameters_in_reduction", lambda roots: False
        ):
            super().setup(trainer)


STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp": lambda: ColossalDDPStrategy(find_unused_parameters=True),
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero2": lambda: ZeroStrategy(stage=2),
    # Small chunks: every expert lives in chunks of its own, so skipping an expert skips gathers.
    "gemini": lambda: GeminiStrategy(chunk_numel=80),
    "fsdp": lambda: ColossalFSDPStrategy(),
    "fsdp_older_torch": lambda: FSDPWithoutUnusedReduction(),
}


# ------------------------------------------------------------------------------------------------- the MoE row
class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.down = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(hidden)))


class MixtureOfExperts(nn.Module):
    """Each sample goes to the expert its ``route`` names; an expert without samples is not called."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, WIDTH)
        self.experts = nn.ModuleList(Expert() for _ in range(NUM_EXPERTS))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, inputs: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.embed(inputs))
        mixed = torch.zeros_like(hidden)
        for index, expert in enumerate(self.experts):
            chosen = (route == index).nonzero().flatten()
            if chosen.numel():
                mixed = mixed.index_add(0, chosen, expert(hidden[chosen]))
        return self.head(hidden + mixed)


def route_of(rank: int, step: int) -> torch.Tensor:
    """Expert 0 everywhere, expert 1 on rank 0 only, expert 2 nowhere, expert 3 on rank 1 at step 1 only."""
    route = [0, 0, 1, 1] if rank == 0 else [0, 0, 0, 0]
    if rank == 1 and step == 1:
        route[3] = 3
    return torch.tensor(route)


def moe_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    batches = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * rank + step)
        inputs = torch.randn(BATCH, FEATURES, generator=generator)
        targets = torch.randn(BATCH, 1, generator=generator)
        batches.append((inputs, targets, route_of(rank, step)))
    return batches


def moe_optimizer(parameters: Any, optimizer_name: str) -> torch.optim.Optimizer:
    if optimizer_name == "sgd":
        return torch.optim.SGD(parameters, lr=0.2, momentum=0.9, weight_decay=0.1)
    return torch.optim.AdamW(parameters, lr=0.05, weight_decay=0.1)


def new_moe() -> MixtureOfExperts:
    seed_everything(3, verbose=False)
    return MixtureOfExperts()


class MoEModule(LightningModule):
    def __init__(self, optimizer_name: str) -> None:
        super().__init__()
        self.model = new_moe()
        self.optimizer_name = optimizer_name

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets, route = batch
        return nn.functional.mse_loss(self.model(inputs, route), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return moe_optimizer(self.parameters(), self.optimizer_name)

    def train_dataloader(self) -> DataLoader:
        # Each rank reads its own fixed batches (no DistributedSampler), so the routing per rank is known.
        return DataLoader(moe_batches(self.global_rank), batch_size=None)


def moe_oracle(optimizer_name: str) -> dict[str, torch.Tensor]:
    model = new_moe()
    optimizer = moe_optimizer(model.parameters(), optimizer_name)
    per_rank = [moe_batches(rank) for rank in range(WORLD_SIZE)]
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses = [
            nn.functional.mse_loss(model(inputs, route), targets)
            for inputs, targets, route in (per_rank[rank][step] for rank in range(WORLD_SIZE))
        ]
        torch.stack(losses).mean().backward()
        optimizer.step()
    return {f"model.{name}": tensor.detach().clone() for name, tensor in model.state_dict().items()}


def moe_body(strategy_name: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for optimizer_name in ("sgd", "adamw"):
        module = MoEModule(optimizer_name)
        trainer = quiet_trainer(
            strategy=STRATEGIES[strategy_name](),
            devices=WORLD_SIZE,
            max_steps=STEPS,
            use_distributed_sampler=False,
        )
        trainer.fit(module)
        results[optimizer_name] = float_state(module)
    return results


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_experts_without_tokens_train_like_single_process(rank_pool_2, strategy_name):
    results = rank_pool_2.run(moe_body, strategy_name, timeout=120)
    initial = {f"model.{name}": tensor for name, tensor in new_moe().state_dict().items()}
    for optimizer_name in ("sgd", "adamw"):
        expected = moe_oracle(optimizer_name)
        # The expert that got no token anywhere is exactly as initialised: no weight decay, no momentum.
        for name in ("model.experts.2.up.weight", "model.experts.2.up.bias", "model.experts.2.down.weight"):
            torch.testing.assert_close(expected[name], initial[name], rtol=0, atol=0)
        for result in results:
            torch.testing.assert_close(
                result[optimizer_name], expected, **EXACT, msg=lambda message, name=optimizer_name: f"{name}: {message}"
            )


def ddp_default_body() -> str:
    module = MoEModule("sgd")
    trainer = quiet_trainer(
        strategy=ColossalDDPStrategy(), devices=WORLD_SIZE, max_steps=STEPS, use_distributed_sampler=False
    )
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(module)
    return str(raised.value)


def test_ddp_without_find_unused_parameters_names_the_fix(rank_pool_2):
    messages = rank_pool_2.run(ddp_default_body, timeout=120)
    for message in messages:
        assert "ColossalDDPStrategy(find_unused_parameters=True)" in message, message


# ------------------------------------------------------------------------------------------------- Hugging Face
transformers = pytest.importorskip("transformers")
HF_STEPS = 2


class LanguageModelModule(LightningModule):
    """Builds ``factory()`` in configure_model; the batch is ``(input_ids, labels)`` (plus decoder ids for seq2seq)."""

    def __init__(self, factory_name: str) -> None:
        super().__init__()
        self.factory_name = factory_name
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = FACTORIES[self.factory_name]()

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        return language_model_loss(self.factory_name, self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return language_model_optimizer(self.parameters())


def language_model_optimizer(parameters: Any) -> torch.optim.Optimizer:
    # SGD with momentum and weight decay: a parameter stepped without a gradient shows, and unlike AdamW (which
    # turns float reassociation in near-zero gradients into ~1e-4 differences) the comparison stays tight.
    return torch.optim.SGD(parameters, lr=0.5, momentum=0.9, weight_decay=0.1)


def tiny_switch() -> nn.Module:
    config = transformers.SwitchTransformersConfig(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=2,
        num_experts=4,
        expert_capacity=64,
        encoder_sparse_step=1,
        decoder_sparse_step=1,
        dropout_rate=0.0,
        router_jitter_noise=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return transformers.SwitchTransformersForConditionalGeneration(config)


def tiny_bert() -> nn.Module:
    config = transformers.BertConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def tiny_gpt() -> nn.Module:
    from lightning_colossal.demo.model import GPT, GPTConfig

    return GPT(GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=16, tie_weights=True))


FACTORIES: dict[str, Callable[[], nn.Module]] = {"switch": tiny_switch, "bert": tiny_bert, "gpt": tiny_gpt}
TIED = {
    "switch": ("model.shared.weight", "model.lm_head.weight"),
    "bert": ("model.bert.embeddings.word_embeddings.weight", "model.cls.predictions.decoder.weight"),
    "gpt": ("model.token_embedding.weight", "model.lm_head.weight"),
}


def language_model_loss(factory_name: str, model: nn.Module, batch: Any) -> torch.Tensor:
    input_ids, labels = batch
    if factory_name == "gpt":
        return nn.functional.cross_entropy(model(input_ids).flatten(0, 1), labels.flatten())
    if factory_name == "switch":
        # Router losses are left out (their coefficients are set to zero by the loss below): only the LM loss.
        output = model(input_ids=input_ids, labels=labels, output_router_logits=False)
        return output.loss
    return model(input_ids=input_ids, labels=labels).loss


def language_model_batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    batches = []
    for step in range(HF_STEPS):
        generator = torch.Generator().manual_seed(1000 + 10 * rank + step)
        input_ids = torch.randint(0, 64, (2, 12), generator=generator)
        labels = torch.randint(0, 64, (2, 12), generator=generator)
        batches.append((input_ids, labels))
    return batches


def new_language_model(factory_name: str) -> nn.Module:
    seed_everything(5, verbose=False)
    return FACTORIES[factory_name]()


def language_model_oracle(factory_name: str) -> dict[str, torch.Tensor]:
    model = new_language_model(factory_name)
    model.train()
    optimizer = language_model_optimizer(model.parameters())
    per_rank = [language_model_batches(rank) for rank in range(WORLD_SIZE)]
    for step in range(HF_STEPS):
        optimizer.zero_grad(set_to_none=True)
        losses = [language_model_loss(factory_name, model, per_rank[rank][step]) for rank in range(WORLD_SIZE)]
        torch.stack(losses).mean().backward()
        optimizer.step()
    return {f"model.{name}": tensor.detach().clone() for name, tensor in model.state_dict().items()}


def language_model_body(factory_name: str, strategy_name: str) -> dict[str, Any]:
    seed_everything(5, verbose=False)
    module = LanguageModelModule(factory_name)
    loader = DataLoader(language_model_batches(torch.distributed.get_rank()), batch_size=None)
    strategy = STRATEGIES[strategy_name]()
    if strategy_name == "gemini":
        # Chunks just above the embedding (1024 elements): experts share chunks with other layers; prefetch on.
        strategy = GeminiStrategy(chunk_numel=1100, max_prefetch=1)
    trainer = quiet_trainer(strategy=strategy, devices=WORLD_SIZE, max_steps=HF_STEPS, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=loader)
    first, second = TIED[factory_name]
    parameters = dict(module.named_parameters(remove_duplicate=False))
    return {"state": float_state(module), "tied": parameters[first] is parameters[second]}


LANGUAGE_MODEL_ROWS = [
    *[pytest.param("switch", name, id=f"switch-{name}") for name in ("ddp", "zero2", "gemini", "fsdp")],
    *[pytest.param("bert", name, id=f"bert-{name}") for name in ("zero1", "gemini", "fsdp")],
    pytest.param("gpt", "fsdp", id="gpt-fsdp"),
]


@pytest.mark.parametrize(("factory_name", "strategy_name"), LANGUAGE_MODEL_ROWS)
def test_language_models_train_like_single_process(rank_pool_2, factory_name, strategy_name):
    results = rank_pool_2.run(language_model_body, factory_name, strategy_name, timeout=180)
    expected = language_model_oracle(factory_name)
    for result in results:
        assert result["tied"], f"{TIED[factory_name]} are no longer one Parameter after fit"
        torch.testing.assert_close(result["state"], expected, rtol=1e-4, atol=1e-5)
