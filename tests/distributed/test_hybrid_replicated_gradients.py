"""Replicated parameters inside tensor-parallel regions (issue 14): tiny Hugging Face decoders under tp2 against the
single-process oracle, and models the tensor-parallel policy does not understand refused before training.

Qwen3's (and Gemma3's) per-head ``q_norm``/``k_norm`` stay whole on every tensor-parallel rank but each rank applies
them to its own heads only, so each rank's gradient is a partial sum the ranks must add up. Plain SGD (no momentum)
shows a wrong gradient scale directly in the weights; AdamW hides most of a scale error (it normalises) but not
partial sums that differ between ranks.

Issue 29: the check decides by the order modules run, not their nesting (``parallel/regions.py``), so torch's
tutorial plan on an ``nn.Sequential`` trains with the layers before the split undeclared, and a norm between the
split layers is still refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import LightningModule, seed_everything

from tests.distributed import hybrid_bodies as bodies
from tests.distributed.oracle import _rank_micro_batches, quiet_trainer

transformers = pytest.importorskip("transformers")

STEPS = 3
SGD_LEARNING_RATE = 0.5


SEQUENTIAL_PLAN = bodies.SEQUENTIAL_PLAN


def logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    if isinstance(model, torch.nn.Sequential):
        return model(inputs)
    return model(input_ids=inputs).logits


def build_decoder(kind: str) -> torch.nn.Module:
    """A tiny causal LM from a config (no download), 4 query heads over 2 key/value heads, untied head."""
    torch.manual_seed(bodies.MODEL_SEED)
    if kind in ("sequential", "sequential_norm_inside"):
        return bodies.sequential_model(norm_inside=kind == "sequential_norm_inside")
    shared: dict[str, Any] = {
        "vocab_size": bodies.VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": bodies.SEQUENCE,
        "tie_word_embeddings": False,
        "attn_implementation": "eager",
    }
    if kind in ("qwen3", "qwen3_undeclared_norms"):
        # head_dim 16 (not hidden / heads = 8): the per-head norms have their own size.
        config = transformers.Qwen3Config(**shared, head_dim=16)
        if kind == "qwen3_undeclared_norms":
            # A plan that splits the heads but says nothing of the per-head norms between q/k_proj and o_proj.
            config.base_model_tp_plan = {
                key: style for key, style in config.base_model_tp_plan.items() if not key.endswith("_norm")
            }
        return transformers.Qwen3ForCausalLM(config)
    if kind == "gemma3":
        # Sliding and full attention layers; per-head q/k norms like Qwen3.
        config = transformers.Gemma3TextConfig(**shared, head_dim=8, sliding_window=4, query_pre_attn_scalar=8)
        return transformers.Gemma3ForCausalLM(config)
    if kind == "olmo2":
        # Attention styles the policy leaves whole ("colwise_gather_output"): whole q/k norms on whole inputs.
        config = transformers.Olmo2Config(**shared, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        return transformers.Olmo2ForCausalLM(config)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**shared))
    if kind == "phi3":
        config = transformers.Phi3Config(**shared, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        return transformers.Phi3ForCausalLM(config)
    if kind == "granite_swa":
        # A learned attention sink per head ("self_attn.sinks": a parameter, split with the heads by the plan).
        config = transformers.GraniteSWAConfig(
            **shared, sliding_window=4, layer_types=["sliding_attention", "full_attention"]
        )
        return transformers.GraniteSWAForCausalLM(config)
    if kind in ("cohere_qk_norm", "cohere_qk_norm_declared"):
        # Norms with one row per head ([heads, head_dim]), which the model's own plan does not name.
        config = transformers.CohereConfig(**shared, use_qk_norm=True, pad_token_id=0, bos_token_id=0, eos_token_id=0)
        if kind == "cohere_qk_norm_declared":  # what the refusal below tells the user to add
            config.base_model_tp_plan = {
                **config.base_model_tp_plan,
                "layers.*.self_attn.q_norm.weight": "colwise",
                "layers.*.self_attn.k_norm.weight": "colwise",
            }
        return transformers.CohereForCausalLM(config)
    if kind == "olmoe":
        config = transformers.OlmoeConfig(
            **shared, num_experts=4, num_experts_per_tok=2, bos_token_id=0, eos_token_id=0
        )
        return transformers.OlmoeForCausalLM(config)
    raise ValueError(f"unknown model kind {kind!r}")


def build_optimizer(parameters: Any, optimizer_name: str) -> torch.optim.Optimizer:
    if optimizer_name == "sgd":
        return torch.optim.SGD(parameters, lr=SGD_LEARNING_RATE)
    return torch.optim.AdamW(parameters, lr=bodies.LEARNING_RATE, weight_decay=0.1)


class DecoderModule(LightningModule):
    def __init__(self, kind: str, optimizer_name: str) -> None:
        super().__init__()
        self.kind = kind
        self.optimizer_name = optimizer_name
        self.model: torch.nn.Module | None = None
        self.step_losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_decoder(self.kind)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        assert self.model is not None
        return bodies.language_model_loss(logits(self.model, inputs), targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        self.step_losses.append(float(outputs["loss"]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.parameters(), self.optimizer_name)

    def train_dataloader(self) -> Any:
        from torch.utils.data import DataLoader

        return DataLoader(bodies.token_dataset(), batch_size=4)


def train_body(kind: str, optimizer_name: str, strategy_kwargs: dict[str, Any]) -> dict[str, Any] | str:
    """Train ``STEPS`` steps; returns the whole weights and losses, or the message of a refusal (raised before any
    training step ran)."""
    from lightning_colossal import HybridParallelStrategy

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = DecoderModule(kind, optimizer_name)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(devices=torch.distributed.get_world_size(), strategy=strategy, max_steps=STEPS)
    try:
        trainer.fit(module)
    except (TypeError, ValueError) as error:
        assert module.step_losses == [], "refused only after training had started"
        return str(error)
    return {"weights": bodies.full_weights(module, strategy), "losses": module.step_losses}


def oracle(kind: str, optimizer_name: str, dp_size: int) -> dict[str, Any]:
    """One process, each step on the global batch (every data-parallel rank's samples)."""
    seed_everything(bodies.MODEL_SEED, verbose=False)
    model = build_decoder(kind)
    optimizer = build_optimizer(model.parameters(), optimizer_name)
    dataset = bodies.token_dataset()
    inputs, targets = dataset.tensors
    batches = _rank_micro_batches(dataset, dp_size, 4)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        chosen = [index for rank_indices in next(batches) for index in rank_indices]
        loss = bodies.language_model_loss(logits(model, inputs[chosen]), targets[chosen])
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
    weights = {f"model.{name}": value.detach().clone() for name, value in model.state_dict().items()}
    return {"weights": weights, "losses": losses}


def assert_matches_oracle(results: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Every rank's whole weights (tensor-parallel pieces gathered) equal the oracle's up to reassociation; ranks'
    copies of replicated weights agree with each other too (a wrong sum makes them drift apart)."""
    for rank, result in enumerate(results):
        assert set(result["weights"]) == set(reference["weights"]), sorted(
            set(result["weights"]) ^ set(reference["weights"])
        )
        for name, expected in reference["weights"].items():
            torch.testing.assert_close(
                result["weights"][name],
                expected,
                atol=1e-4,
                rtol=1e-4,
                msg=lambda message, name=name, rank=rank: f"rank {rank}, {name}: {message}",
            )
    rank_mean = torch.tensor([result["losses"] for result in results]).mean(dim=0)
    torch.testing.assert_close(rank_mean, torch.tensor(reference["losses"]), atol=1e-5, rtol=1e-5)


CASES_2 = {
    "qwen3_tp2_sgd": ("qwen3", "sgd", {"tp_size": 2}),
    "qwen3_tp2_adamw": ("qwen3", "adamw", {"tp_size": 2}),
    "qwen3_tp2_zero1_sgd": ("qwen3", "sgd", {"tp_size": 2, "zero_stage": 1}),
    "qwen3_tp2_split_gather_sgd": ("qwen3", "sgd", {"tp_size": 2, "sequence_parallel": "split_gather"}),
    "gemma3_tp2_sgd": ("gemma3", "sgd", {"tp_size": 2}),
    "llama_tp2_sgd": ("llama", "sgd", {"tp_size": 2}),
    "olmo2_tp2_sgd": ("olmo2", "sgd", {"tp_size": 2}),
    # Fused [q][k][v] and [gate][up], split block by block by the built-in family plan (was refused).
    "phi3_tp2_adamw": ("phi3", "adamw", {"tp_size": 2}),
    "granite_swa_tp2_sgd": ("granite_swa", "sgd", {"tp_size": 2}),
    "cohere_qk_norm_declared_tp2_sgd": ("cohere_qk_norm_declared", "sgd", {"tp_size": 2}),
    # Issue 29: the LayerNorm and Linear before the split share the nn.Sequential with it, and train (no extra keys).
    "sequential_plan_tp2_sgd": ("sequential", "sgd", {"tp_size": 2, "policy": SEQUENTIAL_PLAN}),
    "sequential_plan_tp2_adamw": ("sequential", "adamw", {"tp_size": 2, "policy": SEQUENTIAL_PLAN}),
}


@pytest.mark.parametrize("case", sorted(CASES_2))
def test_replicated_parameters_in_tensor_parallel_regions_match_oracle(rank_pool_2, case):
    kind, optimizer_name, strategy_kwargs = CASES_2[case]
    results = rank_pool_2.run(train_body, kind, optimizer_name, strategy_kwargs, timeout=300)
    assert_matches_oracle(results, oracle(kind, optimizer_name, dp_size=1))


def test_qwen3_tp2_dp2_zero1_matches_oracle(rank_pool_4):
    """The tensor-parallel sum and the data-parallel average compose (ZeRO-1 shards the summed gradient)."""
    results = rank_pool_4.run(train_body, "qwen3", "adamw", {"tp_size": 2, "zero_stage": 1}, timeout=300)
    assert_matches_oracle(results, oracle("qwen3", "adamw", dp_size=2))


REFUSED = {
    # Styles that gather outputs ("colwise_gather_output"), and before transformers 5.25 experts stored as 3-D
    # parameters ("packed_colwise", "moe_tp_experts"): the refusal names the styles the release's plan has.
    "olmoe": ("are not applied here", "tp_size=1"),
}


@pytest.mark.parametrize("kind", sorted(REFUSED))
def test_models_the_plan_policy_does_not_understand_are_refused_before_training(rank_pool_2, kind):
    style, fix = REFUSED[kind]
    messages = rank_pool_2.run(train_body, kind, "sgd", {"tp_size": 2}, timeout=300)
    for message in messages:
        assert isinstance(message, str), "trained instead of being refused"
        assert style in message and fix in message, message


def test_undeclared_whole_parameter_between_split_layers_is_refused_before_training(rank_pool_2):
    """The region check, not the model's plan: with q_norm/k_norm dropped from Qwen3's plan the policy cannot know
    their gradient is partial, so it refuses and names the plan entry that fixes it."""
    messages = rank_pool_2.run(train_body, "qwen3_undeclared_norms", "sgd", {"tp_size": 2}, timeout=300)
    for message in messages:
        assert isinstance(message, str), "trained instead of being refused"
        assert "model.layers.0.self_attn.q_norm.weight" in message, message
        assert "'layers.*.self_attn.k_norm': 'replicated_with_grad_allreduce'" in message, message
        assert "config.base_model_tp_plan" in message, message


def test_per_head_rows_left_whole_are_refused_naming_the_row_split(rank_pool_2):
    """Cohere's q/k norms hold one row per head; the model's plan does not name them, and summing their gradients
    ("replicated_with_grad_allreduce") cannot work (a whole one does not broadcast against this rank's heads), so the
    refusal names the row split the declared case above trains with."""
    for message in rank_pool_2.run(train_body, "cohere_qk_norm", "sgd", {"tp_size": 2}, timeout=300):
        assert isinstance(message, str), "trained instead of being refused"
        assert "one row per attention head" in message, message
        assert "'layers.*.self_attn.q_norm.weight': 'colwise'" in message, message


def test_a_norm_between_the_split_layers_of_a_sequential_is_refused_before_training(rank_pool_2):
    """The order modules run, not their nesting: in the same nn.Sequential plan, a LayerNorm run between the
    column- and the row-parallel layer is refused (naming it and the plan key that declares it), before it runs on
    split features; the modules before the split are not named."""
    strategy_kwargs = {"tp_size": 2, "policy": SEQUENTIAL_PLAN}
    for message in rank_pool_2.run(train_body, "sequential_norm_inside", "sgd", strategy_kwargs, timeout=300):
        assert isinstance(message, str), "trained instead of being refused"
        assert "['model.4.weight', 'model.4.bias']" in message, message
        assert "'model.4': 'replicated_with_grad_allreduce'" in message and "the policy= dict" in message, message
        assert "model.1" not in message, message
