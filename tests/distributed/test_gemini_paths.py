"""Gemini beyond the basic oracle runs: accumulation and clipping, precisions, the NCCL-style collectives on gloo,
prefetching, parameters without gradients, tied weights, frozen layers, and refusals."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_colossal import AutoPlacement, ColossalPrecision, GeminiStrategy, LossScalerConfig, StaticPlacement
from tests.distributed.oracle import (
    MODEL_SEED,
    RegressionModule,
    assert_matches_oracle,
    float_state,
    new_module,
    oracle_train,
    quiet_trainer,
)
from tests.distributed.test_gemini_oracle import FP32, STEPS, train_gemini_body


def _assert_clipping_matters(accumulate: int, **clip: float) -> None:
    """The clipped oracle differs from the unclipped one, so an engine that ignores clipping cannot pass."""
    clipped = oracle_train(world_size=2, steps=STEPS, accumulate=accumulate, **clip).parameters
    unclipped = oracle_train(world_size=2, steps=STEPS, accumulate=accumulate).parameters
    assert max((clipped[name] - unclipped[name]).abs().max().item() for name in clipped) > 1e-3


@pytest.mark.parametrize(
    ("strategy_kwargs", "accumulate"),
    [
        ({}, 2),
        ({}, 4),
        # Of the two chunks (352 and 1057 elements): the first offloads its optimizer (352 <= 50% of the bytes),
        # the last stays gathered (1057 <= 80% of the bytes are kept unsharded).
        ({"placement": StaticPlacement(offload_optim_frac=0.5, shard_param_frac=0.2)}, 2),
        ({"max_prefetch": 2}, 2),
        ({"communication": "scatter_gather"}, 2),
    ],
    ids=["acc2", "acc4", "offload-first-keep-last-gathered", "prefetch2", "scatter-gather"],
)
def test_accumulation_with_clip_by_norm_matches_oracle(rank_pool_2, strategy_kwargs, accumulate):
    results = rank_pool_2.run(train_gemini_body, STEPS, accumulate, 0.05, "norm", "32-true", strategy_kwargs)
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=accumulate, clip_norm=0.05)
    assert_matches_oracle(results, oracle, accumulate, **FP32)
    _assert_clipping_matters(accumulate, clip_norm=0.05)


def test_clip_by_value_matches_oracle(rank_pool_2):
    results = rank_pool_2.run(train_gemini_body, STEPS, 2, 0.01, "value", "32-true", {})
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_value=0.01), 2, **FP32)
    _assert_clipping_matters(2, clip_value=0.01)


@pytest.mark.parametrize("communication", ["all_reduce", "scatter_gather"])
def test_four_ranks_with_empty_shards(rank_pool_4, communication):
    # With 4 ranks, model.output.weight (1 x 32) and model.output.bias (1,) live on rank 0 alone.
    results = rank_pool_4.run(train_gemini_body, 2, 2, 0.05, "norm", "32-true", {"communication": communication})
    assert_matches_oracle(results, oracle_train(world_size=4, steps=2, accumulate=2, clip_norm=0.05), 2, **FP32)


def test_automatic_placement_whose_decisions_differ_between_ranks(rank_pool_2):
    # 1024-element chunks under a 12,000-byte budget: rank 0 evicts five chunks and rank 1 three (their shards and
    # optimizer state differ by a few rows), so with prefetch their gather rounds differ. The training step's synced
    # log is a collective outside Gemini: the rank done first used to wait in it while the other waited for it in a
    # gather round, a hang (hooks.py [Note: the end of a forward]).
    kwargs = {"chunk_numel": 1024, "placement": AutoPlacement(compute_memory_budget=12_000), "max_prefetch": 1}
    results = rank_pool_2.run(train_gemini_body, STEPS, 1, None, "norm", "32-true", kwargs, timeout=60)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), accumulate=1, **FP32)


def test_bf16_mixed_matches_oracle_loosely(rank_pool_2):
    results = rank_pool_2.run(train_gemini_body, STEPS, 2, None, "norm", "bf16-mixed", {})
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, autocast_dtype=torch.bfloat16)
    assert_matches_oracle(results, oracle, 2, rtol=2e-2, atol=2e-3)


def bf16_true_body() -> dict[str, Any]:
    module = new_module()
    strategy = GeminiStrategy(chunk_numel=1100)
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=STEPS, precision="bf16-true"
    )
    trainer.fit(module)
    report = strategy.engine.memory_report()
    return {
        "parameters": float_state(module),
        "dtype": str(module.model.input.weight.dtype),
        "master_bytes": report.chunks.master,
        "shard_bytes": report.chunks.shard,
    }


def test_bf16_true_steps_fp32_masters(rank_pool_2):
    results = rank_pool_2.run(bf16_true_body)
    assert results[0]["dtype"] == "torch.bfloat16"
    # fp32 masters are twice the bytes of the bf16 shards they shadow.
    assert results[0]["master_bytes"] == 2 * results[0]["shard_bytes"] > 0
    oracle = oracle_train(world_size=2, steps=STEPS, parameter_dtype=torch.bfloat16)
    torch.testing.assert_close(results[0]["parameters"], oracle.parameters, rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)


def fp16_overflow_body(overflow_at_step: int) -> dict[str, Any]:
    module = new_module(overflow_at_step=overflow_at_step)
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=1024.0, hysteresis=1))
    trainer = quiet_trainer(
        strategy=GeminiStrategy(chunk_numel=1100),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        plugins=[plugin],
    )
    trainer.fit(module)
    scaler = plugin.loss_scaler
    assert scaler is not None
    return {"parameters": float_state(module), "skipped": scaler.skipped_steps, "scale": scaler.scale}


def test_fp16_overflow_on_one_rank_skips_that_step_everywhere(rank_pool_2):
    results = rank_pool_2.run(fp16_overflow_body, 1)
    for result in results:
        assert result["skipped"] == 1
        assert result["scale"] == 512.0
    oracle = oracle_train(world_size=2, steps=STEPS, autocast_dtype=torch.float16, skip_steps=(1,))
    torch.testing.assert_close(results[0]["parameters"], oracle.parameters, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)


class UnusedBranchModule(RegressionModule):
    """Adds a layer that gets no gradient: never called (``never``), or called everywhere but only rank 0 uses its
    output (``rank_zero_only``: its gradients arrive on rank 0 alone)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.extra = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        prediction = self.model(inputs)
        if self.mode == "rank_zero_only":
            extra = self.extra(inputs)
            if self.global_rank == 0:
                prediction = prediction + 0.01 * extra
        loss = nn.functional.mse_loss(prediction, targets)
        self.micro_batch_losses.append(loss.detach().item())
        return loss


def unused_body(mode: str) -> dict[str, Any]:
    from lightning.pytorch import seed_everything

    seed_everything(MODEL_SEED, verbose=False)
    module = UnusedBranchModule(mode)
    trainer = quiet_trainer(
        strategy=GeminiStrategy(chunk_numel=1100),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        accumulate_grad_batches=2,
    )
    trainer.fit(module)
    return {"parameters": float_state(module)}


@pytest.mark.parametrize("mode", ["never", "rank_zero_only"])
def test_parameters_without_gradient_neither_hang_nor_desynchronise(rank_pool_2, mode):
    results = rank_pool_2.run(unused_body, mode, timeout=60)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)
    if mode == "never":
        oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2)
        used = {name: value for name, value in results[0]["parameters"].items() if not name.startswith("extra.")}
        torch.testing.assert_close(used, oracle.parameters, **FP32)


def frozen_body(shard_frozen: bool) -> dict[str, Any]:
    module = new_module()
    module.model.norm.requires_grad_(False)
    initial = module.model.norm.weight.detach().clone()
    strategy = GeminiStrategy(chunk_numel=1100, shard_frozen_parameters=shard_frozen)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=STEPS)
    trainer.fit(module)
    return {
        "parameters": float_state(module),
        "initial_norm": initial,
        "replicated": strategy.engine.memory_report().replicated_bytes,
        "frozen_shard": strategy.engine.memory_report().frozen_shard_bytes,
    }


@pytest.mark.parametrize("shard_frozen", [True, False], ids=["sharded", "whole"])
def test_frozen_layers_are_sharded_and_unchanged(rank_pool_2, shard_frozen):
    results = rank_pool_2.run(frozen_body, shard_frozen, timeout=60)
    for result in results:
        if shard_frozen:  # the frozen LayerNorm (weight and bias, 32 each) in a chunk of its own: 16 rows each
            assert (result["replicated"], result["frozen_shard"]) == (0, 2 * 16 * 4)
        else:
            assert (result["replicated"], result["frozen_shard"]) == (2 * 32 * 4, 0), "kept whole on every rank"
    torch.testing.assert_close(
        results[0]["parameters"]["model.norm.weight"], results[0]["initial_norm"], rtol=0, atol=0
    )
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)


def tied_gpt_body(kind: str) -> dict[str, torch.Tensor]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal import ColossalDDPStrategy
    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    module = GPTLightningModule(
        vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=32, tie_weights=True, warmup_steps=2
    )
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=5), batch_size=4)
    # Chunks of ~4k elements: the tied embedding shares a chunk with other weights, several chunks per block.
    strategy = ColossalDDPStrategy() if kind == "ddp" else GeminiStrategy(chunk_numel=4200, max_prefetch=1)
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=6, accumulate_grad_batches=2
    )
    trainer.fit(module, train_dataloaders=loader)
    assert module.model is not None
    assert module.model.lm_head.weight is module.model.token_embedding.weight
    return float_state(module)


def test_tied_gpt_trains_like_ddp(rank_pool_2):
    reference = rank_pool_2.run(tied_gpt_body, "ddp")[0]
    results = rank_pool_2.run(tied_gpt_body, "gemini")
    # Gemini sums micro-batch gradients after averaging over ranks, DDP before: reassociation moves near-zero biases
    # by ~2e-6 after 6 steps, hence atol 1e-5 (a wrong tie, e.g. one use's gradient lost, moves weights by ~1e-2).
    torch.testing.assert_close(results[0], reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)


class ManualModule(RegressionModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = nn.functional.mse_loss(self.model(batch[0]), batch[1])
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        return loss


def refusal_body(case: str) -> str:
    from lightning.pytorch import seed_everything

    seed_everything(MODEL_SEED, verbose=False)
    module = ManualModule() if case == "manual" else RegressionModule()
    strategy = GeminiStrategy(chunk_numel=100 if case == "small_chunk" else None)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=STEPS)
    try:
        trainer.fit(module)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "fragments"),
    [("manual", ["manual", "automatic optimization"]), ("small_chunk", ["chunk_numel=100", "chunk_numel >= 1024"])],
)
def test_bad_input_is_refused_with_the_fix(rank_pool_2, case, fragments):
    for message in rank_pool_2.run(refusal_body, case, timeout=60):
        for fragment in fragments:
            assert fragment in message, message


class WeightReadOutsideItsModule(RegressionModule):
    """Reads the output layer's weight directly, outside that module's forward (as a hand-tied head would)."""

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        hidden = torch.relu(self.model.hidden(torch.tanh(self.model.norm(self.model.input(inputs)))))
        prediction = nn.functional.linear(hidden, self.model.output.weight, self.model.output.bias)
        return nn.functional.mse_loss(prediction, targets)


def weight_outside_its_module_body() -> list[str]:
    from lightning.pytorch import seed_everything

    seed_everything(MODEL_SEED, verbose=False)
    # 1024-element chunks: the output layer's chunk holds nothing else, so nothing gathers it for another module.
    trainer = quiet_trainer(strategy=GeminiStrategy(chunk_numel=1024), devices=2, max_steps=STEPS)
    with pytest.raises(RuntimeError) as raised:
        trainer.fit(WeightReadOutsideItsModule())
    return [str(raised.value), *getattr(raised.value, "__notes__", [])]


def test_a_weight_read_outside_its_module_is_explained(rank_pool_2):
    for message in rank_pool_2.run(weight_outside_its_module_body, timeout=60):
        # The explanation heads the exception's own message, torch's words after it (not a note under the traceback).
        assert message[0].startswith("colossal_gemini:"), message
        assert "self.head(hidden)" in message[0] and "colossal_zero2" in message[0], message
        assert "got 1-D tensor" in message[0]  # torch's own words


class ClipTextModule(RegressionModule):
    """Hugging Face's CLIP text encoder: its embeddings module reads ``self.position_embedding.weight.shape[0]``
    without calling that child, so the child's chunk must be gathered for the parent's forward too."""

    def __init__(self) -> None:
        super().__init__()
        import transformers

        config = transformers.CLIPTextConfig(
            vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=16, eos_token_id=2,
        )  # fmt: skip
        self.model = transformers.CLIPTextModel(config)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(10 * self.global_step + self.global_rank)
        tokens = torch.randint(3, 64, (2, 8), generator=generator)
        return self.model(input_ids=tokens).pooler_output.square().mean()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def clip_text_body(strategy_name: str) -> dict[str, torch.Tensor]:
    from lightning.pytorch import seed_everything

    from lightning_colossal import ColossalDDPStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module = ClipTextModule()
    # 4096-element chunks: the embeddings' two tables and the layers' projections lie in different chunks.
    strategy = GeminiStrategy(chunk_numel=4096) if strategy_name == "gemini" else ColossalDDPStrategy()
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=3)
    trainer.fit(module)
    return float_state(module)


def test_a_child_weight_read_by_its_parent_is_gathered_for_the_parents_forward(rank_pool_2):
    pytest.importorskip("transformers")
    sharded = rank_pool_2.run(clip_text_body, "gemini")[0]
    replicated = rank_pool_2.run(clip_text_body, "ddp")[0]
    for name, value in replicated.items():
        torch.testing.assert_close(sharded[name], value, **FP32, msg=name)
