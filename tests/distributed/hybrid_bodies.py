"""Bodies (run on every rank of a pool) and the single-process oracle for the hybrid 3D strategy tests.

The workload is a tiny demo GPT on random tokens. The oracle trains the same GPT in one process on the global
batch of every step: the samples of every data-parallel rank (the DistributedSampler's order) concatenated, which
under tensor, pipeline and sequence parallelism is exactly what one step of the hybrid run computes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule, seed_everything
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed.oracle import _rank_micro_batches, quiet_trainer

MODEL_SEED = 7
VOCAB = 64
SEQUENCE = 16
NUM_SAMPLES = 32
LEARNING_RATE = 1e-2


def gpt_config(**overrides: Any) -> Any:
    from lightning_colossal.demo.model import GPTConfig

    settings: dict[str, Any] = {
        "vocab_size": VOCAB,
        "block_size": SEQUENCE,
        "num_layers": 4,
        "num_heads": 4,
        "embed_dim": 32,
        "tie_weights": True,
    }
    settings.update(overrides)
    return GPTConfig(**settings)


def build_model(kind: str, **overrides: Any) -> torch.nn.Module:
    """The demo GPT, or a tiny Hugging Face Llama, Mistral, GPT-2 or BERT built from a config (no download)."""
    torch.manual_seed(MODEL_SEED)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        gpt2_config = GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQUENCE,
            n_embd=32,
            n_layer=overrides.get("num_layers", 2),
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
        return GPT2LMHeadModel(gpt2_config)
    if kind == "bert":
        from transformers import BertConfig, BertForMaskedLM

        bert_config = BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=SEQUENCE,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            attn_implementation="eager",
        )
        return BertForMaskedLM(bert_config)
    if kind == "sequential":
        return sequential_model(norm_inside=overrides.get("norm_inside", False))
    # A tiny decoder: 4 query heads over 2 key/value heads.
    decoder = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": overrides.get("num_layers", 2),
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": SEQUENCE,
        "attn_implementation": "eager",
    }
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**decoder, tie_word_embeddings=overrides.get("tie_weights", False)))
    if kind == "mistral":
        from transformers import MistralConfig, MistralForCausalLM

        # A window shorter than the sequence: Mistral's forward builds a sliding-window mask for every layer.
        window = overrides.get("sliding_window", 3)
        return MistralForCausalLM(MistralConfig(**decoder, sliding_window=window, tie_word_embeddings=False))
    if kind in MORE_DECODERS:
        import transformers

        config_class, model_class, extra = MORE_DECODERS[kind]
        config = getattr(transformers, config_class)(**decoder, pad_token_id=0, bos_token_id=0, eos_token_id=0, **extra)
        return getattr(transformers, model_class)(config)
    from lightning_colossal.demo.model import GPT

    return GPT(gpt_config(**overrides))


#: More tiny decoders (pipeline rows): config class, model class, config settings beyond the shared ones.
MORE_DECODERS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 8, "tie_word_embeddings": True}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2}),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False},
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "tie_word_embeddings": False,
        },
    ),
}


#: Issue 29: torch's tensor-parallel tutorial plan on an nn.Sequential (names relative to the LightningModule).
SEQUENTIAL_PLAN = {"model.3": "colwise", "model.5": "rowwise"}


def sequential_model(norm_inside: bool = False) -> torch.nn.Module:
    """Token ids -> logits. The embedding and a LayerNorm run before the column-parallel ``3`` (outside the region);
    with ``norm_inside`` a LayerNorm over the split features runs between ``3`` and the row-parallel ``5``."""
    width = 16
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, width),
        torch.nn.LayerNorm(width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 2 * width),
        torch.nn.LayerNorm(2 * width) if norm_inside else torch.nn.ReLU(),
        torch.nn.Linear(2 * width, width),
        torch.nn.Linear(width, VOCAB),
    )


def meta_initialised_model(kind: str, **overrides: Any) -> torch.nn.Module:
    """The whole model a meta-device build gets from its own initialiser at MODEL_SEED, in one process.

    For the demo GPT this equals the eager build; Hugging Face constructors draw through the torch layers' own
    initialisers before ``init_weights``, so their eager build differs (see ``engine_parts/meta_init.py``).
    """
    import copy

    from lightning_colossal.engine_parts.meta_init import initialise_in_windows

    with torch.device("meta"):
        model = build_model(kind, **overrides)
    template = copy.deepcopy(model)
    model.to_empty(device="cpu")  # unties tied weights (one new tensor per module)
    if kind != "gpt":
        model.tie_weights()
    live = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))

    def keep(names: list[str], whole: torch.Tensor) -> None:
        for name in names:
            live[name].data.copy_(whole)

    torch.manual_seed(MODEL_SEED)
    initialise_in_windows(template, lambda names: True, keep, torch.device("cpu"), 2**30)
    return model


def logits_of(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    output = model(inputs)
    return output if isinstance(output, torch.Tensor) else output.logits


def token_dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (NUM_SAMPLES, SEQUENCE + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def language_model_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class TinyGPTModule(LightningModule):
    """A LightningModule written once for every mode: pp > 1 uses ``pipeline_loss``, the others ``training_step``."""

    def __init__(self, batch_size: int = 4, kind: str = "gpt", **config: Any) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.kind = kind
        # The Hugging Face model's own loss (`labels=`), rather than cross-entropy on its logits here.
        self.model_loss = bool(config.pop("model_loss", False))
        self.config_overrides = config
        self.model: torch.nn.Module | None = None
        self.step_losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is not None:
            return
        overrides = dict(self.config_overrides)
        if overrides.pop("meta", False):
            # Shapes only: the strategy splits first and initialises just this rank's pieces.
            with torch.device("meta"):
                self.model = build_model(self.kind, **overrides)
        else:
            self.model = build_model(self.kind, **overrides)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        assert self.model is not None
        if self.model_loss:
            output = self.model(input_ids=inputs, labels=inputs)
            self.logits_were_sharded = isinstance(output.logits, DTensor)
            return output.loss
        return language_model_loss(logits_of(self.model, inputs), targets)

    def pipeline_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return language_model_loss(outputs, targets)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_index: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.step_losses.append(float(loss))

    def validation_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        assert self.model is not None
        return language_model_loss(logits_of(self.model, inputs), targets)

    def on_validation_batch_end(self, outputs: Any, batch: Any, batch_index: int, dataloader_index: int = 0) -> None:
        # Pipelines return the loss of the whole batch to every rank; other layouts their own loss.
        self.log("val_loss", outputs, sync_dist=True)

    def predict_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        # Pipelines run a forward-only schedule instead and return the last stage's logits.
        assert self.model is not None
        return logits_of(self.model, batch[0])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=LEARNING_RATE, weight_decay=0.1)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(), batch_size=self.batch_size)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(token_dataset(), batch_size=self.batch_size)


def full_weights(module: LightningModule, strategy: Any) -> dict[str, torch.Tensor]:
    """The whole weights this rank holds, by name (DTensor pieces gathered over the tensor-parallel ranks)."""
    state = strategy.model_state_for_checkpoint()
    return {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().float().cpu().clone()
        for name, value in state.items()
    }


def hybrid_train_body(
    strategy_kwargs: dict[str, Any],
    steps: int,
    trainer_kwargs: dict[str, Any] | None = None,
    module_kwargs: dict[str, Any] | None = None,
    module_class: type[TinyGPTModule] = TinyGPTModule,
) -> dict[str, Any]:
    from lightning_colossal import HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module = module_class(**(module_kwargs or {}))
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(
        devices=torch.distributed.get_world_size(), strategy=strategy, max_steps=steps, **(trainer_kwargs or {})
    )
    trainer.fit(module)
    result = {"weights": full_weights(module, strategy), "losses": module.step_losses}
    if hasattr(module, "logits_were_sharded"):
        result["logits_were_sharded"] = module.logits_were_sharded
    return result


def oracle(
    dp_size: int,
    steps: int,
    batch_size: int = 4,
    accumulate: int = 1,
    clip_norm: float | None = None,
    kind: str = "gpt",
    model_loss: bool = False,
    **config: Any,
) -> dict[str, Any]:
    """Single-process training of the same GPT on each step's global batch."""
    seed_everything(MODEL_SEED, verbose=False)
    model = meta_initialised_model(kind, **config) if config.pop("meta", False) else build_model(kind, **config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1)
    dataset = token_dataset()
    inputs, targets = dataset.tensors
    batches = _rank_micro_batches(dataset, dp_size, batch_size)
    losses = []
    gradient_norms = []
    for _ in range(steps):
        optimizer.zero_grad()
        step_losses = []
        for _ in range(accumulate):
            chosen = [index for rank_indices in next(batches) for index in rank_indices]
            if model_loss:
                step_losses.append(model(input_ids=inputs[chosen], labels=inputs[chosen]).loss)
            else:
                step_losses.append(language_model_loss(logits_of(model, inputs[chosen]), targets[chosen]))
        loss = torch.stack(step_losses).mean()
        loss.backward()
        losses.append(loss.item())
        gradients = [parameter.grad for parameter in model.parameters() if parameter.grad is not None]
        gradient_norms.append({p: torch.nn.utils.get_total_norm(gradients, p).item() for p in (1.0, 2.0, math.inf)})
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
    weights = {f"model.{name}": value.detach().clone() for name, value in model.state_dict().items()}
    return {"weights": weights, "losses": losses, "gradient_norms": gradient_norms}


def merged_weights(results: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for result in results:
        merged.update(result["weights"])
    return merged


def checkpoint_body(
    strategy_kwargs: dict[str, Any],
    epochs: int,
    batch_size: int,
    save_to: str | None,
    resume_from: str | None,
    kind: str = "gpt",
    user_tensor_parallel: bool = False,
) -> dict[str, Any]:
    """Train to the end of epoch ``epochs`` (resuming from ``resume_from``), then save to ``save_to``."""
    from lightning_colossal import HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module_class = UserTensorParallelModule if user_tensor_parallel else TinyGPTModule
    module = module_class(batch_size=batch_size, kind=kind)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(devices=torch.distributed.get_world_size(), strategy=strategy, max_epochs=epochs)
    trainer.fit(module, ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {"weights": full_weights(module, strategy), "losses": module.step_losses}


def validate_body(strategy_kwargs: dict[str, Any]) -> float:
    """``trainer.validate`` on two batches of the untrained GPT; returns the logged mean loss."""
    from lightning_colossal import HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module = TinyGPTModule()
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(devices=torch.distributed.get_world_size(), strategy=strategy, limit_val_batches=2)
    return float(trainer.validate(module, verbose=False)[0]["val_loss"])


def validation_oracle(batch_size: int = 4, num_batches: int = 2) -> float:
    from lightning_colossal.demo.model import GPT

    torch.manual_seed(MODEL_SEED)
    model = GPT(gpt_config())
    inputs, targets = token_dataset().tensors
    with torch.no_grad():
        losses = [
            language_model_loss(model(inputs[start : start + batch_size]), targets[start : start + batch_size])
            for start in range(0, batch_size * num_batches, batch_size)
        ]
    return float(torch.stack(losses).mean())


def predict_body(strategy_kwargs: dict[str, Any], kind: str = "gpt") -> list[torch.Tensor]:
    """``trainer.predict`` of the untrained model on two batches; returns each batch's logits."""
    from lightning_colossal import HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module = TinyGPTModule(kind=kind)
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = quiet_trainer(devices=torch.distributed.get_world_size(), strategy=strategy, limit_predict_batches=2)
    loader = DataLoader(token_dataset(), batch_size=module.batch_size)
    return [prediction.detach().float() for prediction in trainer.predict(module, loader)]


def predict_oracle(kind: str = "gpt", batch_size: int = 4, num_batches: int = 2) -> list[torch.Tensor]:
    model = build_model(kind)
    inputs, _ = token_dataset().tensors
    with torch.no_grad():
        return [
            logits_of(model, inputs[start : start + batch_size])
            for start in range(0, batch_size * num_batches, batch_size)
        ]


class UserTensorParallelModule(TinyGPTModule):
    """Applies torch's own tensor parallelism in configure_model: DTensor parameters over the strategy's tp mesh."""

    def configure_model(self) -> None:
        if self.model is not None:
            return
        super().configure_model()
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        assert self.model is not None
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel()}
        plan.update({"mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        for block in self.model.blocks:
            parallelize_module(block, self.device_mesh["tp"], plan)


def user_tensor_parallel_body(
    strategy_kwargs: dict[str, Any], steps: int, trainer_kwargs: dict[str, Any] | None = None
) -> dict[str, Any] | str:
    """Train the user-parallelised GPT; returns weights and losses, or the message of a ValueError/TypeError."""
    try:
        return hybrid_train_body(strategy_kwargs, steps, trainer_kwargs, module_class=UserTensorParallelModule)
    except (TypeError, ValueError) as error:
        return str(error)


def sequence_gathered_product_body(autocast: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A split-gather ColumnParallelLinear over the world's 2 ranks against the same product in one process.

    Returns ``name -> (this rank's value, the one-process value's matching slice)``.
    """
    import contextlib

    from lightning_colossal.parallel.tensor_parallel import ColumnParallelLinear, ParallelContext

    rank, size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    generator = torch.Generator().manual_seed(0)
    whole_input, weight, bias = (torch.randn(shape, generator=generator) for shape in ((2, 8, 16), (12, 16), (12,)))
    context = ParallelContext(tp_group=torch.distributed.group.WORLD, tp_mesh=None, sp_group=None, split_gather=True)
    layer = ColumnParallelLinear(weight.chunk(size)[rank].clone(), bias.chunk(size)[rank].clone(), context)
    shard = whole_input.chunk(size, dim=1)[rank].clone().requires_grad_()
    reference_input, reference_weight, reference_bias = (
        tensor.clone().requires_grad_() for tensor in (whole_input, weight, bias)
    )

    def autocast_context() -> Any:
        return torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    with autocast_context():
        output = layer(shard)
        # Product, then bias in the product's dtype: the rounding the sharded layer does (F.linear rounds once).
        product = reference_input @ reference_weight.t()
        reference = product + reference_bias.to(product.dtype)
    # The loss sums every rank's output features; each rank backpropagates its own part.
    output.float().pow(2).sum().backward()
    reference.float().pow(2).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None and shard.grad is not None
    assert reference_weight.grad is not None and reference_bias.grad is not None and reference_input.grad is not None
    return {
        "output": (output.detach(), reference.detach().chunk(size, dim=-1)[rank]),
        "weight gradient": (layer.weight.grad, reference_weight.grad.chunk(size)[rank]),
        "bias gradient": (layer.bias.grad, reference_bias.grad.chunk(size)[rank]),
        "input gradient": (shard.grad, reference_input.grad.chunk(size, dim=1)[rank]),
    }
