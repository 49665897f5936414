"""ZeRO checkpoints in the portable format: resume identically, at another world size, and across strategies.

A ZeRO rank holds only its own rows of the optimizer state (and of the fp32 master when offloaded); the checkpoint
must still describe whole tensors keyed by parameter name, so that ``colossal_ddp``, another ZeRO stage or another
world size can read it, and a ``colossal_ddp`` checkpoint must load into ZeRO.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_colossal.checkpoint import consolidate, read_sharded
from lightning_colossal.checkpoint.sharded import saved_keys, shard_directory
from tests.distributed.checkpoint_bodies import (
    DDP,
    ZERO1,
    ZERO2,
    resume_body,
    save_after_one_epoch_body,
    uninterrupted_body,
)


@pytest.fixture(scope="module")
def zero2_checkpoint(rank_pool_2, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A ZeRO-2 checkpoint after one epoch at 2 ranks (dropout off) and the weights it was saved with."""
    path = str(tmp_path_factory.mktemp("zero2") / "epoch1.ckpt")
    saved = rank_pool_2.run(save_after_one_epoch_body, ZERO2, path, 0.0)
    torch.testing.assert_close(saved[1], saved[0], rtol=0, atol=0)
    return path, saved[0]


@pytest.fixture(scope="module")
def ddp_checkpoint(rank_pool_2, tmp_path_factory) -> str:
    """A colossal_ddp checkpoint after one epoch at 2 ranks (dropout off)."""
    path = str(tmp_path_factory.mktemp("ddp") / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, DDP, path, 0.0)
    return path


@pytest.fixture(scope="module")
def zero2_reference(rank_pool_2) -> list[dict[str, torch.Tensor]]:
    """Per-rank weights of an uninterrupted 2-epoch ZeRO-2 run at 2 ranks (dropout off)."""
    return rank_pool_2.run(uninterrupted_body, ZERO2, 0.0)


@pytest.mark.parametrize("spec", [ZERO2, ("zero", {"stage": 1, "cpu_offload": True})], ids=["zero2", "zero1-offload"])
def test_resume_at_same_world_size_continues_identically(rank_pool_2, tmp_path, spec):
    reference = rank_pool_2.run(uninterrupted_body, spec, 0.1)
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, spec, path, 0.1)
    resumed = rank_pool_2.run(resume_body, spec, path, 4, 0.1)
    for rank in range(2):
        # Same processes, same order of operations; weights, sharded optimizer state (and offloaded masters), RNG,
        # sampler epoch and LR schedule restored: bit for bit.
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=0, atol=0)


def test_checkpoint_layout_is_per_rank_and_keyed_by_name(zero2_checkpoint):
    path, _ = zero2_checkpoint
    assert Path(path).is_file(), "load_from_checkpoint needs a file"
    assert len(list(shard_directory(path).glob("*.distcp"))) == 2, "each rank writes its own piece"
    keys = saved_keys(path)
    for name in ("model.input.weight", "model.output.bias", "model.norm.weight"):
        assert f"model.{name}" in keys, sorted(keys)
        for state in ("exp_avg", "exp_avg_sq"):
            assert f"optimizer_0.state.{name}.{state}" in keys, sorted(keys)
    assert not any(key.startswith("optimizer_0.state.0.") for key in keys), "state must be keyed by name, not position"


def test_checkpoint_holds_whole_tensors_equal_to_colossal_ddp(zero2_checkpoint, ddp_checkpoint):
    """Both strategies trained the same epoch: the files must hold the same full weights and optimizer state."""
    zero_path, saved = zero2_checkpoint
    zero_keys = {key for key in saved_keys(zero_path) if key.startswith(("model.", "optimizer_"))}
    ddp_keys = {key for key in saved_keys(ddp_checkpoint) if key.startswith(("model.", "optimizer_"))}
    assert zero_keys == ddp_keys
    zero = read_sharded(zero_path, keys={"model", "optimizer_0"})
    ddp = read_sharded(ddp_checkpoint, keys={"model", "optimizer_0"})
    torch.testing.assert_close(zero["model"], saved, rtol=0, atol=0)
    torch.testing.assert_close(zero["model"], ddp["model"], rtol=1e-5, atol=1e-6)
    zero_state, ddp_state = zero["optimizer_0"]["state"], ddp["optimizer_0"]["state"]
    assert set(zero_state) == set(ddp_state)
    for name, state in ddp_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            assert zero_state[name][key].shape == state[key].shape, (name, key)  # whole tensors, not one shard
            torch.testing.assert_close(zero_state[name][key], state[key], rtol=1e-5, atol=1e-6, msg=f"{name}.{key}")
        assert float(zero_state[name]["step"]) == float(state["step"]) == 8.0


def test_resume_at_one_rank_continues_the_same_training(rank_pool_1, zero2_checkpoint, zero2_reference):
    path, _ = zero2_checkpoint
    reference = zero2_reference[0]
    # One rank with twice the per-rank batch sees the same global batches; its shard is the whole tensor.
    resumed = rank_pool_1.run(resume_body, ZERO2, path, 8, 0.0)[0]
    torch.testing.assert_close(resumed, reference, rtol=1e-5, atol=1e-6)


def test_zero2_checkpoint_resumes_in_colossal_ddp(rank_pool_2, zero2_checkpoint):
    path, _ = zero2_checkpoint
    reference = rank_pool_2.run(uninterrupted_body, DDP, 0.0)
    resumed = rank_pool_2.run(resume_body, DDP, path, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=1e-5, atol=1e-6)


def test_colossal_ddp_checkpoint_resumes_in_zero1(rank_pool_2, ddp_checkpoint):
    reference = rank_pool_2.run(uninterrupted_body, ZERO1, 0.0)
    resumed = rank_pool_2.run(resume_body, ZERO1, ddp_checkpoint, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=1e-5, atol=1e-6)


def test_consolidate_gives_the_trained_weights_and_resumes_in_zero(
    rank_pool_2, zero2_checkpoint, zero2_reference, tmp_path
):
    from safetensors.torch import load_file

    path, saved = zero2_checkpoint
    weights = load_file(str(consolidate(path, tmp_path / "model.safetensors")))
    torch.testing.assert_close(weights, saved, rtol=0, atol=0)
    full = torch.load(consolidate(path, tmp_path / "full.ckpt"), weights_only=False)
    state = full["optimizer_states"][0]["state"]
    # Position 0 is the first parameter of the first group: model.input.weight (32 x 8), whole, not a shard.
    assert state[0]["exp_avg"].shape == (32, 8)
    assert state[0]["exp_avg_sq"].shape == (32, 8)
    # A single-file checkpoint holds whole tensors; ZeRO cuts its own rows out of them (optimizer state included).
    resumed = rank_pool_2.run(resume_body, ZERO2, str(tmp_path / "full.ckpt"), 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], zero2_reference[rank], rtol=1e-5, atol=1e-6)
