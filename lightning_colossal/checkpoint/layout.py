"""What a lightning_colossal checkpoint looks like on disk, and how to tell what a path holds.

A *sharded* checkpoint is a directory::

    epoch=0-step=100.ckpt/
        .metadata              torch.distributed.checkpoint (DCP) index of every saved item
        __0_0.distcp ...       one data file per writing rank: each rank writes its own pieces
        meta.pt                everything Lightning adds (loops, callbacks, schedulers, precision/loss-scaler
                               state, hyper-parameters) plus ``FORMAT_KEY`` describing the writer

Inside DCP the items are keyed by name, never by position, so any strategy at any world size can find them:

- ``model.<name>``: model weights by the LightningModule's own parameter/buffer names (fp32 masters where the
  strategy keeps them);
- ``optimizer_<i>.state.<name>.<state key>`` and ``optimizer_<i>.param_groups``: the i-th optimizer, its
  state keyed by parameter name (torch's distributed state-dict format);
- ``rng.rank_<r>.*``: random-number-generator state of each rank, restored when the world size matches.

A *full* checkpoint is one ``torch.save`` file as written by Lightning's own strategies (or by the consolidate
command): ``state_dict``, ``optimizer_states`` keyed by parameter position, and the same Lightning entries.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

META_FILENAME = "meta.pt"
DCP_METADATA_FILENAME = ".metadata"
FORMAT_KEY = "lightning_colossal"
FORMAT_VERSION = 1

MODEL_KEY = "model"
RNG_KEY = "rng"
# Names of leftovers of an interrupted save, next to the checkpoint they belong to.
STAGING_MARKER = ".partial-"
REPLACED_MARKER = ".replaced-"


def optimizer_key(index: int) -> str:
    return f"optimizer_{index}"


def rng_key(rank: int) -> str:
    return f"rank_{rank}"


class CheckpointKind(Enum):
    SHARDED = "sharded"
    FULL = "full"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A directory holding both DCP's index and our ``meta.pt``: the two files a finished save leaves behind."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / DCP_METADATA_FILENAME).is_file()


def leftovers_of_interrupted_save(path: str | Path) -> list[Path]:
    """Staging or replaced copies of ``path`` left by a save that did not finish, newest first."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    prefix = f".{path.name}"
    found = [
        sibling
        for sibling in path.parent.iterdir()
        if sibling.name.startswith(prefix + STAGING_MARKER) or sibling.name.startswith(prefix + REPLACED_MARKER)
    ]
    return sorted(found, key=lambda sibling: sibling.stat().st_mtime, reverse=True)


def checkpoint_kind(path: str | Path) -> CheckpointKind:
    """Tell a sharded checkpoint directory from a full checkpoint file.

    Raises:
        FileNotFoundError: nothing is at ``path``; names a previous checkpoint kept aside by an interrupted save.
        ValueError: ``path`` exists but is not a checkpoint (e.g. an unfinished save or an unrelated directory).
    """
    path = Path(path)
    if is_sharded_checkpoint(path):
        return CheckpointKind.SHARDED
    if path.is_file():
        return CheckpointKind.FULL
    if path.is_dir():
        missing = [name for name in (DCP_METADATA_FILENAME, META_FILENAME) if not (path / name).is_file()]
        raise ValueError(
            f"{path} is a directory but not a lightning_colossal checkpoint: it lacks {' and '.join(missing)}."
            " Pass the checkpoint directory itself (e.g. `.../checkpoints/last.ckpt`), not its parent, or a full"
            " checkpoint file."
        )
    replaced = [leftover for leftover in leftovers_of_interrupted_save(path) if REPLACED_MARKER in leftover.name]
    if replaced and is_sharded_checkpoint(replaced[0]):
        raise FileNotFoundError(
            f"No checkpoint at {path}, but a save into it was interrupted after the previous checkpoint was set aside"
            f" at {replaced[0]}. Rename that directory to {path.name} to resume from the previous checkpoint."
        )
    raise FileNotFoundError(f"No checkpoint at {path}: check the path (ckpt_path=...) or pass None to start fresh.")
