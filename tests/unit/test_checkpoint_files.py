"""Checkpoint paths, the atomic commit and optimizer re-keying, without any process group."""

import os
from pathlib import Path

import pytest
import torch

from lightning_colossal.checkpoint import atomic
from lightning_colossal.checkpoint.layout import (
    DCP_METADATA_FILENAME,
    META_FILENAME,
    CheckpointKind,
    checkpoint_kind,
    leftovers_of_interrupted_save,
)
from lightning_colossal.checkpoint.optimizer_state import rekey_by_name, rekey_by_position
from lightning_colossal.checkpoint.sharded import save_sharded


def _fake_checkpoint(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / DCP_METADATA_FILENAME).write_text(marker)
    (path / META_FILENAME).write_text(marker)
    return path


def test_kind_detection_and_errors(tmp_path):
    sharded = _fake_checkpoint(tmp_path / "a.ckpt", "x")
    assert checkpoint_kind(sharded) is CheckpointKind.SHARDED
    full = tmp_path / "b.ckpt"
    full.write_bytes(b"0")
    assert checkpoint_kind(full) is CheckpointKind.FULL
    with pytest.raises(ValueError, match="not a lightning_colossal checkpoint"):
        checkpoint_kind(tmp_path)
    with pytest.raises(FileNotFoundError, match="check the path"):
        checkpoint_kind(tmp_path / "missing.ckpt")


def test_commit_replaces_previous_checkpoint(tmp_path):
    target = _fake_checkpoint(tmp_path / "last.ckpt", "old")
    staging = _fake_checkpoint(atomic.staging_path(target), "new")
    atomic.commit(staging, target)
    assert (target / META_FILENAME).read_text() == "new"
    assert leftovers_of_interrupted_save(target) == []


def test_crash_before_commit_keeps_previous_and_next_save_cleans_up(tmp_path):
    target = _fake_checkpoint(tmp_path / "last.ckpt", "old")
    staging = atomic.staging_path(target)
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"half")  # a save that died while writing
    assert checkpoint_kind(target) is CheckpointKind.SHARDED
    assert (target / META_FILENAME).read_text() == "old"
    assert leftovers_of_interrupted_save(target) == [staging]
    atomic.remove_leftovers(target)
    assert not staging.exists()


def test_crash_between_renames_points_user_to_previous_checkpoint(tmp_path, monkeypatch):
    target = _fake_checkpoint(tmp_path / "last.ckpt", "old")
    staging = _fake_checkpoint(atomic.staging_path(target), "new")
    real_replace = os.replace
    calls = []

    def dying_replace(source, destination):
        calls.append(source)
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the two renames")
        return real_replace(source, destination)

    monkeypatch.setattr(atomic.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        atomic.commit(staging, target)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="Rename that directory"):
        checkpoint_kind(target)


def test_failed_write_leaves_previous_checkpoint_and_no_staging(tmp_path, monkeypatch):
    target = _fake_checkpoint(tmp_path / "last.ckpt", "old")
    import lightning_colossal.checkpoint.sharded as sharded

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sharded.dcp, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_sharded(target, {"model": {"w": torch.ones(2)}}, {"epoch": 0})
    assert (target / META_FILENAME).read_text() == "old"
    assert leftovers_of_interrupted_save(target) == []


def test_single_process_save_round_trip(tmp_path):
    from lightning_colossal.checkpoint.consolidate import read_sharded
    from lightning_colossal.checkpoint.sharded import load_metadata

    target = tmp_path / "one.ckpt"
    save_sharded(target, {"model": {"layer.weight": torch.arange(6.0).reshape(2, 3)}}, {"epoch": 3})
    assert checkpoint_kind(target) is CheckpointKind.SHARDED
    assert load_metadata(target)["epoch"] == 3
    torch.testing.assert_close(read_sharded(target)["model"]["layer.weight"], torch.arange(6.0).reshape(2, 3))


def test_rekey_round_trip_and_mismatch_errors():
    position_keyed = {
        "state": {0: {"step": torch.tensor(1.0)}, 2: {"step": torch.tensor(2.0)}},
        "param_groups": [{"lr": 0.1, "params": [0, 1]}, {"lr": 0.2, "params": [2]}],
    }
    by_name = rekey_by_name(position_keyed, [["a", "b"], ["c"]])
    assert set(by_name["state"]) == {"a", "c"}  # b never stepped: no state, and none invented
    assert by_name["param_groups"][1] == {"lr": 0.2, "params": ["c"]}
    back = rekey_by_position(by_name)
    assert back["param_groups"] == position_keyed["param_groups"]
    assert set(back["state"]) == {0, 2}
    with pytest.raises(ValueError, match="parameter groups"):
        rekey_by_name(position_keyed, [["a", "b", "c"]])
    with pytest.raises(ValueError, match="has 2 parameters"):
        rekey_by_name(position_keyed, [["a"], ["c"]])
