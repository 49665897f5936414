"""colossal_hybrid against the single-process oracle: losses and weights after several steps, every layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.distributed import hybrid_bodies as bodies

STEPS = 3


def _assert_matches(results: list[dict[str, Any]], reference: dict[str, Any], atol: float = 1e-4) -> None:
    got = bodies.merged_weights(results)
    assert set(got) == set(reference["weights"]), sorted(set(got) ^ set(reference["weights"]))
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(
            got[name], expected, atol=atol, rtol=1e-4, msg=lambda message, name=name: f"{name}: {message}"
        )
    # Each rank logs the mean loss over its own samples/tokens; tensor and pipeline peers agree, data and sequence
    # peers differ, and with equal shares their mean is the global loss.
    rank_mean = torch.tensor([result["losses"] for result in results]).mean(dim=0)
    torch.testing.assert_close(rank_mean, torch.tensor(reference["losses"]), atol=1e-5, rtol=1e-5)


CASES_2 = {
    "tp2": ({"tp_size": 2}, 1),
    "pp2_1f1b": ({"pp_size": 2, "num_microbatches": 2}, 1),
    "pp2_interleaved": ({"pp_size": 2, "num_microbatches": 2, "pp_schedule": "interleaved", "num_model_chunks": 2}, 1),
    "pp2_zbv": ({"pp_size": 2, "num_microbatches": 2, "pp_schedule": "zbv", "num_model_chunks": 2}, 1),
    "tp2_split_gather": ({"tp_size": 2, "sequence_parallel": "split_gather"}, 1),
    "sp2_ulysses": ({"sp_size": 2}, 1),
    "dp2_zero1": ({"zero_stage": 1}, 2),
}


@pytest.mark.parametrize("case", sorted(CASES_2))
def test_two_ranks_match_oracle(rank_pool_2, case):
    strategy_kwargs, dp_size = CASES_2[case]
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, timeout=300)
    _assert_matches(results, bodies.oracle(dp_size, STEPS))


def zero_part_body(strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A short fit, with what the hybrid engine's data-parallel part was built from."""
    from lightning.pytorch import seed_everything

    from lightning_colossal import HybridParallelStrategy
    from lightning_colossal.zero import ZeroEngine

    seed_everything(bodies.MODEL_SEED, verbose=False)
    module = bodies.TinyGPTModule()
    strategy = HybridParallelStrategy(**strategy_kwargs)
    trainer = bodies.quiet_trainer(devices=torch.distributed.get_world_size(), strategy=strategy, max_steps=STEPS)
    trainer.fit(module)
    assert strategy.engine is not None
    part = strategy.engine.data_parallel
    assert isinstance(part, ZeroEngine)
    return {
        "weights": bodies.full_weights(module, strategy),
        "losses": module.step_losses,
        "config": part.config,
        "the_strategys_config": part.config is strategy.hybrid_config.data_parallel,
        "scatter_gather": part.use_scatter_gather,
    }


def test_zero_settings_reach_the_zero_engine_under_hybrid(rank_pool_2):
    """A ZeRO setting the hybrid strategy passes on (here `communication`) is the one ZeroConfig its ZeRO engine runs
    with: the parameter exchange all-reduces instead of all-gathering, and training still matches the oracle."""
    kwargs = {"zero_stage": 1, "bucket_size_mb": 0.01, "communication": "all_reduce"}
    results = rank_pool_2.run(zero_part_body, kwargs, timeout=300)
    for result in results:
        assert result["the_strategys_config"]
        assert result["config"].communication == "all_reduce" and result["config"].bucket_size_mb == 0.01
        assert result["scatter_gather"] is False
    _assert_matches(results, bodies.oracle(2, STEPS))


def test_a_whole_zero_config_reaches_the_zero_engine_under_hybrid(rank_pool_2):
    """`zero=ZeroConfig(...)` hands every ZeRO setting to the hybrid run's ZeRO engine, also ones the strategy has no
    flat argument for (here stage 2 with its gradients and optimizer state offloaded to the host): it is the object
    the engine runs with, and training matches the oracle."""
    from lightning_colossal import ZeroConfig

    zero = ZeroConfig(stage=2, cpu_offload=True, overlap_communication=False, bucket_size_mb=0.01)
    results = rank_pool_2.run(zero_part_body, {"zero": zero}, timeout=300)
    for result in results:
        assert result["the_strategys_config"] and result["config"] == zero
    _assert_matches(results, bodies.oracle(2, STEPS))


CASES_4 = {
    "tp2_dp2": ({"tp_size": 2}, 2),
    "tp2_dp2_zero2": ({"tp_size": 2, "zero_stage": 2}, 2),
    "pp2_dp2_zero1": ({"pp_size": 2, "num_microbatches": 2, "zero_stage": 1}, 2),
    "tp2_pp2": ({"tp_size": 2, "pp_size": 2, "num_microbatches": 2}, 1),
    "sp2_dp2_zero1": ({"sp_size": 2, "zero_stage": 1}, 2),
}


@pytest.mark.parametrize("case", sorted(CASES_4))
def test_four_ranks_match_oracle(rank_pool_4, case):
    strategy_kwargs, dp_size = CASES_4[case]
    results = rank_pool_4.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, timeout=300)
    _assert_matches(results, bodies.oracle(dp_size, STEPS))


@pytest.mark.parametrize(
    "strategy_kwargs",
    [
        {"tp_size": 2},
        {"pp_size": 2, "num_microbatches": 2},
        {"pp_size": 2, "num_microbatches": 4, "pp_schedule": "zbv", "num_model_chunks": 2},
    ],
    ids=["tp2", "pp2_1f1b", "pp2_zbv"],
)
def test_validation_matches_oracle(rank_pool_2, strategy_kwargs):
    """Forward-only schedules (pp) and loss_parallel (tp) give the single-process validation loss on every rank."""
    results = rank_pool_2.run(bodies.validate_body, strategy_kwargs, timeout=300)
    expected = bodies.validation_oracle()
    assert results == pytest.approx([expected] * 2, abs=1e-5)


@pytest.mark.parametrize(
    "strategy_kwargs",
    [
        {"pp_size": 2, "num_microbatches": 2},
        {"pp_size": 2, "num_microbatches": 2, "pp_schedule": "zbv", "num_model_chunks": 2},
    ],
    ids=["pp2_1f1b", "pp2_zbv"],
)
def test_pipeline_predict_matches_oracle(rank_pool_2, strategy_kwargs):
    """Forward-only schedules give every rank the single-process logits of each predicted batch."""
    results = rank_pool_2.run(bodies.predict_body, strategy_kwargs, timeout=300)
    expected = bodies.predict_oracle()
    for predictions in results:
        assert len(predictions) == len(expected)
        for got, want in zip(predictions, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pipeline_predict_gathers_vocabulary_shards(rank_pool_4):
    """Under tp2 x pp2 the last stage's vocabulary slices are gathered into whole logits."""
    results = rank_pool_4.run(bodies.predict_body, {"tp_size": 2, "pp_size": 2, "num_microbatches": 2}, timeout=300)
    expected = bodies.predict_oracle()
    for predictions in results:
        for got, want in zip(predictions, expected, strict=True):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_huggingface_llama_tp2_from_its_own_plan(rank_pool_2):
    """A tiny Llama (from a config) is split by its config.base_model_tp_plan and trains like one process."""
    pytest.importorskip("transformers")
    results = rank_pool_2.run(bodies.hybrid_train_body, {"tp_size": 2}, STEPS, None, {"kind": "llama"}, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, kind="llama"))


HUGGING_FACE_CASES_2 = {
    "gpt2_tp2": ("gpt2", {"tp_size": 2}, {}),
    "bert_tp2": ("bert", {"tp_size": 2}, {}),
    "llama_pp2": ("llama", {"pp_size": 2, "num_microbatches": 2}, {}),
    "mistral_sliding_window_pp2": ("mistral", {"pp_size": 2, "num_microbatches": 2}, {}),
    "llama_tied_pp2_interleaved": (
        "llama",
        {"pp_size": 2, "num_microbatches": 2, "pp_schedule": "interleaved", "num_model_chunks": 2},
        {"num_layers": 4, "tie_weights": True},
    ),
    "gpt2_pp2_zbv": (
        "gpt2",
        {"pp_size": 2, "num_microbatches": 2, "pp_schedule": "zbv", "num_model_chunks": 2},
        {"num_layers": 4},
    ),
}


@pytest.mark.parametrize("case", sorted(HUGGING_FACE_CASES_2))
def test_huggingface_models_match_oracle(rank_pool_2, case):
    """GPT-2 (fused Conv1D q/k/v) and BERT by their built-in policies, Llama and GPT-2 cut into pipeline stages."""
    pytest.importorskip("transformers")
    kind, strategy_kwargs, config = HUGGING_FACE_CASES_2[case]
    module_kwargs = {"kind": kind, **config}
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, module_kwargs, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, kind=kind, **config))


@pytest.mark.parametrize(
    "kind",
    [
        "phi3",
        "gemma",
        pytest.param("mixtral", marks=pytest.mark.slow),
        pytest.param("qwen2_moe", marks=pytest.mark.slow),
        pytest.param("olmoe", marks=pytest.mark.slow),
    ],
)
def test_more_huggingface_decoders_in_pipeline_stages(rank_pool_2, kind):
    """Phi-3 (through its family plan's policy), Gemma (its scaled embedding on the first stage, its head tied to it
    on the last) and the mixtures Mixtral and Qwen2-MoE cut into two pipeline stages train like one process."""
    pytest.importorskip("transformers")
    strategy_kwargs = {"pp_size": 2, "num_microbatches": 2}
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, {"kind": kind}, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, kind=kind))


def test_huggingface_llama_own_loss_with_vocabulary_parallel_head(rank_pool_2):
    """The untied LM head is split by vocabulary: the model's own `labels=` loss runs on sharded logits inside
    loss_parallel and trains like one process."""
    pytest.importorskip("transformers")
    module_kwargs = {"kind": "llama", "model_loss": True}
    results = rank_pool_2.run(bodies.hybrid_train_body, {"tp_size": 2}, STEPS, None, module_kwargs, timeout=300)
    assert all(result["logits_were_sharded"] for result in results)
    _assert_matches(results, bodies.oracle(1, STEPS, kind="llama", model_loss=True))


HUGGING_FACE_SPLIT_GATHER = {
    "untied_own_loss": {"kind": "llama", "model_loss": True},
    "tied": {"kind": "llama", "tie_weights": True},
    "mistral_sliding_window": {"kind": "mistral"},
    # Newly supported families (split_gather.py's layouts), under AdamW here; the zoo's SGD rows are in
    # test_huggingface_split_gather.py.
    "gemma_tied": {"kind": "gemma"},
    "mixtral_whole_sequence_experts": {"kind": "mixtral"},
    "phi3_fused_projections": {"kind": "phi3"},
}


@pytest.mark.parametrize("case", sorted(HUGGING_FACE_SPLIT_GATHER))
def test_huggingface_llama_split_gather_sequence_parallelism(rank_pool_2, case):
    """Residual stream and norms on sequence shards, one gather per attention/MLP block; the head vocabulary-parallel
    (untied) or whole (tied, gathered with a slicing backward); trains like one process."""
    pytest.importorskip("transformers")
    module_kwargs = HUGGING_FACE_SPLIT_GATHER[case]
    strategy_kwargs = {"tp_size": 2, "sequence_parallel": "split_gather"}
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, module_kwargs, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, **module_kwargs))


def test_huggingface_llama_tp2_pp2(rank_pool_4):
    """Tensor parallelism from the model's own plan inside pipeline stages (the head whole on the last stage)."""
    pytest.importorskip("transformers")
    strategy_kwargs = {"tp_size": 2, "pp_size": 2, "num_microbatches": 2}
    results = rank_pool_4.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, {"kind": "llama"}, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, kind="llama"))


def test_user_dtensor_tensor_parallelism_twice_in_one_process(rank_pool_2):
    """configure_model applies torch's parallelize_module over self.device_mesh['tp']; the strategy keeps that split
    and matches the oracle. The second fit in the same processes must not reuse DTensor plans that name the first
    fit's destroyed process groups (DeviceMesh equality ignores groups)."""
    for _ in range(2):
        results = rank_pool_2.run(bodies.user_tensor_parallel_body, {"tp_size": 2}, STEPS, timeout=300)
        _assert_matches(results, bodies.oracle(1, STEPS))


def test_user_dtensor_tensor_parallelism_with_data_parallel_clipping(rank_pool_4):
    """DTensor pieces averaged over dp and clipped by the global norm with every piece counted once."""
    results = rank_pool_4.run(
        bodies.user_tensor_parallel_body, {"tp_size": 2}, STEPS, {"gradient_clip_val": 0.5}, timeout=300
    )
    _assert_matches(results, bodies.oracle(2, STEPS, clip_norm=0.5))


def test_user_dtensor_parallelism_with_zero_is_refused_with_the_fix(rank_pool_4):
    messages = rank_pool_4.run(bodies.user_tensor_parallel_body, {"tp_size": 2, "zero_stage": 1}, 1, timeout=300)
    assert all(isinstance(message, str) and "zero_stage=0" in message for message in messages), messages


META_CASES_2 = {
    "gpt_tp2": ("gpt", {"tp_size": 2}),
    "gpt_tp2_many_windows": ("gpt", {"tp_size": 2, "init_window_bytes": 4096}),
    "gpt_pp2": ("gpt", {"pp_size": 2, "num_microbatches": 2}),
    "llama_tp2": ("llama", {"tp_size": 2}),
    "gpt2_tp2": ("gpt2", {"tp_size": 2}),
}


@pytest.mark.parametrize("case", sorted(META_CASES_2))
def test_meta_device_model_initialises_its_pieces_like_the_eager_model(rank_pool_2, case):
    """A model built on the meta device: each rank materialises only its pieces, from the model's own initialiser,
    bit-identical to the eager model's shards, so training matches the oracle built eagerly from the same seed."""
    kind, strategy_kwargs = META_CASES_2[case]
    if kind != "gpt":
        pytest.importorskip("transformers")
    module_kwargs = {"kind": kind, "meta": True}
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, module_kwargs, timeout=300)
    # The demo GPT's oracle is built eagerly (bit-identical); Hugging Face ones from their init_weights at the seed.
    _assert_matches(results, bodies.oracle(1, STEPS, kind=kind, meta=kind != "gpt"))


def test_meta_initialisation_of_the_demo_gpt_equals_the_eager_build():
    """The one-process reference itself: the windowed initialiser gives the eager model's values exactly."""
    eager = bodies.build_model("gpt")
    windowed = bodies.meta_initialised_model("gpt")
    for (name, expected), got in zip(eager.state_dict().items(), windowed.state_dict().values(), strict=True):
        assert torch.equal(expected, got), name


def test_user_plan_on_the_demo_gpt(rank_pool_2):
    """A user plan (module patterns relative to the LightningModule) splits the named linears and stays exact."""
    plan = {"model.blocks.*.mlp.fc": "colwise", "model.blocks.*.mlp.proj": "rowwise"}
    results = rank_pool_2.run(bodies.hybrid_train_body, {"tp_size": 2, "policy": plan}, STEPS, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS))


def test_user_plan_on_an_nn_sequential(rank_pool_2):
    """Issue 29: torch's tutorial plan on an nn.Sequential whose first Linear and LayerNorm run before the split
    trains without declaring them, like one process (the region check follows the order modules run)."""
    strategy_kwargs = {"tp_size": 2, "policy": bodies.SEQUENTIAL_PLAN}
    module_kwargs = {"kind": "sequential"}
    results = rank_pool_2.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, None, module_kwargs, timeout=300)
    _assert_matches(results, bodies.oracle(1, STEPS, kind="sequential"))


@pytest.mark.parametrize(
    "strategy_kwargs",
    [{"tp_size": 2}, {"pp_size": 2, "num_microbatches": 2}],
    ids=["tp2", "pp2_1f1b"],
)
def test_gradient_accumulation_matches_oracle(rank_pool_2, strategy_kwargs):
    """Two batches per optimizer step: the pipeline's own backward accumulates like Lightning's, and the loss it
    reports per batch is what `training_step` reports without a pipeline (the batch mean / accumulate_grad_batches)."""
    accumulate = 2
    results = rank_pool_2.run(
        bodies.hybrid_train_body, strategy_kwargs, STEPS, {"accumulate_grad_batches": accumulate}, timeout=300
    )
    reference = bodies.oracle(1, STEPS, accumulate=accumulate)
    for result in results:
        # Each step's reported batch losses sum to the step's mean loss.
        result["losses"] = torch.tensor(result["losses"]).view(STEPS, accumulate).sum(dim=1).tolist()
    _assert_matches(results, reference)


CLIP_CASES = {
    "tp2_dp2": ({"tp_size": 2}, 2),
    "tp2_dp2_zero1": ({"tp_size": 2, "zero_stage": 1}, 2),
    "tp2_pp2": ({"tp_size": 2, "pp_size": 2, "num_microbatches": 2}, 1),
}


@pytest.mark.parametrize("case", sorted(CLIP_CASES))
def test_global_norm_clipping_matches_oracle(rank_pool_4, case):
    """The norm spans tensor, pipeline and data-parallel shards, each element (and the tied weight) counted once."""
    strategy_kwargs, dp_size = CLIP_CASES[case]
    results = rank_pool_4.run(bodies.hybrid_train_body, strategy_kwargs, STEPS, {"gradient_clip_val": 0.5}, timeout=300)
    _assert_matches(results, bodies.oracle(dp_size, STEPS, clip_norm=0.5))


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_split_gather_product_matches_one_process(rank_pool_2, autocast):
    """The split-gather column-parallel product (saves the sequence shard, gathers again in backward) gives each
    rank its slice of the one-process output, weight, bias and input gradients, in fp32 and under bf16 autocast."""
    results = rank_pool_2.run(bodies.sequence_gathered_product_body, autocast, timeout=120)
    tolerance = {"atol": 3e-2, "rtol": 2e-2} if autocast else {"atol": 1e-5, "rtol": 1e-5}
    for result in results:
        for name, (got, expected) in result.items():
            assert got.dtype == expected.dtype, name
            torch.testing.assert_close(got, expected, **tolerance, msg=lambda message, name=name: f"{name}: {message}")
