"""Saving and loading sharded checkpoint directories with ``torch.distributed.checkpoint`` (DCP).

Each rank hands DCP the tensors it holds: full tensors (replicated, DDP), ``DTensor`` shards (FSDP2, tensor
parallelism) or flat-buffer shards described as DTensors by an engine. DCP's planner spreads replicated items
over the ranks, so every rank writes a piece and nothing is gathered on one rank. On load, DCP reads the pieces
each destination tensor needs, whatever layout wrote them: that is what makes resuming at another world size or
in another strategy work.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.cloud_io import _load as lightning_load
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader, FileSystemWriter

from lightning_colossal.checkpoint import atomic
from lightning_colossal.checkpoint.layout import META_FILENAME
from lightning_colossal.distributed import collectives


def save_sharded(
    path: str | Path, tensor_state: dict[str, Any], metadata: dict[str, Any], group: ProcessGroup | None = None
) -> None:
    """Write a sharded checkpoint at ``path`` atomically; every rank of ``group`` must call this.

    Args:
        path: the checkpoint directory to create or replace.
        tensor_state: nested dict of this rank's tensors (and small picklable objects), see ``layout``.
        metadata: Lightning's non-tensor entries; only rank 0's copy is written.
        group: the ranks that share the checkpoint (the default group when ``None``).
    """
    target = Path(path).absolute()
    is_writer_of_metadata = collectives.rank(group) == 0
    staging: Path | None = atomic.staging_path(target) if is_writer_of_metadata else None
    staging = Path(collectives.broadcast_object(str(staging), source_rank=0, group=group))
    if is_writer_of_metadata:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic.remove_leftovers(target)
        staging.mkdir()
    collectives.barrier(group)
    try:
        dcp.save(tensor_state, storage_writer=FileSystemWriter(staging), process_group=group)
        if is_writer_of_metadata:
            buffer = io.BytesIO()
            torch.save(metadata, buffer)
            atomic.write_file_atomically(staging / META_FILENAME, buffer.getvalue())
            atomic.commit(staging, target)
    except BaseException as error:
        # DCP raises on every rank when any rank fails to write; leave no staging directory behind.
        if is_writer_of_metadata:
            atomic.remove_leftovers(target)
        if isinstance(error, CheckpointException):
            # CheckpointException derives from BaseException and would slip past `except Exception` handlers.
            raise RuntimeError(
                f"Saving the checkpoint {target} failed on ranks {sorted(error.failures)}; whatever was at that path"
                f" before is intact. First failure: {next(iter(error.failures.values()))!r}"
            ) from error
        raise
    collectives.barrier(group)


def saved_keys(path: str | Path) -> set[str]:
    """The flattened keys (``model.<name>``, ``optimizer_0.state.<name>.exp_avg``, ...) stored in a checkpoint."""
    return set(FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def load_sharded(
    path: str | Path, tensor_state: dict[str, Any], allow_partial: bool, group: ProcessGroup | None = None
) -> None:
    """Fill ``tensor_state`` in place from the checkpoint at ``path``; every rank of ``group`` must call this.

    Tensors are copied into the given destination tensors (whatever their sharding); non-tensor values are replaced
    in the dict. With ``allow_partial`` a destination key missing from the checkpoint keeps its current value;
    otherwise DCP raises naming the key.
    """
    dcp.load(
        tensor_state,
        storage_reader=FileSystemReader(str(path)),
        planner=DefaultLoadPlanner(allow_partial_load=allow_partial),
        process_group=group,
    )


def load_metadata(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """Read the Lightning entries (loops, callbacks, schedulers, precision, hyper-parameters) of a checkpoint."""
    # meta.pt holds Lightning's loop and callback state, which needs full unpickling; honour an explicit choice.
    return lightning_load(
        Path(path) / META_FILENAME, map_location="cpu", weights_only=False if weights_only is None else weights_only
    )
