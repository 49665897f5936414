"""The consolidate command line: outputs, renaming, and errors that name the fix."""

import importlib
from pathlib import Path

import pytest
import torch

from lightning_colossal.checkpoint.sharded import save_sharded
from lightning_colossal.consolidate import main

WEIGHTS = {"model.layer.weight": torch.arange(6.0).reshape(2, 3), "model.layer.bias": torch.ones(2)}
OPTIMIZER = {
    "state": {"model.layer.weight": {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.5)}},
    "param_groups": [{"lr": 0.1, "params": ["model.layer.weight", "model.layer.bias"]}],
}


@pytest.fixture
def sharded_checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "epoch=0-step=3.ckpt"
    save_sharded(path, {"model": WEIGHTS, "optimizer_0": OPTIMIZER}, {"epoch": 0, "global_step": 3, "loops": {}})
    return path


def test_safetensors_output(sharded_checkpoint, tmp_path, capsys):
    from safetensors.torch import load_file

    output = tmp_path / "model.safetensors"
    assert main([str(sharded_checkpoint), str(output)]) == 0
    assert "wrote" in capsys.readouterr().out
    torch.testing.assert_close(load_file(str(output)), WEIGHTS)


def test_the_command_says_who_wrote_the_checkpoint(tmp_path, capsys):
    from lightning_colossal.checkpoint.format import CheckpointDescription

    path = tmp_path / "described.ckpt"
    described = CheckpointDescription(strategy="ColossalZeroStrategy", world_size=2, num_optimizers=0)
    save_sharded(path, {"model": WEIGHTS}, {"epoch": 0}, description=described)
    assert main([str(path), str(tmp_path / "model.safetensors")]) == 0
    expected = f"from a checkpoint saved by ColossalZeroStrategy at world size 2 with torch {torch.__version__}"
    assert expected in capsys.readouterr().out


def test_full_lightning_checkpoint_output(sharded_checkpoint, tmp_path):
    output = tmp_path / "full.ckpt"
    assert main([str(sharded_checkpoint), str(output)]) == 0
    full = torch.load(output, weights_only=False)
    assert full["global_step"] == 3
    torch.testing.assert_close(full["state_dict"], WEIGHTS)
    optimizer = full["optimizer_states"][0]
    assert optimizer["param_groups"] == [{"lr": 0.1, "params": [0, 1]}]
    torch.testing.assert_close(optimizer["state"][0]["exp_avg"], torch.full((2, 3), 0.5))


def test_weights_only_with_stripped_prefix(sharded_checkpoint, tmp_path):
    output = tmp_path / "inner.pt"
    assert main([str(sharded_checkpoint), str(output), "--weights-only", "--strip-prefix", "model."]) == 0
    assert set(torch.load(output, weights_only=True)) == {"layer.weight", "layer.bias"}


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["{checkpoint}", "{tmp}/x.pt", "--strip-prefix", "model."], "add --weights-only"),
        (["{checkpoint}", "{tmp}/x.pt", "--weights-only", "--strip-prefix", "encoder."], "fix --strip-prefix"),
        (["{tmp}/missing.ckpt", "{tmp}/x.pt"], "No checkpoint at"),
        (["{tmp}", "{tmp}/x.pt"], "not a lightning_colossal checkpoint"),
        (["{checkpoint}", "{tmp}"], "is a directory"),
    ],
)
def test_errors_exit_2_and_name_the_fix(sharded_checkpoint, tmp_path, capsys, arguments, message):
    filled = [argument.format(checkpoint=sharded_checkpoint, tmp=tmp_path) for argument in arguments]
    assert main(filled) == 2
    assert message in capsys.readouterr().err


def test_file_copied_without_its_shards_still_gives_its_weights(sharded_checkpoint, tmp_path, capsys):
    import shutil

    from lightning_colossal.checkpoint.layout import shards_root

    shutil.rmtree(shards_root(sharded_checkpoint))
    output = tmp_path / "weights.pt"
    assert main([str(sharded_checkpoint), str(output), "--weights-only"]) == 0
    torch.testing.assert_close(torch.load(output, weights_only=True), WEIGHTS)
    assert main([str(sharded_checkpoint), str(tmp_path / "full.ckpt")]) == 2
    assert "copy that directory next to the file" in capsys.readouterr().err


def test_a_failed_write_keeps_the_previous_output_and_leaves_no_temporary(sharded_checkpoint, tmp_path, monkeypatch):
    # The package exports the function under the module's name: take the module itself.
    consolidate_module = importlib.import_module("lightning_colossal.checkpoint.consolidate")

    output = tmp_path / "full.ckpt"
    output.write_bytes(b"previous")

    def dying_save(contents, path):
        Path(path).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(consolidate_module.torch, "save", dying_save)
    with pytest.raises(OSError, match="disk full"):
        consolidate_module.consolidate(sharded_checkpoint, output)
    assert output.read_bytes() == b"previous"
    assert sorted(path.name for path in tmp_path.iterdir() if path.name.startswith(".full.ckpt")) == []


def test_the_output_is_streamed_to_disk_not_built_in_memory_first(sharded_checkpoint, tmp_path, monkeypatch):
    # The package exports the function under the module's name: take the module itself.
    consolidate_module = importlib.import_module("lightning_colossal.checkpoint.consolidate")

    targets = []
    real_save = torch.save

    def recording_save(contents, target):
        targets.append(target)
        real_save(contents, target)

    monkeypatch.setattr(consolidate_module.torch, "save", recording_save)
    output = tmp_path / "full.ckpt"
    consolidate_module.consolidate(sharded_checkpoint, output)
    # torch.save went straight to a file next to the output (one copy of the weights in memory), never to a buffer.
    assert len(targets) == 1 and isinstance(targets[0], Path) and targets[0].parent == output.parent
    assert not targets[0].exists(), "the temporary file was renamed onto the output"
    assert torch.load(output, weights_only=False)["global_step"] == 3
