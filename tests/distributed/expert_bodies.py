"""Bodies (run on every rank of a pool) and the single-process oracle for expert parallelism (``ep_size``).

The workload is a tiny Hugging Face mixture-of-experts model (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE,
OLMoE, DeepSeek-V3 with shared experts), built from a config, trained with its own ``labels=`` loss, which includes
the router's load-balancing term (``output_router_logits=True``). Each data-parallel rank reads its own fixed slice
of the samples (no shuffling sampler), so the oracle knows every rank's micro-batch; the oracle's loss of a step is
the mean of the ranks' micro-batch losses, as data parallelism defines it (the load-balancing term is not a mean
over tokens, so the loss of the concatenated batch would differ).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import LightningModule, seed_everything
from torch.utils.data import DataLoader, Subset, TensorDataset

from tests.distributed.oracle import quiet_trainer

MODEL_SEED = 11
VOCAB = 64
SEQUENCE = 8
SAMPLES_PER_RANK = 8
BATCH = 2
STEPS_PER_EPOCH = SAMPLES_PER_RANK // BATCH
LEARNING_RATE = 1e-2
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "plain")


class PlainExperts(torch.nn.Module):
    """Experts in a plain module following the contract expert parallelism relies on (an integer ``num_experts``,
    3-D weights with the expert first, ``forward(hidden_states, top_k_index, top_k_weights)``), written differently
    from Hugging Face's: a dense loop over experts with a mask."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up = torch.nn.Parameter(torch.randn(num_experts, hidden, intermediate) * 0.2)
        self.down = torch.nn.Parameter(torch.randn(num_experts, intermediate, hidden) * 0.2)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        output = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            weight = (top_k_weights * (top_k_index == expert)).sum(dim=-1, keepdim=True)
            output = output + weight * (torch.relu(hidden_states @ self.up[expert]) @ self.down[expert])
        return output


class PlainMoE(torch.nn.Module):
    """Embedding, one routed MoE layer (softmax router, top-2, a load-balancing term) and a head."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 32)
        self.router = torch.nn.Linear(32, num_experts, bias=False)
        self.experts = PlainExperts(num_experts, 32, 48)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        from types import SimpleNamespace

        hidden = self.embed(input_ids).flatten(0, 1)
        probabilities = self.router(hidden).softmax(dim=-1)
        weights, index = probabilities.topk(2, dim=-1)
        hidden = hidden + self.experts(hidden, index, weights / weights.sum(dim=-1, keepdim=True))
        logits = self.head(hidden)
        loss = torch.nn.functional.cross_entropy(logits[:-1], labels.flatten()[1:])
        routed = torch.nn.functional.one_hot(index, probabilities.shape[-1]).sum(dim=1).float().mean(dim=0)
        balance = probabilities.shape[-1] * (routed * probabilities.mean(dim=0)).sum()
        return SimpleNamespace(loss=loss + 0.5 * balance, logits=logits)


def build_moe(family: str, num_experts: int = 4, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny model of ``family`` (two decoder layers, ``num_experts`` experts, top-2) from a fixed seed."""
    import transformers

    torch.manual_seed(MODEL_SEED)
    if family == "plain":
        return PlainMoE(num_experts).to(dtype)
    shared: dict[str, Any] = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "num_experts_per_tok": 2,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.5,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
        "attn_implementation": "eager",
        # No key/value cache in training: activation checkpointing's recomputation would append to it a second time.
        "use_cache": False,
    }
    if family == "mixtral":
        config = transformers.MixtralConfig(**shared, num_local_experts=num_experts, router_jitter_noise=0.0)
        model = transformers.MixtralForCausalLM(config)
    elif family == "qwen2_moe":
        config = transformers.Qwen2MoeConfig(
            **shared,
            num_experts=num_experts,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=24,
            decoder_sparse_step=1,
        )
        model = transformers.Qwen2MoeForCausalLM(config)
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(
            **shared, num_experts=num_experts, moe_intermediate_size=24, decoder_sparse_step=1, head_dim=8
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "olmoe":
        config = transformers.OlmoeConfig(**shared, num_experts=num_experts)
        model = transformers.OlmoeForCausalLM(config)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(
            **(shared | {"num_key_value_heads": 4}),  # multi-head latent attention: one kv head per head
            n_routed_experts=num_experts,
            n_shared_experts=1,
            moe_intermediate_size=24,
            first_k_dense_replace=0,
            n_group=1,
            topk_group=1,
            q_lora_rank=None,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        )
        model = transformers.DeepseekV3ForCausalLM(config)
        with torch.no_grad():  # its router starts at zero (ties everywhere): give it something to route by
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)
    else:
        raise ValueError(family)
    return model.to(dtype)


def token_dataset(world_size: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(1, VOCAB, (world_size * SAMPLES_PER_RANK, SEQUENCE), generator=generator)
    return TensorDataset(tokens)


def rank_samples(rank: int) -> list[int]:
    return list(range(rank * SAMPLES_PER_RANK, (rank + 1) * SAMPLES_PER_RANK))


def starve_experts(model: torch.nn.Module, experts: tuple[int, ...]) -> None:
    """Make the router of every layer never pick ``experts`` (DeepSeek-V3's selection bias; its routing weights, and
    so the loss, do not depend on the bias)."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias[list(experts)] = -1e4


class ExpertModule(LightningModule):
    def __init__(self, family: str, optimizer: str, num_experts: int = 4, starved: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.family, self.optimizer_name, self.num_experts, self.starved = family, optimizer, num_experts, starved
        self.model: torch.nn.Module | None = None
        self.step_losses: list[float] = []
        self.first_gradients: dict[str, torch.Tensor] = {}
        self.gradient_norms: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_moe(self.family, self.num_experts)
            starve_experts(self.model, self.starved)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        (tokens,) = batch
        assert self.model is not None
        return self.model(input_ids=tokens, labels=tokens).loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        self.step_losses.append(float(outputs["loss"] if isinstance(outputs, dict) else outputs))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.gradient_norms.append(float(self.trainer.strategy.gradient_norm()))
        if self.first_gradients:
            return
        engine = getattr(self.trainer.strategy, "engine", None)
        for name, parameter in self.named_parameters():
            gradient = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            if engine is not None and engine.experts is not None:
                gradient = engine.experts.gather(gradient, id(parameter))
            self.first_gradients[name] = gradient.detach().clone()

    def configure_optimizers(self) -> Any:
        return make_optimizer(self.optimizer_name, self.parameters())

    def train_dataloader(self) -> DataLoader:
        rank = self.trainer.global_rank
        dataset = token_dataset(self.trainer.world_size)
        return DataLoader(Subset(dataset, rank_samples(rank)), batch_size=BATCH, shuffle=False)


def make_optimizer(name: str, parameters: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=LEARNING_RATE, weight_decay=0.1)
    return torch.optim.SGD(parameters, lr=0.1)


def expert_train_body(
    strategy_kwargs: dict[str, Any],
    family: str,
    optimizer: str,
    steps: int,
    num_experts: int = 4,
    starved: tuple[int, ...] = (),
    save_to: str | None = None,
    resume_from: str | None = None,
    strategy_name: str = "hybrid",
    precision: str = "32-true",
    clip_norm: float | None = None,
) -> dict[str, Any]:
    """Train ``steps`` optimizer steps in all (counting those of a checkpoint resumed from ``resume_from``)."""
    from lightning_colossal import ColossalDDPStrategy, HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module = ExpertModule(family, optimizer, num_experts, starved)
    strategy_class = HybridParallelStrategy if strategy_name == "hybrid" else ColossalDDPStrategy
    strategy = strategy_class(**strategy_kwargs)
    # A checkpoint is saved after whole epochs (stopped by max_epochs, so that the epoch counts as finished and a
    # resumed run starts the next one from its first batch, as the oracle does).
    whole_epochs = steps % STEPS_PER_EPOCH == 0
    assert whole_epochs or resume_from is None and save_to is None
    limit = {"max_epochs": steps // STEPS_PER_EPOCH} if whole_epochs else {"max_steps": steps}
    trainer = quiet_trainer(
        devices=torch.distributed.get_world_size(),
        strategy=strategy,
        use_distributed_sampler=False,
        precision=precision,
        gradient_clip_val=clip_norm,
        **limit,
    )
    trainer.fit(module, ckpt_path=resume_from)
    engine = getattr(strategy, "engine", None)
    experts = None if engine is None else engine.experts
    result: dict[str, Any] = {
        "weights": {name: value.clone() for name, value in strategy.full_model_state_dict().items()},
        "losses": module.step_losses,
        "gradients": module.first_gradients,
        "gradient_norms": module.gradient_norms,
        "local_numels": {name: parameter.numel() for name, parameter in module.named_parameters()},
        "expert_names": sorted(
            name
            for name, parameter in module.named_parameters()
            if experts is not None and experts.is_expert(id(parameter))
        ),
    }
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return result


def oracle(
    family: str,
    optimizer: str,
    world_size: int,
    steps: int,
    num_experts: int = 4,
    starved: tuple[int, ...] = (),
    precision: str = "32-true",
    clip_norm: float | None = None,
) -> dict[str, Any]:
    """One process: each step, the mean of every rank's micro-batch loss, one backward, one optimizer step (under
    ``precision``: ``"bf16-true"`` a bf16 model, ``"bf16-mixed"`` bf16 autocast)."""
    seed_everything(MODEL_SEED, verbose=False)
    model = build_moe(family, num_experts, torch.bfloat16 if precision == "bf16-true" else torch.float32)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
    starve_experts(model, starved)
    optim = make_optimizer(optimizer, model.parameters())
    (tokens,) = token_dataset(world_size).tensors
    losses: list[float] = []
    first_gradients: dict[str, torch.Tensor] = {}
    gradient_norms: list[float] = []
    for step in range(steps):
        optim.zero_grad()
        rank_losses = []
        for rank in range(world_size):
            position = step % STEPS_PER_EPOCH
            chosen = rank_samples(rank)[position * BATCH : (position + 1) * BATCH]
            with autocast:
                rank_losses.append(model(input_ids=tokens[chosen], labels=tokens[chosen]).loss)
        loss = torch.stack(rank_losses).mean()
        loss.backward()
        losses.append([value.item() for value in rank_losses])
        if step == 0:
            first_gradients = {
                f"model.{name}": (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                for name, p in model.named_parameters()
            }
        gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
        gradient_norms.append(torch.nn.utils.get_total_norm(gradients).item())
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optim.step()
    weights = {f"model.{name}": value.detach().clone() for name, value in model.state_dict().items()}
    return {"weights": weights, "losses": losses, "gradients": first_gradients, "gradient_norms": gradient_norms}
