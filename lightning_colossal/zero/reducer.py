"""Gradient reduction for ZeRO-1/2: buckets launched from post-accumulate-grad hooks while backward runs.

This module holds what both stages share: the buckets, the order they launch in, the hooks, the record of which
parameters got a gradient, and a pool of communication buffers. Where gradients live and how a bucket is reduced
is the stage's: ``stages.py`` (``Stage1Reducer``, ``Stage2Reducer``), chosen once by the engine.

[Note: bucket order]
Collectives are matched by call order, so every rank must launch buckets in the same order. A bucket launches
when all its parameters have their gradient *and* every earlier bucket has launched; the rest launch, in order,
from a callback queued at the end of backward. A parameter that got no gradient on some rank (unused branch) just
delays its bucket to that callback instead of hanging or mismatching: its slot holds zeros.

Which parameters received a gradient on this rank since the last optimizer step is recorded in ``received`` (also
inside ``no_sync``); the engine combines the records of all ranks (``engine_parts/sharded_state.py`` [Note:
gradients nobody produced]).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity, RecordedWork
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_parts.rows import ShardSpec
from lightning_colossal.zero.layout import plan_buckets


@dataclass
class ReducedParameter:
    """A parameter taking part in ZeRO and where its gradient lives."""

    name: str
    parameter: torch.nn.Parameter
    spec: ShardSpec
    bucket_index: int = -1
    bucket_offset: int = 0  # stage 1: offset in the bucket's gradient buffer; stage 2: offset in each rank slot
    accumulator_offset: int = 0  # stage 2: offset of this rank's rows in the fp32 accumulator
    bucket_position: int = 0  # index in its bucket's members


@dataclass
class Bucket:
    members: list[ReducedParameter]
    dtype: torch.dtype
    numel: int  # stage 1: full gradients; stage 2: one rank's slot
    gradients: Tensor | None = None  # stage 1 persistent buffer, stage 2 staging buffer (transient)
    pending: int = 0
    work: RecordedWork | None = None
    own_slot: Tensor | None = None  # stage 2, while in flight: where this rank's slot of the sum arrives
    # Stage 2 sending in place (stages.py [Note: ZeRO-2 reduction per backend]): each member's flat gradient of this
    # backward (None: none on this rank), and the other ranks' contributions to this rank's slot.
    held: list[Tensor | None] | None = None
    received: Tensor | None = None


@dataclass(frozen=True)
class ReducerSetup:
    """What every reducer is built with, whatever its stage."""

    process_group: ProcessGroup | None  # the data-parallel ranks
    bucket_numel: int  # a bucket closes once it holds this many elements
    overlap: bool  # launch buckets from the hooks while backward runs (else all at its end)
    device: torch.device  # where gradient buffers live
    on_finished: Callable[[], None]  # called at the end of each reduction (the engine attaches master gradients)


class GradientReducer:
    """Averages gradients over data-parallel ranks, bucket by bucket (see the Notes above); a stage type fills in
    where gradients live and how a bucket is reduced."""

    #: Buckets waiting on the network at once before launching another retires the oldest (``None``: unbounded).
    max_in_flight: int | None = None

    def __init__(self, members: list[ReducedParameter], setup: ReducerSetup) -> None:
        self.on_finished = setup.on_finished
        self.process_group = setup.process_group
        self.world_size = collectives.world_size(setup.process_group)
        self.overlap = setup.overlap
        self.device = setup.device
        bucket_numel = setup.bucket_numel
        # Backward produces gradients roughly in reverse registration order; buckets follow it to fill early.
        ordered = list(reversed(members))
        self.buckets: list[Bucket] = []
        for dtype in dict.fromkeys(member.parameter.dtype for member in ordered):
            same_dtype = [member for member in ordered if member.parameter.dtype == dtype]
            sizes = [self.bucket_numel_of(member) for member in same_dtype]
            for indices in plan_buckets(sizes, bucket_numel):
                self._add_bucket([same_dtype[index] for index in indices], dtype)
        self._pool: dict[tuple[torch.dtype, int], list[Tensor]] = {}
        self._in_flight: deque[Bucket] = deque()
        self.blocked = False  # inside Lightning's block_backward_sync() on a non-final micro-batch
        self._callback_queued = False
        self._next_to_launch = 0
        self._hooks = [member.parameter.register_post_accumulate_grad_hook(self._on_gradient) for member in members]
        self._member_of = {id(member.parameter): member for member in members}
        # One flag per member, in ``members`` order (sharded_state.py [Note: gradients nobody produced]).
        self._position_of = {id(member.parameter): position for position, member in enumerate(members)}
        self.received = sharded_state.GradientArrivals(len(members))

    # ---------------------------------------------------------------------------------------------- stage specifics
    def bucket_numel_of(self, member: ReducedParameter) -> int:
        """Elements ``member`` takes in its bucket."""
        raise NotImplementedError

    def _prepare_bucket(self, bucket: Bucket) -> None:
        """A bucket was just laid out (its members know their offsets)."""

    def owned_gradient(self, member: ReducedParameter) -> Tensor:
        """This rank's reduced gradient rows of ``member`` (valid after ``finish`` ran for this backward)."""
        raise NotImplementedError

    def persistent_gradient_bytes(self) -> int:
        """Bytes of gradient storage kept between steps."""
        raise NotImplementedError

    def _zero_own_gradients(self) -> None:
        raise NotImplementedError

    def _communicates_now(self) -> bool:
        """Whether a gradient produced now is reduced in this backward (or left to accumulate locally)."""
        raise NotImplementedError

    def _take_gradient(self, member: ReducedParameter, bucket: Bucket) -> None:
        """``member``'s gradient for this backward is ready in ``.grad``: put it where the bucket reduces it."""
        raise NotImplementedError

    def _start_reduction(self, bucket: Bucket) -> RecordedWork | None:
        """Launch the bucket's collective; returns its handle (``None`` when nothing was sent)."""
        raise NotImplementedError

    def _complete(self, bucket: Bucket) -> None:
        """The bucket's collective finished: average it into the reduced gradients."""
        raise NotImplementedError

    def _after_backward(self) -> None:
        """Every bucket of this backward completed."""

    def flush(self) -> None:
        """Reduce now what backward passes run under ``blocked`` accumulated, then finish as backward would."""
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------------- layout
    def _add_bucket(self, members: list[ReducedParameter], dtype: torch.dtype) -> None:
        index = len(self.buckets)
        offset = 0
        for position, member in enumerate(members):
            member.bucket_index = index
            member.bucket_position = position
            member.bucket_offset = offset
            offset += self.bucket_numel_of(member)
        bucket = Bucket(members=members, dtype=dtype, numel=offset)
        self._prepare_bucket(bucket)
        bucket.pending = len(members)
        self.buckets.append(bucket)

    # ---------------------------------------------------------------------------------------------- buffers
    def acquire(self, dtype: torch.dtype, numel: int) -> Tensor:
        """A buffer from the pool (uninitialised); give it back with ``release``."""
        free = self._pool.setdefault((dtype, numel), [])
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=self.device)

    def release(self, buffer: Tensor) -> None:
        self._pool[(buffer.dtype, buffer.numel())].append(buffer)

    def pooled_bytes(self) -> int:
        """Bytes of the reusable communication buffers (a few buckets, see stages.py [Note: bounded staging])."""
        return sum(buffer.numel() * buffer.element_size() for free in self._pool.values() for buffer in free)

    def zero_gradients(self) -> None:
        """Start a new optimizer step: clear the reduced gradients (and stage 1's full gradients)."""
        self.received.clear()
        self._zero_own_gradients()

    # ---------------------------------------------------------------------------------------------- backward
    def _on_gradient(self, parameter: Tensor) -> None:
        self.received.mark(self._position_of[id(parameter)])
        if not self._communicates_now():
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True
        member = self._member_of[id(parameter)]
        bucket = self.buckets[member.bucket_index]
        self._take_gradient(member, bucket)
        bucket.pending -= 1
        if self.overlap:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self, force: bool = False) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.pending > 0 and not force:
                return
            self._launch(bucket, self._next_to_launch)
            self._next_to_launch += 1

    def _launch(self, bucket: Bucket, index: int) -> None:
        # The handle keeps this label: the bucket is waited for later, maybe at the end of backward.
        with Activity("reducing gradient bucket {} of {}", index + 1, len(self.buckets)):
            bucket.work = self._start_reduction(bucket)
        self._in_flight.append(bucket)
        if self.max_in_flight is not None:
            while len(self._in_flight) > self.max_in_flight:
                self._retire(self._in_flight.popleft())

    def _retire(self, bucket: Bucket) -> None:
        if bucket.work is not None:
            bucket.work.wait()
            bucket.work = None
        self._complete(bucket)

    def finish(self) -> None:
        """End of backward: launch what is left (in order), wait, and average into the reduced gradients."""
        self._launch_ready_buckets(force=True)
        while self._in_flight:
            self._retire(self._in_flight.popleft())
        for bucket in self.buckets:
            bucket.pending = len(bucket.members)
        self._after_backward()
        self._next_to_launch = 0
        self._callback_queued = False
        self.on_finished()

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
