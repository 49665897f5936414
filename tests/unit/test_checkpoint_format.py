"""The checkpoint format's one home (``checkpoint/format.py``): the file's description and the tensor layout, and
checkpoints written by earlier versions, format 1 included, read by today's readers."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_colossal.checkpoint.consolidate import consolidate
from lightning_colossal.checkpoint.format import (
    FORMAT_KEY,
    CheckpointDescription,
    SavedItems,
    TrainingTensors,
)
from lightning_colossal.checkpoint.layout import CheckpointKind, locate_checkpoint, shards_root
from lightning_colossal.checkpoint.sharded import load_description, save_sharded, saved_shapes

WEIGHT = torch.arange(6.0).reshape(2, 3)
OPTIMIZER = {
    "state": {"layer.weight": {"step": torch.tensor(3.0), "exp_avg": torch.full((2, 3), 0.5)}},
    "param_groups": [{"lr": 0.1, "params": ["layer.weight"]}],
}
# The entry the strategies wrote before the description had a class of its own (format 2), for a ZeRO run.
ENTRY_BEFORE_THE_DESCRIPTION = {
    "format_version": 2,
    "strategy": "ColossalZeroStrategy",
    "world_size": 2,
    "num_optimizers": 1,
    "parallel_dims": {"pp": 1, "dp": 2, "sp": 1, "tp": 1},
    "shards": "0123456789ab",
}
# Format 1 wrote the same entry into meta.pt, without shards.
FORMAT_1_ENTRY = {
    "format_version": 1,
    "strategy": "ColossalGeminiStrategy",
    "world_size": 4,
    "num_optimizers": 1,
    "parallel_dims": {"pp": 1, "dp": 4, "sp": 1, "tp": 1},
}


def test_description_writes_the_entry_earlier_versions_wrote():
    """Byte-compatible both ways: the same fields under the same names, in the same order."""
    description = CheckpointDescription.from_contents({FORMAT_KEY: ENTRY_BEFORE_THE_DESCRIPTION})
    assert description is not None
    assert description.shards == "0123456789ab" and description.num_optimizers == 1
    assert list(description.to_entry().items()) == list(ENTRY_BEFORE_THE_DESCRIPTION.items())


def test_description_reads_every_earlier_entry_and_leaves_unknown_fields_unknown():
    format_1 = CheckpointDescription.from_contents({FORMAT_KEY: FORMAT_1_ENTRY})
    assert format_1 == CheckpointDescription(
        format_version=1,
        strategy="ColossalGeminiStrategy",
        world_size=4,
        num_optimizers=1,
        parallel_dims={"pp": 1, "dp": 4, "sp": 1, "tp": 1},
    )
    # save_sharded called without a strategy recorded only the version and the shards.
    bare = CheckpointDescription.from_contents({FORMAT_KEY: {"format_version": 2, "shards": "abc"}})
    assert bare == CheckpointDescription(shards="abc")
    assert bare.world_size is None and bare.num_optimizers == 0
    # A field a newer writer adds is ignored, not refused.
    newer = CheckpointDescription.from_contents({FORMAT_KEY: {**ENTRY_BEFORE_THE_DESCRIPTION, "later": 1}})
    assert newer is not None and newer.strategy == "ColossalZeroStrategy"
    # Lightning's own files, and consolidate's, carry no description.
    assert CheckpointDescription.from_contents({"state_dict": {}, "epoch": 0}) is None
    assert CheckpointDescription.from_contents([1, 2]) is None


def test_description_leaves_a_plain_lightning_checkpoint_when_removed():
    contents = {"epoch": 1, FORMAT_KEY: dict(ENTRY_BEFORE_THE_DESCRIPTION)}
    removed = CheckpointDescription.remove_from(contents)
    assert removed is not None and removed.world_size == 2
    assert contents == {"epoch": 1}
    removed.add_to(contents)
    assert contents[FORMAT_KEY] == ENTRY_BEFORE_THE_DESCRIPTION


def test_training_tensors_lay_out_the_documented_items(tmp_path):
    rng = {"torch": torch.get_rng_state()}
    tensors = TrainingTensors(model={"layer.weight": WEIGHT}, optimizers=[OPTIMIZER], rng_by_rank={3: rng})
    state = tensors.to_state()
    assert set(state) == {"model", "optimizer_0", "rng"} and set(state["rng"]) == {"rank_3"}
    read_back = TrainingTensors.from_state(state)
    assert read_back.model is tensors.model and read_back.optimizers == [OPTIMIZER]
    assert set(read_back.rng_by_rank) == {3}

    path = tmp_path / "last.ckpt"
    save_sharded(path, state, {"epoch": 0})
    saved = SavedItems(saved_shapes(path))
    assert saved.model_names() == {"layer.weight"}
    assert tuple(saved.model_shape("layer.weight")) == (2, 3) and saved.model_shape("missing") is None
    assert saved.holds_optimizer_group(0, 0) and not saved.holds_optimizer_group(0, 1)
    assert saved.holds_optimizer_setting(0, 0, "lr") and not saved.holds_optimizer_setting(0, 0, "initial_lr")
    assert saved.holds_rng_of(3) and not saved.holds_rng_of(0)


def test_save_records_the_description_with_its_shards(tmp_path):
    path = tmp_path / "last.ckpt"
    described = CheckpointDescription(strategy="ColossalDDPStrategy", world_size=1, num_optimizers=1)
    save_sharded(path, TrainingTensors({"layer.weight": WEIGHT}, [OPTIMIZER]).to_state(), {}, description=described)
    files = locate_checkpoint(path)
    recorded = load_description(files)
    assert recorded.strategy == "ColossalDDPStrategy" and recorded.num_optimizers == 1
    assert recorded.torch_version == torch.__version__
    assert recorded.provenance() == f"saved by ColossalDDPStrategy at world size 1 with torch {torch.__version__}"
    assert files.shards == shards_root(path) / recorded.shards
    # The file is still a plain Lightning checkpoint that torch loads without this package's classes.
    assert torch.load(path, weights_only=True)[FORMAT_KEY]["strategy"] == "ColossalDDPStrategy"


def _write_shards(directory: Path) -> None:
    state = TrainingTensors(model={"layer.weight": WEIGHT}, optimizers=[OPTIMIZER]).to_state()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)


def test_a_format_2_checkpoint_written_before_the_description_loads(tmp_path):
    """The file and shards as the earlier writer laid them out, by hand: every reader decodes them."""
    path = tmp_path / "old.ckpt"
    _write_shards(shards_root(path) / ENTRY_BEFORE_THE_DESCRIPTION["shards"])
    torch.save({"epoch": 2, FORMAT_KEY: ENTRY_BEFORE_THE_DESCRIPTION, "state_dict": {"layer.weight": WEIGHT}}, path)
    files = locate_checkpoint(path)
    assert files.kind is CheckpointKind.SHARDED and files.has_shards
    assert load_description(files) == CheckpointDescription.from_contents({FORMAT_KEY: ENTRY_BEFORE_THE_DESCRIPTION})
    full = torch.load(consolidate(path, tmp_path / "full.ckpt"), weights_only=False)
    assert FORMAT_KEY not in full and full["epoch"] == 2
    torch.testing.assert_close(full["state_dict"]["layer.weight"], WEIGHT)
    assert full["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_a_format_1_directory_loads(tmp_path):
    path = tmp_path / "old.ckpt"
    _write_shards(path)
    torch.save({"epoch": 5, FORMAT_KEY: FORMAT_1_ENTRY}, path / "meta.pt")
    files = locate_checkpoint(path)
    assert files.kind is CheckpointKind.SHARDED_DIRECTORY
    description = load_description(files)
    assert description.format_version == 1 and description.world_size == 4 and description.shards is None
    assert description.torch_version is None and description.provenance() == (
        "saved by ColossalGeminiStrategy at world size 4"
    )
    full = torch.load(consolidate(path, tmp_path / "full.ckpt"), weights_only=False)
    assert FORMAT_KEY not in full and full["epoch"] == 5
    torch.testing.assert_close(full["optimizer_states"][0]["state"][0]["exp_avg"], torch.full((2, 3), 0.5))


@pytest.mark.parametrize("key", ["rank_x", "rank_", "3"])
def test_random_state_under_foreign_keys_is_not_taken_for_a_rank(key):
    assert TrainingTensors.from_state({"model": {}, "rng": {key: {}}}).rng_by_rank == {}
