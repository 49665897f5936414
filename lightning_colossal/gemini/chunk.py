"""A chunk's storage on one rank and the states it moves through (no collectives here; see ``manager``).

[Note: chunk states]
    SHARDED             only this rank's shard exists; the parameters are empty placeholders
    GATHERING           an asynchronous gather (prefetch) is in flight into the full buffer
    GATHERED            the full buffer holds every rank's rows; the parameters are views of it
    COMPUTING           a module whose parameters live here is running its forward
    AWAITING_GRADIENTS  a backward pass uses the chunk; it stays gathered until its gradients are reduced

    SHARDED -> GATHERING | GATHERED            gather (asynchronous | blocking)
    GATHERING -> GATHERED                      the gather completed
    GATHERED -> COMPUTING | AWAITING_GRADIENTS | SHARDED
    COMPUTING -> GATHERED                      the forward of the last module using it returned
    AWAITING_GRADIENTS -> GATHERED | SHARDED   gradients reduced (kept gathered | released)

Anything else is a bug in the runtime and raises, naming both states, instead of computing with stale or missing
parameters.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_colossal.gemini.layout import ChunkMember, ChunkSpec


class ChunkState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"
    COMPUTING = "computing"
    AWAITING_GRADIENTS = "awaiting gradients"


LEGAL_TRANSITIONS: dict[ChunkState, frozenset[ChunkState]] = {
    ChunkState.SHARDED: frozenset({ChunkState.GATHERING, ChunkState.GATHERED}),
    ChunkState.GATHERING: frozenset({ChunkState.GATHERED}),
    ChunkState.GATHERED: frozenset({ChunkState.COMPUTING, ChunkState.AWAITING_GRADIENTS, ChunkState.SHARDED}),
    ChunkState.COMPUTING: frozenset({ChunkState.GATHERED}),
    ChunkState.AWAITING_GRADIENTS: frozenset({ChunkState.GATHERED, ChunkState.SHARDED}),
}


class Location(enum.Enum):
    """Where a piece of chunk storage lives: the compute device or the offload device (CPU memory)."""

    COMPUTE = "compute"
    OFFLOAD = "offload"


def check_transition(chunk_index: int, current: ChunkState, target: ChunkState) -> None:
    """Raise ``RuntimeError`` naming both states when ``current -> target`` is not a legal move."""
    if target not in LEGAL_TRANSITIONS[current]:
        allowed = ", ".join(sorted(state.value for state in LEGAL_TRANSITIONS[current]))
        raise RuntimeError(
            f"chunk {chunk_index}: illegal state transition {current.value!r} -> {target.value!r} (from"
            f" {current.value!r} only {allowed} may follow). This is a bug in the Gemini runtime; please report it"
            " with the model that triggered it."
        )


@dataclass
class Chunk:
    """Storage of one chunk on this rank.

    ``shard`` (working dtype) holds this rank's rows of every member, back to back; it lives at
    ``shard_location`` between uses. ``master`` (fp32) is the optimizer's copy of the same rows at
    ``master_location``; it *is* ``shard`` when both agree in dtype and device. ``gradient`` is the fp32 reduced
    gradient of the rows, next to the master. ``full`` exists only while gathered, on the compute device. A frozen
    chunk's master is its shard and it never has a gradient (layout.py [Note: frozen chunks]).
    """

    spec: ChunkSpec
    shard: Tensor
    master: Tensor
    shard_location: Location
    master_location: Location
    parameters: list[torch.nn.Parameter]
    state: ChunkState = ChunkState.SHARDED
    full: Tensor | None = None
    #: The gathered buffer of this chunk's last release in a forward, while autograd holds views of it (manager.py
    #: [Note: weights autograd saved]).
    released_full: Tensor | None = None
    gradient: Tensor | None = None
    full_gradient: Tensor | None = None
    pending_gather: Any = None
    users: int = 0
    gradients_expected: int = 0
    gradients_arrived: int = 0
    reduced_this_backward: bool = False
    keep_gathered: bool = False
    #: Its master's values live in the disk tier's records between steps (masters_on_disk.py); ``master`` and the
    #: master views are placeholders there.
    masters_on_disk: bool = False
    master_views: list[Tensor] = field(default_factory=list)

    @property
    def index(self) -> int:
        return self.spec.index

    @property
    def frozen(self) -> bool:
        """A chunk of frozen parameters: a shard only (layout.py [Note: frozen chunks])."""
        return self.spec.frozen

    @property
    def masters_alias_shard(self) -> bool:
        if self.masters_on_disk:
            return False
        if self.master is self.shard:
            return True
        # Pointers are only comparable on one device (fake tensors, which have none, all answer 0).
        return (
            self.master.device == self.shard.device
            and self.master.data_ptr() == self.shard.data_ptr()
            and self.master.numel() == self.shard.numel()
        )

    def move(self, target: ChunkState) -> None:
        check_transition(self.index, self.state, target)
        self.state = target

    @property
    def is_gathered(self) -> bool:
        return self.state in (ChunkState.GATHERED, ChunkState.COMPUTING, ChunkState.AWAITING_GRADIENTS)

    def member_shard(self, tensor: Tensor, member: ChunkMember) -> Tensor:
        """``member``'s rows inside a shard-shaped flat ``tensor``, in the parameter's row shape."""
        numel = member.spec.local_numel
        return tensor[member.shard_offset : member.shard_offset + numel].view(member.spec.local_shape)

    def member_full(self, tensor: Tensor, member: ChunkMember) -> Tensor:
        """``member`` as a whole parameter inside a gathered-shaped flat ``tensor``."""
        return tensor[member.offset : member.offset + member.numel].view(member.spec.shape)

    def member_owned_in_full(self, tensor: Tensor, member: ChunkMember) -> Tensor:
        """This rank's rows of ``member`` inside a gathered-shaped flat ``tensor`` (flat)."""
        spec = member.spec
        start = member.offset + (0 if spec.replicated else spec.row_start * spec.row_numel)
        return tensor[start : start + spec.local_numel]
