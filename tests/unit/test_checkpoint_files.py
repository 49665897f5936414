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
    locate_checkpoint,
    shards_root,
)
from lightning_colossal.checkpoint.optimizer_state import rekey_by_name, rekey_by_position
from lightning_colossal.checkpoint.sharded import load_metadata, read_sharded, remove_checkpoint, save_sharded

WEIGHT = torch.arange(6.0).reshape(2, 3)


def _save(path: Path, value: float = 0.0, epoch: int = 0) -> Path:
    save_sharded(path, {"model": {"layer.weight": WEIGHT + value}}, {"epoch": epoch})
    return path


def _fake_directory_checkpoint(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / DCP_METADATA_FILENAME).write_text(marker)
    (path / META_FILENAME).write_text(marker)
    return path


def test_kind_detection_and_errors(tmp_path):
    assert checkpoint_kind(_save(tmp_path / "a.ckpt")) is CheckpointKind.SHARDED
    assert checkpoint_kind(_fake_directory_checkpoint(tmp_path / "old.ckpt", "x")) is CheckpointKind.SHARDED_DIRECTORY
    full = tmp_path / "b.ckpt"
    torch.save({"state_dict": {"w": torch.ones(1)}, "epoch": 0}, full)
    assert checkpoint_kind(full) is CheckpointKind.FULL
    truncated = tmp_path / "c.ckpt"
    truncated.write_bytes(full.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"c\.ckpt.*truncated"):
        checkpoint_kind(truncated)
    with pytest.raises(ValueError, match="not a lightning_colossal checkpoint"):
        checkpoint_kind(tmp_path)
    with pytest.raises(FileNotFoundError, match="check the path"):
        checkpoint_kind(tmp_path / "missing.ckpt")


def test_checkpoint_file_is_a_plain_lightning_checkpoint_with_full_weights(tmp_path):
    """What load_from_checkpoint needs: torch.load with weights_only=True, no import of this package."""
    path = _save(tmp_path / "one.ckpt", epoch=3)
    contents = torch.load(path, weights_only=True)
    torch.testing.assert_close(contents["state_dict"]["layer.weight"], WEIGHT)
    assert contents["epoch"] == 3
    files = locate_checkpoint(path)
    assert files.has_shards and files.shards.parent == shards_root(path)
    assert load_metadata(files)["epoch"] == 3
    assert "state_dict" not in load_metadata(files)
    torch.testing.assert_close(read_sharded(files.shards)["model"]["layer.weight"], WEIGHT)


def test_second_save_replaces_the_first_and_its_shards(tmp_path):
    path = _save(tmp_path / "last.ckpt", value=0.0)
    first = locate_checkpoint(path).shards
    _save(path, value=1.0)
    second = locate_checkpoint(path).shards
    assert first != second and not first.exists()
    assert [child.name for child in shards_root(path).iterdir()] == [second.name]
    torch.testing.assert_close(torch.load(path, weights_only=True)["state_dict"]["layer.weight"], WEIGHT + 1)
    assert leftovers_of_interrupted_save(path) == []


def test_crash_before_the_file_is_replaced_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import lightning_colossal.checkpoint.sharded as sharded

    path = _save(tmp_path / "last.ckpt", value=0.0)
    previous = locate_checkpoint(path).shards

    def dying_write(entry, contents):
        raise KeyboardInterrupt("killed while writing the checkpoint file")

    monkeypatch.setattr(sharded, "_write_checkpoint_file", dying_write)
    with pytest.raises(KeyboardInterrupt):
        _save(path, value=1.0)
    monkeypatch.undo()
    files = locate_checkpoint(path)
    assert files.shards == previous and files.has_shards
    assert [child.name for child in shards_root(path).iterdir()] == [previous.name]
    torch.testing.assert_close(read_sharded(files.shards)["model"]["layer.weight"], WEIGHT)


def test_crash_between_renames_points_user_to_previous_checkpoint(tmp_path, monkeypatch):
    """Replacing a format-1 directory takes two renames; a crash between them leaves the old one set aside."""
    path = _fake_directory_checkpoint(tmp_path / "last.ckpt", "old")
    real_replace = os.replace

    def dying_replace(source, destination):
        if Path(destination) == path.absolute():
            raise KeyboardInterrupt("killed between the two renames")
        return real_replace(source, destination)

    monkeypatch.setattr(atomic.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        _save(path, value=1.0)
    monkeypatch.undo()
    with pytest.raises(FileNotFoundError, match="Rename it"):
        checkpoint_kind(path)
    (aside,) = [leftover for leftover in leftovers_of_interrupted_save(path) if ".replaced-" in leftover.name]
    assert (aside / META_FILENAME).read_text() == "old"


def test_failed_write_leaves_previous_checkpoint_and_no_staging(tmp_path, monkeypatch):
    import lightning_colossal.checkpoint.sharded as sharded

    path = _save(tmp_path / "last.ckpt")
    previous = locate_checkpoint(path).shards

    def failing_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sharded.dcp, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        _save(path, value=1.0)
    assert locate_checkpoint(path).shards == previous
    assert [child.name for child in shards_root(path).iterdir()] == [previous.name]
    assert leftovers_of_interrupted_save(path) == []


def test_format_1_directory_is_replaced_by_a_new_save(tmp_path):
    path = _fake_directory_checkpoint(tmp_path / "last.ckpt", "old")
    _save(path)
    assert checkpoint_kind(path) is CheckpointKind.SHARDED
    assert leftovers_of_interrupted_save(path) == []


def test_remove_checkpoint_takes_the_shards_and_spares_a_link_target(tmp_path):
    target = _save(tmp_path / "epoch=1.ckpt")
    link = tmp_path / "last.ckpt"
    link.symlink_to(target.name)
    assert locate_checkpoint(link).shards == locate_checkpoint(target).shards
    remove_checkpoint(link)
    assert not link.exists() and locate_checkpoint(target).has_shards
    remove_checkpoint(target)
    assert not target.exists() and not shards_root(target).exists()


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


def test_checkpoint_file_cut_in_half_is_named_when_its_weights_are_read(tmp_path):
    from lightning_colossal.checkpoint.sharded import load_file_weights

    path = tmp_path / "big.ckpt"
    save_sharded(path, {"model": {"layer.weight": torch.randn(512, 256)}}, {"epoch": 0})
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"cut\.ckpt.*truncated"):
        load_file_weights(locate_checkpoint(cut))


def _damage(shards: Path, how: str) -> None:
    data_file = sorted(shards.glob("*.distcp"))[0]
    if how == "missing data file":
        data_file.unlink()
    elif how == "truncated data file":
        data_file.write_bytes(data_file.read_bytes()[:40])
    else:
        index = shards / DCP_METADATA_FILENAME
        index.write_bytes(index.read_bytes()[:50])


@pytest.mark.parametrize("how", ["missing data file", "truncated data file", "truncated index"])
def test_damaged_shards_are_named_with_the_fix_by_every_reader(tmp_path, capsys, how):
    from lightning_colossal.checkpoint.sharded import saved_shapes
    from lightning_colossal.consolidate import main

    path = tmp_path / "last.ckpt"
    save_sharded(path, {"model": {"layer.weight": torch.randn(64, 32)}}, {"epoch": 0})
    shards = locate_checkpoint(path).shards
    assert shards is not None
    _damage(shards, how)
    expected = r"Cannot read the checkpoint's shards in .*missing or cut short.*Copy the whole shards directory"
    with pytest.raises(ValueError, match=expected):
        read_sharded(path)
    if how == "truncated index":
        with pytest.raises(ValueError, match=expected):
            saved_shapes(path)
    assert main([str(path), str(tmp_path / "weights.safetensors")]) == 2
    assert "Copy the whole shards directory" in capsys.readouterr().err
