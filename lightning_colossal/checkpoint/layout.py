"""Where a lightning_colossal checkpoint lies on disk, and how to tell what a path holds (``format`` says what it
holds).

A checkpoint saved by any lightning_colossal strategy at ``epoch=0-step=100.ckpt`` is two things side by side::

    epoch=0-step=100.ckpt                  one torch.save file: a plain Lightning checkpoint with the *full* model
                                           weights (``state_dict``), hyper-parameters, loops, callbacks, schedulers
                                           and precision state, plus the format's description naming its shards
    epoch=0-step=100.ckpt.shards/<id>/     the sharded training state, written by every rank in parallel with
        .metadata                          torch.distributed.checkpoint (DCP): its index
        __0_0.distcp ...                   one data file per writing rank

The file is what ``LightningModule.load_from_checkpoint`` reads: any process, no process group, no import of this
package, the user's own class. The shards are what resuming reads: each rank takes only the pieces it needs, at any
world size and in any strategy; ``format`` lists the items they hold, keyed by name.

``<id>`` is new for every save, and the file names it: replacing the file is the single commit point of a save (see
[Note: atomic save]). Copy or move a checkpoint as the file *and* its ``.shards`` directory; the file alone still
loads its weights anywhere, but cannot resume training.

Two older or foreign layouts are read too: a *sharded directory* (format version 1: the DCP files and a ``meta.pt``
of Lightning's entries inside a directory named like the checkpoint), and a *full* checkpoint file as written by
Lightning's own strategies or the consolidate command (``state_dict`` plus ``optimizer_states`` keyed by position).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from lightning_colossal.checkpoint.format import CheckpointDescription
from lightning_colossal.disk.files import is_tier_directory

META_FILENAME = "meta.pt"
DCP_METADATA_FILENAME = ".metadata"
SHARDS_SUFFIX = ".shards"

# Names of leftovers of an interrupted save, next to the checkpoint they belong to (or inside its shards directory).
STAGING_MARKER = ".partial-"
REPLACED_MARKER = ".replaced-"


def shards_root(entry: str | Path) -> Path:
    """The directory next to the checkpoint file ``entry`` that holds its shards (one sub-directory per save)."""
    entry = Path(entry)
    return entry.parent / f"{entry.name}{SHARDS_SUFFIX}"


class CheckpointKind(Enum):
    SHARDED = "sharded"  # checkpoint file with full weights + its DCP shards next to it
    SHARDED_DIRECTORY = "sharded_directory"  # format version 1: DCP files and meta.pt in one directory
    FULL = "full"  # one file from Lightning's own strategies or the consolidate command


@dataclass(frozen=True)
class CheckpointFiles:
    """Where the parts of a checkpoint are: what ``locate_checkpoint`` finds at a path."""

    kind: CheckpointKind
    path: Path
    shards: Path | None = None  # the DCP directory (sharded kinds); may be missing on disk for a copied file

    @property
    def has_shards(self) -> bool:
        return self.shards is not None and (self.shards / DCP_METADATA_FILENAME).is_file()


def is_sharded_directory(path: str | Path) -> bool:
    """A format-1 directory holding both DCP's index and ``meta.pt``: the two files a finished save left behind."""
    path = Path(path)
    return path.is_dir() and (path / META_FILENAME).is_file() and (path / DCP_METADATA_FILENAME).is_file()


def is_sharded_checkpoint(path: str | Path) -> bool:
    """A checkpoint written by a lightning_colossal strategy, in either sharded layout."""
    try:
        return locate_checkpoint(path).kind is not CheckpointKind.FULL
    except (FileNotFoundError, ValueError):
        return False


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


def read_checkpoint_file(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Load a checkpoint file with its tensors memory-mapped: only the pages a caller touches are read from disk.

    Raises:
        ValueError: the file is not a readable torch checkpoint (truncated, still being copied, or another format),
            naming the file.
    """
    import torch

    try:
        contents = torch.load(
            path, map_location="cpu", mmap=True, weights_only=False if weights_only is None else weights_only
        )
    except RuntimeError as error:
        if "zip" not in str(error) and "mmap" not in str(error):
            raise
        # Files written with the legacy (non-zip) serialisation cannot be memory-mapped; they load whole.
        try:
            contents = torch.load(
                path, map_location="cpu", weights_only=False if weights_only is None else weights_only
            )
        except Exception as second_error:
            raise ValueError(
                f"Cannot read the checkpoint file {path} ({second_error}): it is truncated (an interrupted copy or"
                " save?) or not a torch checkpoint. Use an intact copy, or an earlier checkpoint."
            ) from second_error
    if not isinstance(contents, dict):
        raise ValueError(f"{path} holds a {type(contents).__name__}, not a Lightning checkpoint (a dict of entries).")
    return contents


def locate_checkpoint(path: str | Path) -> CheckpointFiles:
    """Tell what ``path`` holds and where its parts are.

    Raises:
        FileNotFoundError: nothing is at ``path``; names a previous checkpoint kept aside by an interrupted save.
        ValueError: ``path`` exists but is not a checkpoint (e.g. an unfinished save or an unrelated directory).
    """
    path = Path(path)
    if is_tier_directory(path):
        raise ValueError(
            f"{path} is (inside) the working directory of a lightning_colossal disk tier (offload_dir), not a"
            " checkpoint: it holds optimizer state between two steps of one run and cannot be resumed from. Pass a"
            " checkpoint file (e.g. `.../checkpoints/last.ckpt`)."
        )
    if is_sharded_directory(path):
        return CheckpointFiles(CheckpointKind.SHARDED_DIRECTORY, path, shards=path)
    if path.is_file():
        description = CheckpointDescription.from_contents(read_checkpoint_file(path))
        if description is None or description.shards is None:
            return CheckpointFiles(CheckpointKind.FULL, path)
        # A symbolic link (ModelCheckpoint(save_last="link")) shares the shards of the file it points to.
        real = path.resolve()
        return CheckpointFiles(CheckpointKind.SHARDED, path, shards=shards_root(real) / description.shards)
    if path.is_dir():
        missing = [name for name in (DCP_METADATA_FILENAME, META_FILENAME) if not (path / name).is_file()]
        raise ValueError(
            f"{path} is a directory but not a lightning_colossal checkpoint: it lacks {' and '.join(missing)}."
            " Pass the checkpoint file itself (e.g. `.../checkpoints/last.ckpt`), not a directory."
        )
    replaced = [leftover for leftover in leftovers_of_interrupted_save(path) if REPLACED_MARKER in leftover.name]
    if replaced:
        raise FileNotFoundError(
            f"No checkpoint at {path}, but a save into it was interrupted after the previous checkpoint was set aside"
            f" at {replaced[0]}. Rename it to {path.name} to resume from the previous checkpoint."
        )
    raise FileNotFoundError(f"No checkpoint at {path}: check the path (ckpt_path=...) or pass None to start fresh.")


def checkpoint_kind(path: str | Path) -> CheckpointKind:
    """The kind of checkpoint at ``path`` (see ``locate_checkpoint`` for the errors)."""
    return locate_checkpoint(path).kind
