"""Saving and loading checkpoints: the sharded training state with ``torch.distributed.checkpoint`` (DCP) and the
checkpoint file with the full weights next to it (see ``layout``).

Each rank hands DCP the tensors it holds: full tensors (replicated, DDP), ``DTensor`` shards (FSDP2, tensor
parallelism) or flat-buffer shards described as DTensors by an engine. DCP's planner spreads replicated items
over the ranks, so every rank writes a piece and nothing is gathered on one rank. On load, DCP reads the pieces
each destination tensor needs, whatever layout wrote them: that is what makes resuming at another world size or
in another strategy work.

The checkpoint file's full weights are read back from the shards just written, by rank 0 alone and from disk, so no
strategy needs a gather of its own, no rank ever holds more than it did while training except rank 0's host memory
for one copy of the weights, and the file holds exactly what the consolidate command would give.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_colossal.checkpoint import atomic
from lightning_colossal.checkpoint.deferred import (
    DeferredLoadPlanner,
    DeferredSavePlanner,
    deferred_save_writer,
    has_stand_ins,
)
from lightning_colossal.checkpoint.format import (
    CURRENT_MODEL_KEY,
    CURRENT_MODEL_STATE,
    MODEL_KEY,
    CheckpointDescription,
    TrainingTensors,
)
from lightning_colossal.checkpoint.layout import (
    DCP_METADATA_FILENAME,
    META_FILENAME,
    STAGING_MARKER,
    CheckpointFiles,
    CheckpointKind,
    locate_checkpoint,
    read_checkpoint_file,
    shards_root,
)
from lightning_colossal.distributed import collectives


def save_sharded(
    path: str | Path,
    tensor_state: dict[str, Any],
    metadata: dict[str, Any],
    group: ProcessGroup | None = None,
    description: CheckpointDescription | None = None,
    storage_writer: Callable[[str], StorageWriter] | None = None,
) -> None:
    """Write the checkpoint ``path`` and its shards atomically; every rank of ``group`` must call this.

    Args:
        path: the checkpoint file to create or replace (its shards go to ``path.shards/<id>/``).
        tensor_state: nested dict of this rank's tensors (and small picklable objects), ``TrainingTensors.to_state``.
        metadata: Lightning's non-tensor entries; only rank 0's copy is written.
        group: the ranks that share the checkpoint (the default group when ``None``).
        description: what the file records about the save (the one already in ``metadata``, if any, when ``None``).
        storage_writer: makes DCP's writer for the shards' directory (a background save's writer process,
            ``writer_process.ProcessShardWriter``); DCP's file writer when ``None``.
    """
    entry = Path(path).absolute()
    root = shards_root(entry)
    is_committer = collectives.rank(group) == 0
    save_id = collectives.broadcast_object(uuid.uuid4().hex[:12] if is_committer else None, source_rank=0, group=group)
    staging = root / f"{STAGING_MARKER}{save_id}"
    shards = root / save_id
    if is_committer:
        if entry.is_dir() and not entry.is_symlink() and any(entry.iterdir()) and not (entry / META_FILENAME).is_file():
            raise IsADirectoryError(
                f"Cannot save a checkpoint to {entry}: it is a directory that is not a checkpoint. Pass a file name"
                " such as `.../last.ckpt`."
            )
        root.mkdir(parents=True, exist_ok=True)
        atomic.remove_leftovers(entry)
        staging.mkdir()
    collectives.barrier(group)
    committed = False
    try:
        # One file per rank, written item by item: stand-ins are read as DCP reaches them ([Note: deferred tensors]).
        if storage_writer is not None:
            writer = storage_writer(str(staging))
        elif has_stand_ins():
            writer = deferred_save_writer(str(staging))
        else:
            writer = FileSystemWriter(staging)
        dcp.save(tensor_state, storage_writer=writer, planner=DeferredSavePlanner(), process_group=group)
        if is_committer:
            os.replace(staging, shards)
            contents = dict(metadata)
            described = description or CheckpointDescription.from_contents(metadata) or CheckpointDescription()
            weights = TrainingTensors.from_state(read_sharded(shards, keys={MODEL_KEY})).model
            for key in described.weights_keys():
                contents[key] = weights  # one object under each key: written once
            if CURRENT_MODEL_KEY in tensor_state:
                # A weight-averaging run: the file is a Lightning checkpoint another strategy (or Lightning) resumes.
                current = TrainingTensors.from_state(read_sharded(shards, keys={CURRENT_MODEL_KEY})).current_model
                contents[CURRENT_MODEL_STATE] = current
            described.committed(shards=save_id).add_to(contents)
            _write_checkpoint_file(entry, contents)
            committed = True
            # Only now is the previous save unreferenced; a crash before here left it intact and in use.
            for older in root.iterdir():
                if older.name != save_id:
                    shutil.rmtree(older, ignore_errors=True)
            atomic.fsync_directory(root)
    except BaseException as error:
        # DCP raises on every rank when any rank fails to write; leave no half-written save behind.
        if is_committer and not committed:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(shards, ignore_errors=True)
            atomic.remove_staging(entry)
        if isinstance(error, CheckpointException):
            # CheckpointException derives from BaseException and would slip past `except Exception` handlers.
            raise RuntimeError(
                f"Saving the checkpoint {entry} failed on ranks {sorted(error.failures)}; whatever was at that path"
                f" before is intact. First failure: {next(iter(error.failures.values()))!r}"
            ) from error
        raise
    collectives.barrier(group)


def _write_checkpoint_file(entry: Path, contents: dict[str, Any]) -> None:
    """torch.save ``contents`` into a hidden sibling, persist it, then rename it onto ``entry`` (the commit)."""
    temporary = atomic.staging_path(entry)
    with open(temporary, "wb") as handle:
        torch.save(contents, handle)
        handle.flush()
        os.fsync(handle.fileno())
    atomic.commit(temporary, entry)


def remove_checkpoint(path: str | Path) -> None:
    """Delete the checkpoint at ``path`` and its shards; a symbolic link is removed alone (its target stays)."""
    path = Path(path)
    if path.is_symlink():
        path.unlink()
        return
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    shutil.rmtree(shards_root(path), ignore_errors=True)


def saved_keys(path: str | Path) -> set[str]:
    """The flattened keys (``model.<name>``, ``optimizer_0.state.<name>.exp_avg``, ...) stored in a checkpoint's
    shards; ``path`` is the checkpoint or its DCP directory."""
    return set(saved_shapes(path))


def saved_shapes(path: str | Path) -> dict[str, torch.Size | None]:
    """The whole shape of every tensor stored in a checkpoint's shards by flattened key (``None`` for items saved as
    bytes); ``path`` is the checkpoint or its DCP directory. Reads the index only, not the tensors."""
    shards = shard_directory(path)
    with _damage_explained(shards):
        entries = FileSystemReader(str(shards)).read_metadata().state_dict_metadata
    return {key: getattr(entry, "size", None) for key, entry in entries.items()}


def _is_damage(cause: BaseException) -> bool:
    """Whether reading a shard directory failed because a file in it is missing or cut short: the file's absence, a
    short read, a truncated index (pickle; DCP's own reader reports that one as an AssertionError on "metadata is
    None"), a truncated item saved with torch.save (torch's zip reader)."""
    if isinstance(cause, AssertionError):
        return "metadata is None" in str(cause)
    if isinstance(cause, RuntimeError):
        return "PytorchStreamReader" in str(cause)
    return isinstance(cause, (OSError, EOFError, pickle.UnpicklingError))


@contextmanager
def _damage_explained(shards: Path) -> Iterator[None]:
    """Turn a read failure caused by a missing or truncated file in ``shards`` into an error that names the fix."""
    try:
        yield
    except CheckpointException as error:
        # DCP gathers each rank's failure into one exception (a BaseException, see save_sharded).
        damaged = next((cause for cause, _ in error.failures.values() if _is_damage(cause)), None)
        if damaged is None:
            raise
        raise _damaged(shards, damaged) from error
    except (OSError, EOFError, pickle.UnpicklingError, AssertionError, RuntimeError) as error:
        if not _is_damage(error):
            raise
        raise _damaged(shards, error) from error


def _damaged(shards: Path, cause: BaseException) -> ValueError:
    detail = f"{type(cause).__name__}: {cause}" if str(cause) else type(cause).__name__
    return ValueError(
        f"Cannot read the checkpoint's shards in {shards} ({detail}): a file there is missing or cut short (an"
        " interrupted copy or save?). Copy the whole shards directory again from an intact source, or use an earlier"
        " checkpoint. To start from the weights alone, load the checkpoint file with `load_from_checkpoint` (it holds"
        " the full weights) and fit without `ckpt_path`."
    )


def shard_directory(path: str | Path) -> Path:
    """The DCP directory of the checkpoint at ``path`` (``path`` itself when it is one)."""
    path = Path(path)
    if (path / DCP_METADATA_FILENAME).is_file():
        return path
    shards = locate_checkpoint(path).shards
    if shards is None:
        raise ValueError(f"{path} is a single-file checkpoint: it has no shards.")
    return shards


def read_sharded(path: str | Path, keys: set[str] | None = None) -> dict[str, Any]:
    """Load a checkpoint's sharded items (all, or the top-level ``keys``) as full tensors in this process; ``path``
    is the checkpoint or its DCP directory."""
    shards = shard_directory(path)
    state: dict[str, Any] = {}
    # The public dcp.load works on a copy of the dict it is given, so a planner that builds the state from the
    # checkpoint's own index never reaches the caller; torch's dcp_to_torch_save uses this same entry point.
    with _damage_explained(shards):
        _load_state_dict(
            state,
            storage_reader=FileSystemReader(str(shards)),
            planner=_EmptyStateDictLoadPlanner(keys=keys),
            no_dist=True,
        )
    return state


def load_sharded(
    shards: str | Path, tensor_state: dict[str, Any], allow_partial: bool, group: ProcessGroup | None = None
) -> None:
    """Fill ``tensor_state`` in place from the DCP directory ``shards``; every rank of ``group`` must call this.

    Tensors are copied into the given destination tensors (whatever their sharding); non-tensor values are replaced
    in the dict. With ``allow_partial`` a destination key missing from the checkpoint keeps its current value;
    otherwise DCP raises naming the key.
    """
    with _damage_explained(Path(shards)):
        planner = DeferredLoadPlanner(allow_partial_load=allow_partial)
        dcp.load(tensor_state, storage_reader=FileSystemReader(str(shards)), planner=planner, process_group=group)
        planner.finish()


def load_metadata(files: CheckpointFiles, weights_only: bool | None = None) -> dict[str, Any]:
    """Lightning's entries (loops, callbacks, schedulers, precision, hyper-parameters) of a sharded checkpoint.

    The full weights of a checkpoint file are left out: they are memory-mapped and never read here.
    """
    # These entries hold Lightning's loop and callback state, which needs full unpickling; honour an explicit choice.
    if files.kind is CheckpointKind.SHARDED_DIRECTORY:
        return read_checkpoint_file(files.path / META_FILENAME, weights_only)
    contents = read_checkpoint_file(files.path, weights_only)
    for key in (CheckpointDescription.from_contents(contents) or CheckpointDescription()).weights_keys():
        contents.pop(key, None)
    contents.pop(CURRENT_MODEL_STATE, None)  # whole weights too; the shards hold this rank's part
    return contents


def load_description(files: CheckpointFiles) -> CheckpointDescription:
    """What the checkpoint's file (or format 1's ``meta.pt``) records about the save; every field unknown when it
    records nothing."""
    return CheckpointDescription.from_contents(load_metadata(files)) or CheckpointDescription()


def load_file_weights(files: CheckpointFiles) -> dict[str, torch.Tensor]:
    """The full weights stored in a checkpoint file, read whole now: a file cut short fails here, naming the file,
    rather than when a memory-mapped tensor is first touched."""
    try:
        # Our own file, read like its Lightning entries (which need full unpickling).
        return torch.load(files.path, map_location="cpu", weights_only=False)["state_dict"]
    except (OSError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError) as error:
        raise ValueError(
            f"Cannot read the weights in the checkpoint file {files.path} ({error}): it is truncated (an interrupted"
            " copy?) or not a lightning_colossal checkpoint. Use an intact copy, or an earlier checkpoint."
        ) from error
