"""Atomic replacement of a checkpoint path by a fully written staging file or directory.

[Note: atomic save]
A save writes everything into hidden staging places first: the shards into ``NAME.shards/.partial-<id>``, renamed to
``NAME.shards/<id>`` when every rank has written, then the checkpoint file into ``.NAME.partial-<id>`` next to the
target. The commit is one rename of that file onto the target (a file replaces a file atomically), and the file
names its own shards, so a reader sees either the old checkpoint with its old shards or the new one with its new
shards. Only after the commit are the previous shards deleted. Where the target is a directory (format 1, or any
staging directory), rank 0 renames the existing target aside (``.NAME.replaced-<id>``), renames the staging copy
onto the target, syncs the parent directory, then deletes the old copy. A crash
before the commit leaves the previous checkpoint untouched and a hidden partial directory that does not look like
a checkpoint (its name is not the target's). A crash between the two renames leaves the previous checkpoint intact
under the replaced name, and ``checkpoint_kind`` tells the user how to get it back. The next save into the same
path removes leftovers of earlier interrupted saves.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from lightning_colossal.checkpoint.layout import REPLACED_MARKER, STAGING_MARKER, leftovers_of_interrupted_save


def staging_path(target: Path) -> Path:
    """A fresh hidden sibling of ``target`` to write into."""
    return target.parent / f".{target.name}{STAGING_MARKER}{uuid.uuid4().hex[:12]}"


def remove_leftovers(target: Path) -> None:
    """Delete staging/replaced copies of ``target`` left by interrupted saves (only the committing rank calls this)."""
    for leftover in leftovers_of_interrupted_save(target):
        _remove_path(leftover)


def remove_staging(target: Path) -> None:
    """Delete staging copies of ``target`` only: a copy set aside by an interrupted commit is the user's previous
    checkpoint and stays until the next save (see [Note: atomic save])."""
    for leftover in leftovers_of_interrupted_save(target):
        if STAGING_MARKER in leftover.name:
            _remove_path(leftover)


def commit(staging: Path, target: Path) -> None:
    """Make ``staging`` visible as ``target``, replacing whatever was there (see [Note: atomic save])."""
    replaced: Path | None = None
    if staging.is_file() and (target.is_file() or target.is_symlink() or not target.exists()):
        # A file replaces a file (or link) in one atomic rename: there is no moment without a checkpoint.
        os.replace(staging, target)
        fsync_directory(target.parent)
        return
    if target.exists() or target.is_symlink():
        replaced = target.parent / f".{target.name}{REPLACED_MARKER}{uuid.uuid4().hex[:12]}"
        os.replace(target, replaced)
    os.replace(staging, target)
    fsync_directory(target.parent)
    if replaced is not None:
        _remove_path(replaced)


def fsync_directory(directory: Path) -> None:
    """Persist renames inside ``directory`` (a no-op where directories cannot be opened, e.g. Windows)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary sibling of ``path`` for the block to write; when the block ends normally the file is synced to disk
    and renamed onto ``path`` (readers never see half a file), and when it raises the file is removed.

    Writers stream into the temporary file, so no second copy of what they write is held in memory.
    """
    temporary = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        yield temporary
        descriptor = os.open(temporary, os.O_RDWR)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_file_atomically(path: Path, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary file and a rename, so readers never see half a file."""
    with replacing(path) as temporary:
        temporary.write_bytes(payload)


def _remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
