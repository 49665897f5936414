"""LoRA (``peft.get_peft_model``) under every strategy: it trains like one process, frozen base weights cost no
gradient or optimizer memory, checkpoints resume, and the adapter exports alone with ``save_pretrained``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule

from lightning_colossal.checkpoint.huggingface import export_huggingface

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

MODEL_SEED = 5
DATA_SEED = 2
SAMPLER_SEED = 17
NUM_SAMPLES = 16
BLOCK_SIZE = 16
VOCAB_SIZE = 64
BATCH_SIZE = 4
LEARNING_RATE = {"sgd": 0.5, "adamw": 1e-2}


def tiny_llama_config() -> Any:
    # Two key/value heads, so tensor parallelism over 2 ranks can split k_proj/v_proj.
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )


QUERY_VALUE = ("q_proj", "v_proj")
#: Every linear layer of a decoder block: the row-parallel o_proj/down_proj too.
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_lora_model(target_modules: tuple[str, ...] = QUERY_VALUE) -> Any:
    """The same base weights and the same random LoRA A on every rank and in the oracle: both draw from a generator
    seeded here, independent of whatever the process drew before (LoRA's B starts at zero)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        base = transformers.LlamaForCausalLM(tiny_llama_config())
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules), lora_dropout=0.0)
        return peft.get_peft_model(base, config)


def build_optimizer(parameters: Any, optimizer_name: str) -> torch.optim.Optimizer:
    # Every parameter, frozen ones too, as users commonly write it: the engines must skip the frozen ones.
    if optimizer_name == "sgd":
        return torch.optim.SGD(parameters, lr=LEARNING_RATE["sgd"])
    return torch.optim.AdamW(parameters, lr=LEARNING_RATE["adamw"], weight_decay=0.1)


class LoraLlamaModule(LightningModule):
    def __init__(self, optimizer_name: str = "adamw", target_modules: tuple[str, ...] = QUERY_VALUE) -> None:
        super().__init__()
        self.save_hyperparameters()  # load_from_checkpoint rebuilds the same LoRA model
        self.optimizer_name = optimizer_name
        self.target_modules = target_modules
        self.model: Any = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_lora_model(self.target_modules)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        input_ids, _ = batch
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return build_optimizer(self.parameters(), self.optimizer_name)


def lora_names(model: torch.nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters() if "lora_" in name]


# ------------------------------------------------------------------------------------------------- the oracle
def oracle_train(
    optimizer_name: str, world_size: int, steps: int, target_modules: tuple[str, ...] = QUERY_VALUE
) -> dict[str, torch.Tensor]:
    """One process, the whole global batch: each step averages the losses of every rank's micro-batch, exactly the
    samples Lightning's DistributedSampler hands each rank (shuffled with the seed of ``seed_everything``)."""
    from torch.utils.data import DistributedSampler

    from lightning_colossal.demo.data import RandomTokenDataset

    model = build_lora_model(target_modules)
    optimizer = build_optimizer(model.parameters(), optimizer_name)
    dataset = RandomTokenDataset(num_samples=NUM_SAMPLES, block_size=BLOCK_SIZE, vocab_size=VOCAB_SIZE, seed=DATA_SEED)
    steps_per_epoch = len(dataset) // (world_size * BATCH_SIZE)
    for step in range(steps):
        epoch, position = divmod(step, steps_per_epoch)
        losses = []
        for rank in range(world_size):
            sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=SAMPLER_SEED)
            sampler.set_epoch(epoch)
            chosen = list(sampler)[position * BATCH_SIZE : (position + 1) * BATCH_SIZE]
            input_ids = torch.stack([dataset[index][0] for index in chosen])
            losses.append(model(input_ids=input_ids, labels=input_ids).loss)
        optimizer.zero_grad(set_to_none=True)
        torch.stack(losses).mean().backward()
        optimizer.step()
    return {f"model.{name}": tensor.detach().clone() for name, tensor in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------- bodies
STRATEGY_SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    "ddp": ("ddp", {}),
    "zero1": ("zero", {"stage": 1}),
    "zero2": ("zero", {"stage": 2}),
    "gemini": ("gemini", {"chunk_numel": 512}),
    "gemini_offload": ("gemini", {"chunk_numel": 512, "offload": True}),
    "fsdp": ("fsdp", {}),
    "hybrid_tp2": ("hybrid", {"tp_size": 2}),
}


def make_strategy(strategy_name: str, **overrides: Any) -> Any:
    from lightning_colossal import (
        ColossalDDPStrategy,
        ColossalFSDPStrategy,
        GeminiStrategy,
        HybridParallelStrategy,
        StaticPlacement,
        ZeroStrategy,
    )

    kind, arguments = STRATEGY_SPECS[strategy_name]
    if arguments.get("offload"):  # fp32 masters, optimizer state and every parameter shard in CPU memory
        placement = StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)
        arguments = {**{k: v for k, v in arguments.items() if k != "offload"}, "placement": placement}
    classes = {
        "ddp": ColossalDDPStrategy,
        "zero": ZeroStrategy,
        "gemini": GeminiStrategy,
        "fsdp": ColossalFSDPStrategy,
        "hybrid": HybridParallelStrategy,
    }
    return classes[kind](**{**arguments, **overrides})


def _local_numel(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).numel()


class MemoryProbe(Callback):
    """Just before each optimizer step: which parameters hold a gradient, and how many elements of gradient and
    optimizer state this rank holds (its own tensors, and the engine's byte accounting where it has one)."""

    def __init__(self) -> None:
        self.facts: dict[str, Any] = {}

    def on_before_optimizer_step(self, trainer: Any, module: LightningModule, optimizer: Any) -> None:
        self._record(trainer, module, optimizer, "before_step")

    def on_train_batch_end(self, trainer: Any, module: LightningModule, *args: Any) -> None:
        self._record(trainer, module, trainer.optimizers[0], "after_step")

    def _record(self, trainer: Any, module: LightningModule, optimizer: Any, moment: str) -> None:
        facts = {
            "frozen_with_gradient": sorted(
                name for name, p in module.named_parameters() if not p.requires_grad and p.grad is not None
            ),
            "optimizer_state_numel": sum(
                _local_numel(value)
                for state in optimizer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor) and value.ndim > 0
            ),
            "gradient_numel": sum(_local_numel(p.grad) for p in module.parameters() if p.grad is not None),
        }
        engine = getattr(trainer.strategy, "engine", None)
        zero = getattr(engine, "zero", None) or (engine if hasattr(engine, "masters_by_name") else None)
        if zero is not None:
            report = zero.memory_report()
            facts["engine"] = {
                "gradient_bytes": report.gradient_bytes,
                "optimizer_state_bytes": report.optimizer_state_bytes,
                "master_bytes": report.master_bytes,
            }
        elif hasattr(engine, "manager"):
            report = engine.memory_report()
            facts["engine"] = {
                "chunk_capacity": report.num_chunks * report.chunk_numel,
                "gradient_bytes": report.chunks.gradient,
                "optimizer_state_bytes": report.chunks.optimizer_state,
                "master_bytes": report.chunks.master,
                "chunked_names": sorted(
                    member.name for chunk in engine.manager.chunks if not chunk.frozen for member in chunk.spec.members
                ),
                "frozen_chunked_names": sorted(
                    member.name for chunk in engine.manager.chunks if chunk.frozen for member in chunk.spec.members
                ),
                "frozen_shard_bytes": report.frozen_shard_bytes,
                "replicated_bytes": report.replicated_bytes,
            }
        self.facts[moment] = facts


def train_body(
    strategy_name: str,
    optimizer_name: str,
    epochs: int,
    save_to: str | None = None,
    resume_from: str | None = None,
    adapter_directory: str | None = None,
    target_modules: tuple[str, ...] = QUERY_VALUE,
    strategy_arguments: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from tests.distributed.oracle import quiet_trainer

    seed_everything(SAMPLER_SEED, verbose=False)
    module = LoraLlamaModule(optimizer_name, target_modules)
    strategy = make_strategy(strategy_name, **(strategy_arguments or {}))
    probe = MemoryProbe()
    dataset = RandomTokenDataset(num_samples=NUM_SAMPLES, block_size=BLOCK_SIZE, vocab_size=VOCAB_SIZE, seed=DATA_SEED)
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_epochs=epochs, callbacks=[probe]
    )
    trainer.fit(module, train_dataloaders=DataLoader(dataset, batch_size=BATCH_SIZE), ckpt_path=resume_from)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    # A collective: every rank gathers the whole weights (hybrid keeps its tensor-parallel pieces after fit).
    full = {name: tensor.detach().float().clone() for name, tensor in strategy.full_model_state_dict().items()}
    if adapter_directory is not None and torch.distributed.get_rank() == 0:
        if strategy_name.startswith("hybrid"):
            # The module still holds this rank's pieces of lora_B, so give save_pretrained the whole weights.
            whole = {name.removeprefix("model."): tensor for name, tensor in full.items()}
            module.model.save_pretrained(adapter_directory, state_dict=whole)
        else:
            # Every other strategy gives the module back with whole, plain parameters after fit.
            module.model.save_pretrained(adapter_directory)
    torch.distributed.barrier()
    return {"state": full, "memory": probe.facts}


# ------------------------------------------------------------------------------------------------- tests
def data_parallel_size(strategy_name: str, world_size: int) -> int:
    return world_size // 2 if strategy_name.startswith("hybrid_tp2") else world_size


@pytest.fixture(scope="module")
def oracles() -> dict[tuple[str, int], dict[str, torch.Tensor]]:
    steps = 2 * NUM_SAMPLES // BATCH_SIZE
    return {
        (optimizer_name, dp_size): oracle_train(optimizer_name, dp_size, steps // dp_size)
        for optimizer_name in ("sgd", "adamw")
        for dp_size in (1, 2)
    }


def expected_optimizer_state_numel(strategy_name: str, reference: dict[str, torch.Tensor], world_size: int) -> int:
    """AdamW's two moments of the LoRA parameters only, summed over the ranks, in each strategy's layout."""
    lora = {name: tensor.numel() for name, tensor in reference.items() if "lora_" in name}
    if strategy_name == "ddp":
        return 2 * sum(lora.values()) * world_size  # replicated
    if strategy_name == "hybrid_tp2":
        # lora_A of the column-parallel q/v projections stays whole on both ranks; lora_B is split like the base.
        return 2 * sum(numel * (world_size if ".lora_A." in name else 1) for name, numel in lora.items())
    return 2 * sum(lora.values())  # sharded once over the ranks


def check_frozen_parameters_cost_nothing(
    strategy_name: str, results: list[dict[str, Any]], reference: dict[str, torch.Tensor], optimizer_name: str
) -> None:
    world_size = len(results)
    lora_numel = sum(tensor.numel() for name, tensor in reference.items() if "lora_" in name)
    frozen_numel = sum(tensor.numel() for name, tensor in reference.items() if "lora_" not in name)
    assert frozen_numel > 10 * lora_numel, "the check below only means something when the base dwarfs the adapters"
    for rank, result in enumerate(results):
        before_step = result["memory"]["before_step"]
        assert before_step["frozen_with_gradient"] == [], f"rank {rank}"
        # `.grad` the module's parameters hold (ZeRO and Gemini keep gradients in their own buffers: none here).
        assert before_step["gradient_numel"] <= lora_numel, f"rank {rank}: {before_step}"
        engine = before_step.get("engine")
        if engine is not None:
            gradient_numel = lora_numel if strategy_name == "zero1" else lora_numel // world_size
            assert engine["gradient_bytes"] == 4 * gradient_numel, f"rank {rank}: {engine}"
            # Moments of this rank's rows plus one `step` scalar per LoRA tensor.
            assert engine["optimizer_state_bytes"] <= 4 * 2 * lora_numel // world_size + 8 * 8, f"rank {rank}: {engine}"
            if "chunked_names" in engine:
                assert engine["chunked_names"] == sorted(name for name in reference if "lora_" in name)
                check_frozen_base_is_sharded(engine, rank, world_size)
    state_numel = sum(result["memory"]["after_step"]["optimizer_state_numel"] for result in results)
    expected = expected_optimizer_state_numel(strategy_name, reference, world_size) if optimizer_name == "adamw" else 0
    assert state_numel == expected


def check_frozen_base_is_sharded(engine: dict[str, Any], rank: int, world_size: int) -> None:
    """Gemini shards the frozen base in chunks of its own: this rank holds its rows of each frozen tensor (dim-0
    split, ceil(rows / world_size) per rank), nothing stays whole."""
    frozen = {f"model.{name}": p.shape for name, p in build_lora_model().named_parameters() if not p.requires_grad}
    assert engine["frozen_chunked_names"] == sorted(frozen)
    assert engine["replicated_bytes"] == 0, engine
    expected = 0
    for shape in frozen.values():
        rows_per_rank = -(-shape[0] // world_size)
        rows = max(0, min(shape[0], (rank + 1) * rows_per_rank) - rank * rows_per_rank)
        expected += rows * shape.numel() // shape[0] * 4
    assert engine["frozen_shard_bytes"] == expected, f"rank {rank}: {engine}"


def assert_trained_like_oracle(
    state: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor], target_modules: tuple[str, ...] = QUERY_VALUE
) -> None:
    initial = {f"model.{name}": tensor for name, tensor in build_lora_model(target_modules).state_dict().items()}
    assert set(state) == set(oracle)
    lora = sorted(name for name in oracle if "lora_" in name)
    frozen = sorted(name for name in oracle if "lora_" not in name)
    moved = [name for name in lora if not torch.equal(oracle[name], initial[name])]
    assert moved == lora, "every LoRA tensor trains, or the comparison below would be empty"
    torch.testing.assert_close({n: state[n] for n in lora}, {n: oracle[n] for n in lora}, rtol=1e-5, atol=1e-5)
    # Frozen base weights stay bit for bit what they were.
    torch.testing.assert_close({n: state[n] for n in frozen}, {n: initial[n] for n in frozen}, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
@pytest.mark.parametrize("strategy_name", list(STRATEGY_SPECS))
def test_lora_trains_like_one_process_and_frozen_weights_cost_nothing(
    rank_pool_2, oracles, strategy_name, optimizer_name
):
    results = rank_pool_2.run(train_body, strategy_name, optimizer_name, 2, timeout=180)
    oracle = oracles[(optimizer_name, data_parallel_size(strategy_name, 2))]
    assert_trained_like_oracle(results[0]["state"], oracle)
    torch.testing.assert_close(results[1]["state"], results[0]["state"], rtol=0, atol=0)
    check_frozen_parameters_cost_nothing(strategy_name, results, oracle, optimizer_name)


@pytest.mark.parametrize("strategy_name", list(STRATEGY_SPECS))
def test_lora_resumes_loads_and_exports_the_adapter(rank_pool_2, tmp_path, oracles, strategy_name):
    checkpoint = tmp_path / "epoch1.ckpt"
    rank_pool_2.run(train_body, strategy_name, "adamw", 1, str(checkpoint), timeout=180)
    adapter_directory = tmp_path / "adapter"
    resumed = rank_pool_2.run(
        train_body,
        strategy_name,
        "adamw",
        2,
        str(tmp_path / "epoch2.ckpt"),
        str(checkpoint),
        str(adapter_directory),
        timeout=180,
    )[0]["state"]
    # Resuming at the same world size lands where an uninterrupted run (which matches the oracle) does.
    assert_trained_like_oracle(resumed, oracles[("adamw", data_parallel_size(strategy_name, 2))])

    # The checkpoint file alone rebuilds the LoRA module in a plain process (configure_model, then the weights).
    loaded = LoraLlamaModule.load_from_checkpoint(tmp_path / "epoch2.ckpt", weights_only=False)
    torch.testing.assert_close(
        {name: tensor.float() for name, tensor in loaded.state_dict().items()}, resumed, rtol=0, atol=0
    )

    # A whole-model Hugging Face export would not load into the base class: refused before writing anything.
    with pytest.raises(ValueError, match=r"PEFT adapter layers .*merge_and_unload"):
        export_huggingface(tmp_path / "epoch2.ckpt", tmp_path / "exported")
    assert not (tmp_path / "exported").exists()

    # The adapter alone: LoRA tensors only, whole, loadable onto the untouched base model.
    from safetensors.torch import load_file

    adapter_weights = load_file(adapter_directory / "adapter_model.safetensors")
    lora_numel = sum(tensor.numel() for name, tensor in resumed.items() if "lora_" in name)
    assert sum(tensor.numel() for tensor in adapter_weights.values()) == lora_numel
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(MODEL_SEED)
        base = transformers.LlamaForCausalLM(tiny_llama_config())
    restored = peft.PeftModel.from_pretrained(base, adapter_directory)
    input_ids = torch.randint(0, VOCAB_SIZE, (2, BLOCK_SIZE), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(restored(input_ids).logits, loaded.model(input_ids).logits, rtol=0, atol=0)


def test_lora_on_row_parallel_layers_under_tensor_parallelism(rank_pool_2):
    """LoRA on every projection: o_proj/down_proj are row-parallel (lora_A split along the input, lora_B whole),
    q/k/v/gate/up column-parallel (lora_A whole, lora_B split like the base)."""
    results = rank_pool_2.run(train_body, "hybrid_tp2", "adamw", 1, None, None, None, ALL_LINEAR, timeout=180)
    oracle = oracle_train("adamw", 1, NUM_SAMPLES // BATCH_SIZE, ALL_LINEAR)
    assert_trained_like_oracle(results[0]["state"], oracle, ALL_LINEAR)
    torch.testing.assert_close(results[1]["state"], results[0]["state"], rtol=0, atol=0)
    lora_numel = sum(tensor.numel() for name, tensor in oracle.items() if "lora_" in name)
    for result in results:
        assert result["memory"]["before_step"]["frozen_with_gradient"] == []
        # Each rank holds whole lora_A of column-parallel layers and whole lora_B of row-parallel ones, half the rest.
        assert result["memory"]["after_step"]["optimizer_state_numel"] < 2 * lora_numel


def refuse_split_gather_body() -> str:
    with pytest.raises(ValueError, match="drop sequence_parallel") as refusal:
        train_body("hybrid_tp2", "adamw", 1, strategy_arguments={"sequence_parallel": "split_gather"})
    return str(refusal.value)


def test_lora_refuses_split_gather_sequence_parallelism_before_training(rank_pool_2):
    messages = rank_pool_2.run(refuse_split_gather_body, timeout=120)
    assert "LoRA" in messages[0] and "q_proj" in messages[0]
