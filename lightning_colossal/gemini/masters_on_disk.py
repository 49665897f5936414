"""Gemini's fp32 masters in the disk tier's records (``GeminiConfig(masters_on_disk=True)``). No Lightning here.

[Note: Gemini's masters on disk]
A chunk whose optimizer state is on disk may keep its fp32 master there too (``disk/optimizer_state.py`` [Note:
masters on disk]), when the master is a copy separate from the working shard: bf16/fp16 parameters, or a shard on an
accelerator. An fp32 shard in host memory is its own master (``chunk.py`` ``masters_alias_shard``): it is the
working weights, so it stays. Such a chunk's ``master`` and master views are placeholders between steps; the views
keep their identity (the optimizer holds them) and are bound to the tier's staging buffer while their record steps.

Every path that moved values between master and shard goes through the tier instead, one record in host memory at a
time:
- set-up: a master's first values are its shard's (``shards_to_masters`` would copy the same), written straight into
  the record, so the masters never exist in host memory at once (static placement allocates none; automatic
  placement, which decides after the chunks exist, frees them once written);
- after a record steps: its masters into their shards (``after_record``), the step's ``masters_to_shards`` for them;
- after a checkpoint load: the records' masters into the shards (``into_shards``), after the load filled them through
  stand-ins or ``load_rows``;
- checkpoint saves read them through the tier's stand-ins (``value_of``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from lightning_colossal.disk.optimizer_state import DiskOptimizerState, placeholder
from lightning_colossal.distributed import device as devices
from lightning_colossal.gemini.chunk import Chunk
from lightning_colossal.gemini.layout import ChunkMember


def can_go_to_disk(chunk: Chunk) -> bool:
    """Whether ``chunk`` has a master separate from its shard, which the disk tier can hold ([Note: Gemini's masters
    on disk])."""
    return chunk.masters_on_disk or (not chunk.frozen and not chunk.masters_alias_shard)


def leave_for_disk(chunk: Chunk) -> None:
    """Free ``chunk``'s master storage (its values must be, or be about to be, written to the tier from its shard)."""
    chunk.master = placeholder(chunk.master, torch.float32)
    for view in chunk.master_views:
        view.data = placeholder(view, torch.float32)
    chunk.masters_on_disk = True


class DiskMasters:
    """The masters on disk of one engine's chunks, by their views: what the tier calls back and what the engine's
    checkpoint paths call."""

    def __init__(self, chunks: Sequence[Chunk]) -> None:
        self._place_of: dict[int, tuple[Chunk, ChunkMember]] = {
            id(view): (chunk, member)
            for chunk in chunks
            if chunk.masters_on_disk
            for member, view in zip(chunk.spec.members, chunk.master_views, strict=True)
        }
        self.disk_state: DiskOptimizerState | None = None

    def holds(self, view: Tensor) -> bool:
        return id(view) in self._place_of

    def initial_values(self, view: Tensor, target: Tensor) -> None:
        """A master's first values, from its shard (fp32 of the working weights, as ``shards_to_masters`` makes)."""
        chunk, member = self._place_of[id(view)]
        devices.copy_into(target, chunk.member_shard(chunk.shard, member))

    def after_record(self, views: Sequence[Tensor]) -> None:
        """After a record stepped: its masters (views of the staging buffer) into their shards."""
        self._into_shards([(view, view) for view in views])

    def into_shards(self) -> None:
        """After a checkpoint load: every master on disk into its shard, a record at a time; then the stand-ins the
        load filled are withdrawn."""
        assert self.disk_state is not None
        self.disk_state.read_masters(lambda view, value: self._into_shards([(view, value)]))
        self.disk_state.withdraw_master_stand_ins()

    def load_rows(self, rows_of: Callable[[ChunkMember], Tensor | None]) -> None:
        """Overwrite each master on disk with ``rows_of(member)`` (this rank's rows of a loaded whole tensor), where it
        gives some; one record in host memory at a time."""

        def fill(view: Tensor, target: Tensor) -> None:
            rows = rows_of(self._place_of[id(view)][1])
            if rows is not None:
                target.copy_(rows.reshape(target.shape))

        assert self.disk_state is not None
        self.disk_state.write_masters(fill)

    def value_of(self, view: Tensor) -> Tensor:
        """What a checkpoint describes for ``view``: a stand-in for its values on disk, or the view itself."""
        if self.disk_state is None or not self.holds(view):
            return view
        return self.disk_state.master_stand_in(view)

    def _into_shards(self, pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
        copies = []
        for view, value in pairs:
            chunk, member = self._place_of[id(view)]
            copies.append((chunk.member_shard(chunk.shard, member), value))
        devices.copy_all(copies)
        if any(devices.is_accelerator(target.device) for target, _ in copies):
            # The values are views of a host buffer the tier reuses as soon as this returns.
            devices.synchronize(copies[0][0].device)
