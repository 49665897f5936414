"""Hybrid checkpoints move between layouts: saved at tp2 x dp2 (ZeRO-1), resumed at pp2 x dp2 and at one rank.

One epoch is 4 optimizer steps (32 samples, 8 per step). Each resumed run must continue exactly as the
single-process oracle trained for two epochs: the same weights and the same losses in the second epoch.
"""

from __future__ import annotations

import torch

from tests.distributed import hybrid_bodies as bodies

STEPS_PER_EPOCH = 4


def _check_continuation(results, reference) -> None:
    got = bodies.merged_weights(results)
    assert set(got) == set(reference["weights"])
    for name, expected in reference["weights"].items():
        torch.testing.assert_close(
            got[name], expected, atol=1e-4, rtol=1e-4, msg=lambda message, name=name: f"{name}: {message}"
        )
    rank_mean = torch.tensor([result["losses"] for result in results]).mean(dim=0)
    torch.testing.assert_close(rank_mean, torch.tensor(reference["losses"][STEPS_PER_EPOCH:]), atol=1e-5, rtol=1e-5)


def test_tp2_dp2_checkpoint_resumes_at_pp2_dp2_and_one_rank(rank_pool_4, rank_pool_1, tmp_path):
    saved = str(tmp_path / "tp2_dp2.ckpt")
    first = rank_pool_4.run(bodies.checkpoint_body, {"tp_size": 2, "zero_stage": 1}, 1, 4, saved, None, timeout=300)
    reference = bodies.oracle(2, 2 * STEPS_PER_EPOCH)
    assert len(first[0]["losses"]) == STEPS_PER_EPOCH

    pipelined = rank_pool_4.run(
        bodies.checkpoint_body,
        {"pp_size": 2, "num_microbatches": 2, "zero_stage": 1},
        2,
        4,
        None,
        saved,
        timeout=300,
    )
    _check_continuation(pipelined, reference)

    # One rank reading 8 samples per step sees each step's global batch (the union of both data-parallel ranks').
    single = rank_pool_1.run(bodies.checkpoint_body, {}, 2, 8, None, saved, timeout=300)
    _check_continuation(single, reference)


def test_gpt2_fused_attention_checkpoint_resumes_across_layouts(rank_pool_4, rank_pool_1, tmp_path):
    """GPT-2's fused q/k/v shards (saved whole, [Note: fused shards are saved whole]) come back into tp2 shards, with
    and without ZeRO, and into one rank."""
    import pytest

    pytest.importorskip("transformers")
    saved = str(tmp_path / "gpt2_tp2_dp2.ckpt")
    layout = {"tp_size": 2, "zero_stage": 1}
    rank_pool_4.run(bodies.checkpoint_body, layout, 1, 4, saved, None, "gpt2", timeout=300)
    reference = bodies.oracle(2, 2 * STEPS_PER_EPOCH, kind="gpt2")
    for resumed_layout in (layout, {"tp_size": 2}):
        resumed = rank_pool_4.run(bodies.checkpoint_body, resumed_layout, 2, 4, None, saved, "gpt2", timeout=300)
        _check_continuation(resumed, reference)
    single = rank_pool_1.run(bodies.checkpoint_body, {}, 2, 8, None, saved, "gpt2", timeout=300)
    _check_continuation(single, reference)


def test_user_dtensor_checkpoint_resumes_under_the_built_in_policy_and_one_rank(rank_pool_4, rank_pool_1, tmp_path):
    """A checkpoint of a model the user split with DTensor styles is the same portable format: it resumes under the
    strategy's own split, under the user's split again, and at one rank."""
    saved = str(tmp_path / "user_tp2_dp2.ckpt")
    rank_pool_4.run(bodies.checkpoint_body, {"tp_size": 2}, 1, 4, saved, None, "gpt", True, timeout=300)
    reference = bodies.oracle(2, 2 * STEPS_PER_EPOCH)
    for user_tensor_parallel in (False, True):
        resumed = rank_pool_4.run(
            bodies.checkpoint_body, {"tp_size": 2}, 2, 4, None, saved, "gpt", user_tensor_parallel, timeout=300
        )
        _check_continuation(resumed, reference)
    single = rank_pool_1.run(bodies.checkpoint_body, {}, 2, 8, None, saved, timeout=300)
    _check_continuation(single, reference)


def test_pp2_checkpoint_resumes_at_tp2_and_one_rank(rank_pool_4, rank_pool_1, tmp_path):
    """Each pipeline rank saves its own stages' weights and optimizer state; every piece comes back under layouts
    that cut the model differently (and the consolidated file holds the whole optimizer state)."""
    saved = str(tmp_path / "pp2_dp2.ckpt")
    layout = {"pp_size": 2, "num_microbatches": 2, "zero_stage": 1}
    rank_pool_4.run(bodies.checkpoint_body, layout, 1, 4, saved, None, timeout=300)
    reference = bodies.oracle(2, 2 * STEPS_PER_EPOCH)
    resumed = rank_pool_4.run(bodies.checkpoint_body, {"tp_size": 2}, 2, 4, None, saved, timeout=300)
    _check_continuation(resumed, reference)
    single = rank_pool_1.run(bodies.checkpoint_body, {}, 2, 8, None, saved, timeout=300)
    _check_continuation(single, reference)

    # The consolidated file holds every stage's optimizer state by position, and a pipeline takes its stages' part.
    from lightning_colossal.checkpoint import consolidate

    full = str(consolidate(saved, tmp_path / "full.ckpt"))
    contents = torch.load(full, weights_only=False)
    trainable = sum(1 for _ in bodies.build_model("gpt").parameters())
    assert len(contents["optimizer_states"][0]["state"]) == trainable
    pipelined = rank_pool_4.run(bodies.checkpoint_body, layout, 2, 4, None, full, timeout=300)
    _check_continuation(pipelined, reference)
