"""Gemini checkpoints in the portable format: resume identically, at another world size, and across strategies.

A Gemini rank holds its rows of every parameter inside its chunk shards; the checkpoint must still describe whole
tensors keyed by parameter name, with the same keys and values ZeRO and ``colossal_ddp`` write.
"""

from __future__ import annotations

import pytest
import torch

from lightning_colossal.checkpoint import consolidate, read_sharded
from lightning_colossal.checkpoint.sharded import saved_keys
from tests.distributed.checkpoint_bodies import (
    DDP,
    GEMINI,
    ZERO2,
    resume_body,
    save_after_one_epoch_body,
    uninterrupted_body,
)


@pytest.fixture(scope="module")
def gemini_checkpoint(rank_pool_2, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A Gemini checkpoint after one epoch at 2 ranks (dropout off) and the weights it was saved with."""
    path = str(tmp_path_factory.mktemp("gemini") / "epoch1.ckpt")
    saved = rank_pool_2.run(save_after_one_epoch_body, GEMINI, path, 0.0)
    torch.testing.assert_close(saved[1], saved[0], rtol=0, atol=0)
    return path, saved[0]


@pytest.fixture(scope="module")
def gemini_reference(rank_pool_2) -> list[dict[str, torch.Tensor]]:
    """Per-rank weights of an uninterrupted 2-epoch Gemini run at 2 ranks (dropout off)."""
    return rank_pool_2.run(uninterrupted_body, GEMINI, 0.0)


def test_resume_at_same_world_size_continues_identically(rank_pool_2, tmp_path):
    reference = rank_pool_2.run(uninterrupted_body, GEMINI, 0.1)
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, GEMINI, path, 0.1)
    resumed = rank_pool_2.run(resume_body, GEMINI, path, 4, 0.1)
    for rank in range(2):
        # Chunk shards, optimizer state, RNG, sampler epoch and LR schedule restored: bit for bit.
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=0, atol=0)


def test_checkpoint_matches_zero2_key_for_key(rank_pool_2, gemini_checkpoint, tmp_path):
    gemini_path, saved = gemini_checkpoint
    zero_path = str(tmp_path / "zero2.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, ZERO2, zero_path, 0.0)
    gemini_keys = {key for key in saved_keys(gemini_path) if key.startswith(("model.", "optimizer_"))}
    zero_keys = {key for key in saved_keys(zero_path) if key.startswith(("model.", "optimizer_"))}
    assert gemini_keys == zero_keys
    gemini = read_sharded(gemini_path, keys={"model", "optimizer_0"})
    zero = read_sharded(zero_path, keys={"model", "optimizer_0"})
    torch.testing.assert_close(gemini["model"], saved, rtol=0, atol=0)
    torch.testing.assert_close(gemini["model"], zero["model"], rtol=1e-5, atol=1e-6)
    for name, state in zero["optimizer_0"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            mine = gemini["optimizer_0"]["state"][name][key]
            assert mine.shape == state[key].shape, (name, key)  # whole tensors, not one rank's rows
            torch.testing.assert_close(mine, state[key], rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")


def test_resume_at_one_rank_continues_the_same_training(rank_pool_1, gemini_checkpoint, gemini_reference):
    path, _ = gemini_checkpoint
    # One rank with twice the per-rank batch sees the same global batches.
    resumed = rank_pool_1.run(resume_body, GEMINI, path, 8, 0.0)[0]
    torch.testing.assert_close(resumed, gemini_reference[0], rtol=1e-5, atol=1e-6)


def test_gemini_checkpoint_resumes_in_colossal_ddp(rank_pool_2, gemini_checkpoint):
    path, _ = gemini_checkpoint
    reference = rank_pool_2.run(uninterrupted_body, DDP, 0.0)
    resumed = rank_pool_2.run(resume_body, DDP, path, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=1e-5, atol=1e-6)


def test_zero2_checkpoint_resumes_in_gemini_with_offload(rank_pool_2, gemini_reference, tmp_path):
    path = str(tmp_path / "zero2.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, ZERO2, path, 0.0)
    from lightning_colossal import StaticPlacement

    offload = ("gemini", {**GEMINI[1], "placement": StaticPlacement(offload_optim_frac=1.0), "max_prefetch": 1})
    resumed = rank_pool_2.run(resume_body, offload, path, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], gemini_reference[rank], rtol=1e-5, atol=1e-6)


def test_consolidated_file_resumes_in_gemini(rank_pool_2, gemini_checkpoint, gemini_reference, tmp_path):
    from safetensors.torch import load_file

    path, saved = gemini_checkpoint
    weights = load_file(str(consolidate(path, tmp_path / "model.safetensors")))
    torch.testing.assert_close(weights, saved, rtol=0, atol=0)
    full = consolidate(path, tmp_path / "full.ckpt")
    # A single-file checkpoint holds whole tensors; Gemini cuts its rows out of them (optimizer state included).
    resumed = rank_pool_2.run(resume_body, GEMINI, str(full), 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], gemini_reference[rank], rtol=1e-5, atol=1e-6)
