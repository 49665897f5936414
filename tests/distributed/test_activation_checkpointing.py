"""Activation checkpointing written in the user's model (``torch.utils.checkpoint``, Hugging Face's
``gradient_checkpointing_enable``) under every strategy, against single-process PyTorch.

A checkpointed region runs its forward again inside backward. That broke Gemini (a chunk left counted as in use
crashed the next step with an illegal state transition; a reentrant checkpoint's inner backward ended ours early and
released chunks still needed), and under FSDP a reentrant region's parameters silently never trained: the graph the
loss sees hides them, and FSDP's unused-gradient tracker removed their gradients (``engine_parts/autograd_graph.py``
[Note: reentrant activation checkpoints hide their parameters]).

Checkpointing does not change the arithmetic, so the oracle is the uncheckpointed model on the same global batch.
Each region is entered with an input that requires grad, where a reentrant checkpoint and plain PyTorch agree.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything
from torch.utils.checkpoint import checkpoint

from lightning_colossal import AutoPlacement, StaticPlacement
from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec
from tests.distributed.oracle import (
    MODEL_SEED,
    RegressionModel,
    RegressionModule,
    float_state,
    oracle_train,
    quiet_trainer,
)
from tests.distributed.test_workflow_rows import _strategy

STEPS = 3
EXACT = {"rtol": 1e-5, "atol": 1e-6}
STRATEGIES: dict[str, StrategySpec] = {
    "ddp": DDP,
    "zero1": ZERO1,
    "zero2": ZERO2,
    "gemini": GEMINI,
    "gemini_one_chunk_per_layer": ("gemini", {"chunk_numel": 1024}),
    # Chunks evicted and prefetched under a budget; chunks and optimizer state all in CPU memory.
    "gemini_auto": (
        "gemini",
        {"chunk_numel": 1024, "placement": AutoPlacement(compute_memory_budget=12_000), "max_prefetch": 1},
    ),
    "gemini_offload": (
        "gemini",
        {"chunk_numel": 1100, "placement": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)},
    ),
    "fsdp": FSDP,
    "hybrid_dp": ("hybrid", {"zero_stage": 1}),
}
# How the checkpointed function is named: a module, a bound method (Hugging Face passes ``layer.__call__``), a
# partial of one, or a closure (whose parameters cannot be read from the graph).
FORMS = ("module", "bound_method", "partial", "closure")
REGIONS = [
    pytest.param(form, reentrant, id=f"{form}-{'reentrant' if reentrant else 'non_reentrant'}")
    for form in FORMS
    for reentrant in (True, False)
]


class CheckpointedModel(RegressionModel):
    """The oracle's model with ``hidden`` and ``output`` each run inside an activation checkpoint."""

    def __init__(self, form: str, reentrant: bool) -> None:
        super().__init__()
        self.form = form
        self.reentrant = reentrant

    def _region(self, layer: torch.nn.Module) -> Any:
        if self.form == "module":
            return layer
        if self.form == "bound_method":
            return layer.__call__
        if self.form == "partial":
            return functools.partial(layer.__call__)
        return lambda tensor: layer(tensor)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.norm(self.input(inputs)))  # requires grad: a reentrant region sees its gradient
        hidden = checkpoint(self._region(self.hidden), hidden, use_reentrant=self.reentrant)
        hidden = self.dropout(torch.relu(hidden))
        return checkpoint(self._region(self.output), hidden, use_reentrant=self.reentrant)


class CheckpointedRegression(RegressionModule):
    def __init__(self, form: str, reentrant: bool, frozen: tuple[str, ...] = ()) -> None:
        super().__init__()
        seed_everything(MODEL_SEED, verbose=False)  # the oracle's initial weights and sampler seed
        self.model = CheckpointedModel(form, reentrant)
        for name in frozen:
            self.model.get_submodule(name).requires_grad_(False)


def checkpointed_body(
    spec: StrategySpec, form: str, reentrant: bool, frozen: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    module = CheckpointedRegression(form, reentrant, frozen)
    trainer = quiet_trainer(strategy=_strategy(spec), devices=2, max_steps=STEPS)
    trainer.fit(module)
    return float_state(module)


@pytest.fixture(scope="module")
def expected() -> dict[str, torch.Tensor]:
    return oracle_train(world_size=2, steps=STEPS).parameters


# The graph walk that reads a region's function matters to Gemini and FSDP, so they get every form; the others,
# whose engines never look inside the graph, one region of each kind.
ROWS = [
    pytest.param(name, *region.values, id=f"{name}-{region.id}")
    for name in STRATEGIES
    for region in REGIONS
    if name.startswith(("gemini", "fsdp")) or region.id in ("module-reentrant", "closure-non_reentrant")
]


@pytest.mark.parametrize(("strategy_name", "form", "reentrant"), ROWS)
def test_checkpointed_regions_train_like_single_process(rank_pool_2, expected, strategy_name, form, reentrant):
    results = rank_pool_2.run(checkpointed_body, STRATEGIES[strategy_name], form, reentrant, timeout=120)
    for weights in results:
        assert set(weights) == set(expected)
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, **EXACT, msg=lambda text, name=name: f"{name}: {text}")


FROZEN = ("hidden",)  # inside a checkpointed region, as a LoRA fine-tune's base weights
FROZEN_STRATEGIES = ("zero2", "gemini", "gemini_offload", "fsdp")


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("strategy_name", FROZEN_STRATEGIES)
def test_frozen_weights_inside_checkpointed_regions(rank_pool_2, strategy_name, reentrant):
    expected = oracle_train(world_size=2, steps=STEPS, frozen=FROZEN).parameters
    results = rank_pool_2.run(checkpointed_body, STRATEGIES[strategy_name], "module", reentrant, FROZEN, timeout=120)
    for weights in results:
        for name, value in expected.items():
            torch.testing.assert_close(weights[name], value, **EXACT, msg=lambda text, name=name: f"{name}: {text}")


# ----------------------------------------------------------------------------------- Hugging Face's own checkpointing
# Mixtral: experts without tokens inside checkpointed layers. Hugging Face's default is non-reentrant.
HUGGING_FACE_STRATEGIES = ("ddp", "zero2", "gemini", "fsdp", "hybrid")


def hugging_face_body(family: str, reentrant: bool) -> dict[str, dict[str, torch.Tensor]]:
    from torch.utils.data import DataLoader

    from tests.distributed import test_huggingface_zoo as zoo
    from tests.distributed.hybrid_bodies import full_weights

    class CheckpointedZooModule(zoo.ZooModule):
        def configure_model(self) -> None:
            if self.model is None:
                self.model = zoo.new_model(self.family)
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    rank = torch.distributed.get_rank()
    results = {}
    for name in HUGGING_FACE_STRATEGIES:
        module = CheckpointedZooModule(family)
        ranks = [0, 1] if name == "hybrid" else [rank]  # tp2 has one data-parallel rank: both read the global batch
        loader = DataLoader(zoo.step_batches(family, ranks), batch_size=None)
        strategy = zoo.make_strategy(name, family)
        trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=zoo.STEPS, use_distributed_sampler=False)
        trainer.fit(module, train_dataloaders=loader)
        assert module.model.is_gradient_checkpointing
        results[name] = full_weights(module, strategy) if name == "hybrid" else float_state(module)
    return results


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("family", "reentrant"), [("llama", False), ("mixtral", True)])
def test_hugging_face_gradient_checkpointing_trains_like_single_process(rank_pool_2, family, reentrant):
    pytest.importorskip("transformers")
    from tests.distributed import test_huggingface_zoo as zoo

    expected = zoo.oracle(family)
    results = rank_pool_2.run(hugging_face_body, family, reentrant, timeout=240)
    for weights_by_strategy in results:
        for name, weights in weights_by_strategy.items():
            tolerance = zoo.HYBRID if name == "hybrid" else zoo.EXACT
            assert set(weights) == set(expected), name
            for key, value in expected.items():
                torch.testing.assert_close(
                    weights[key], value, **tolerance, msg=lambda text, key=key, name=name: f"{name} {key}: {text}"
                )


# ----------------------------------------------------------------------------------- LoRA with checkpointing
# Gemini both ways (frozen chunks recomputed), FSDP reentrant (its parameters were hidden), and one row each for
# the others (suite time: each row trains a Llama for an epoch).
LORA_ROWS = [
    pytest.param(name, reentrant, id=f"{name}-{'reentrant' if reentrant else 'non_reentrant'}")
    for name, reentrant in [
        ("gemini", True),
        ("gemini", False),
        ("gemini_offload", True),
        ("fsdp", True),
        ("zero2", False),
        ("hybrid_tp2", True),
    ]
]


def lora_body(strategy_name: str, reentrant: bool) -> dict[str, torch.Tensor]:
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from tests.distributed import test_lora as lora

    class CheckpointedLora(lora.LoraLlamaModule):
        def configure_model(self) -> None:
            if self.model is None:
                self.model = lora.build_lora_model(self.target_modules)
                # Hugging Face also makes the embeddings' output require grad, so a reentrant region gets gradients.
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})

    seed_everything(lora.SAMPLER_SEED, verbose=False)
    module = CheckpointedLora("sgd")
    strategy = lora.make_strategy(strategy_name)
    dataset = RandomTokenDataset(
        num_samples=lora.NUM_SAMPLES, block_size=lora.BLOCK_SIZE, vocab_size=lora.VOCAB_SIZE, seed=lora.DATA_SEED
    )
    trainer = quiet_trainer(strategy=strategy, devices=2, max_epochs=1)
    trainer.fit(module, train_dataloaders=DataLoader(dataset, batch_size=lora.BATCH_SIZE))
    assert module.model.base_model.model.is_gradient_checkpointing
    return {name: tensor.detach().float().clone() for name, tensor in strategy.full_model_state_dict().items()}


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("strategy_name", "reentrant"), LORA_ROWS)
def test_lora_with_gradient_checkpointing_trains_like_single_process(rank_pool_2, strategy_name, reentrant):
    pytest.importorskip("peft")
    from tests.distributed import test_lora as lora

    dp_size = lora.data_parallel_size(strategy_name, 2)
    expected = lora.oracle_train("sgd", dp_size, lora.NUM_SAMPLES // (lora.BATCH_SIZE * dp_size))
    results = rank_pool_2.run(lora_body, strategy_name, reentrant, timeout=240)
    lora_weights = [name for name in expected if "lora_" in name]
    assert lora_weights
    for weights in results:
        assert set(weights) == set(expected)
        for name in expected:
            torch.testing.assert_close(
                weights[name], expected[name], rtol=1e-4, atol=1e-5, msg=lambda text, name=name: f"{name}: {text}"
            )


# -------------------------------------------------------------- colossal_hybrid's own activation checkpointing
def hybrid_recomputation_body(family: str, tp_size: int) -> dict[str, torch.Tensor]:
    """``HybridParallelStrategy(activation_checkpointing=True)`` (our composable hooks, not the model's
    ``gradient_checkpointing_enable``) on a Hugging Face decoder whose config keeps ``use_cache=True``."""
    from torch.utils.data import DataLoader

    from lightning_colossal import HybridParallelStrategy
    from tests.distributed import test_huggingface_zoo as zoo
    from tests.distributed.hybrid_bodies import full_weights

    module = zoo.ZooModule(family)
    # tp2 has one data-parallel rank: both ranks read the global batch.
    ranks = [0, 1] if tp_size == 2 else [torch.distributed.get_rank()]
    loader = DataLoader(zoo.step_batches(family, ranks), batch_size=None)
    strategy = HybridParallelStrategy(tp_size=tp_size, activation_checkpointing=True)
    trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=zoo.STEPS, use_distributed_sampler=False)
    trainer.fit(module, train_dataloaders=loader)
    return full_weights(module, strategy)


HYBRID_RECOMPUTATION_ROWS = [
    pytest.param(family, tp_size, id=f"{family}-tp{tp_size}", marks=() if fast else pytest.mark.slow)
    for family in ("llama", "mixtral", "phi3", "gpt2", "qwen2_moe", "gemma")
    for tp_size in (1, 2)
    for fast in [(family, tp_size) in {("llama", 2), ("mixtral", 1)}]
]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize(("family", "tp_size"), HYBRID_RECOMPUTATION_ROWS)
def test_hybrid_activation_checkpointing_of_hugging_face_decoders(rank_pool_2, family, tp_size):
    pytest.importorskip("transformers")
    from tests.distributed import test_huggingface_zoo as zoo

    expected = zoo.oracle(family)
    for weights in rank_pool_2.run(hybrid_recomputation_body, family, tp_size, timeout=240):
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, **zoo.HYBRID, msg=lambda text, key=key: f"{key}: {text}")
