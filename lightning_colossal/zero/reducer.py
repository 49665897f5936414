"""Gradient reduction for ZeRO-1/2: buckets launched from post-accumulate-grad hooks while backward runs.

[Note: bucket order]
Collectives are matched by call order, so every rank must launch buckets in the same order. A bucket launches
when all its parameters have their gradient *and* every earlier bucket has launched; the rest launch, in order,
from a callback queued at the end of backward. A parameter that got no gradient on some rank (unused branch) just
delays its bucket to that callback instead of hanging or mismatching: its slot holds zeros.

[Note: gradients nobody produced]
A zero slot is the right contribution of a rank that did not use a parameter, but a parameter no rank used has no
gradient at all in single-process torch (``grad is None``), and optimizers skip it: no weight decay, no momentum,
no Adam step count. The reducer therefore records which parameters received a gradient on this rank since the last
optimizer step (``received``, also inside ``no_sync``); the engine combines the records of all ranks (one small
all-reduce per reduction) and gives such parameters' masters no gradient.

[Note: collective per backend]
Stage 2 needs each rank to end with the sum of its own rows. NCCL's reduce-scatter does exactly that for half
the traffic of an all-reduce. gloo's reduce-scatter and all-gather cost ~3x an all-reduce of the same bytes on
CPU (measured in benchmarks/RESULTS.md, ZeRO section), so on gloo the bucket is all-reduced and each rank keeps its slot: same result, less time.

Stage 1 keeps full-size gradients (parameters' ``.grad`` are views into one buffer per bucket) and all-reduces
them, communicating only on the last micro-batch of an accumulation. Stage 2 copies each gradient into a
rank-major staging buffer as soon as autograd produced it, frees it, and adds the reduced slot into a persistent
fp32 accumulator of this rank's rows only.

[Note: bounded staging]
Stage 2's staging buffers come from a small pool and go back to it once their bucket is reduced; at most
``MAX_STAGE2_BUCKETS_IN_FLIGHT`` buckets wait on the network at once (launching another retires the oldest).
So stage 2 holds a few buckets of staging memory, independent of the model size, and allocates nothing per step:
on CPU a fresh zeroed buffer of the model's size costs page faults every step, measurably more than the
communication it feeds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, Work

from lightning_colossal.distributed import collectives
from lightning_colossal.zero.layout import ShardSpec, plan_buckets

MAX_STAGE2_BUCKETS_IN_FLIGHT = 2


@dataclass
class ReducedParameter:
    """A parameter taking part in ZeRO and where its gradient lives."""

    name: str
    parameter: torch.nn.Parameter
    spec: ShardSpec
    bucket_index: int = -1
    bucket_offset: int = 0  # stage 1: offset in the bucket's gradient buffer; stage 2: offset in each rank slot
    accumulator_offset: int = 0  # stage 2: offset of this rank's rows in the fp32 accumulator


@dataclass
class Bucket:
    members: list[ReducedParameter]
    dtype: torch.dtype
    numel: int  # stage 1: full gradients; stage 2: one rank's slot
    gradients: torch.Tensor | None = None  # stage 1 persistent buffer, stage 2 staging buffer (transient)
    pending: int = 0
    work: Work | None = None
    received: torch.Tensor | None = None  # stage 2 with reduce-scatter: this rank's reduced slot


class GradientReducer:
    """Averages gradients over data-parallel ranks, bucket by bucket (see the Notes above)."""

    def __init__(
        self,
        members: list[ReducedParameter],
        stage: int,
        process_group: ProcessGroup | None,
        bucket_numel: int,
        overlap: bool,
        accumulate_locally: bool,
        use_reduce_scatter: bool,
        device: torch.device,
        on_finished: Callable[[], None],
    ) -> None:
        self.stage = stage
        self.on_finished = on_finished
        self.process_group = process_group
        self.world_size = collectives.world_size(process_group)
        self.rank = collectives.rank(process_group)
        self.overlap = overlap
        self.accumulate_locally = accumulate_locally
        self.use_reduce_scatter = use_reduce_scatter
        self.device = device
        # Backward produces gradients roughly in reverse registration order; buckets follow it to fill early.
        ordered = list(reversed(members))
        self.buckets: list[Bucket] = []
        for dtype in dict.fromkeys(member.parameter.dtype for member in ordered):
            same_dtype = [member for member in ordered if member.parameter.dtype == dtype]
            sizes = [self._bucket_numel_of(member) for member in same_dtype]
            for indices in plan_buckets(sizes, bucket_numel):
                self._add_bucket([same_dtype[index] for index in indices], dtype)
        self.accumulator = self._allocate_accumulator(members) if stage == 2 else None
        self._pool: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self._in_flight: deque[Bucket] = deque()
        self.blocked = False  # inside Lightning's block_backward_sync() on a non-final micro-batch
        self._callback_queued = False
        self._next_to_launch = 0
        self._hooks = [member.parameter.register_post_accumulate_grad_hook(self._on_gradient) for member in members]
        self._member_of = {id(member.parameter): member for member in members}
        # See [Note: gradients nobody produced]; one flag per member, in ``members`` order.
        self._position_of = {id(member.parameter): position for position, member in enumerate(members)}
        self.received = torch.zeros(len(members), dtype=torch.float32, device=device)

    # ---------------------------------------------------------------------------------------------- layout
    def _bucket_numel_of(self, member: ReducedParameter) -> int:
        return member.parameter.numel() if self.stage == 1 else member.spec.slot_numel

    def _add_bucket(self, members: list[ReducedParameter], dtype: torch.dtype) -> None:
        index = len(self.buckets)
        offset = 0
        for member in members:
            member.bucket_index = index
            member.bucket_offset = offset
            offset += self._bucket_numel_of(member)
        bucket = Bucket(members=members, dtype=dtype, numel=offset)
        if self.stage == 1:
            # Persistent: parameters' .grad are views into it, so autograd accumulates straight into the buffer.
            bucket.gradients = torch.zeros(offset, dtype=dtype, device=self.device)
            for member in members:
                parameter = member.parameter
                view = bucket.gradients[member.bucket_offset : member.bucket_offset + parameter.numel()]
                parameter.grad = view.view_as(parameter)
        bucket.pending = len(members)
        self.buckets.append(bucket)

    def _allocate_accumulator(self, members: list[ReducedParameter]) -> torch.Tensor:
        offset = 0
        for member in members:
            member.accumulator_offset = offset
            offset += member.spec.local_numel
        return torch.zeros(offset, dtype=torch.float32, device=self.device)

    # ---------------------------------------------------------------------------------------------- views
    def owned_gradient(self, member: ReducedParameter) -> torch.Tensor:
        """This rank's reduced gradient rows of ``member`` (valid after ``finish`` ran for this backward)."""
        spec = member.spec
        if self.stage == 1:
            gradient = self._bucket_view(member)
            if spec.replicated:
                return gradient
            return gradient[spec.row_start : spec.row_end]
        assert self.accumulator is not None
        flat = self.accumulator[member.accumulator_offset : member.accumulator_offset + spec.local_numel]
        return flat.view(spec.local_shape)

    def acquire(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A buffer from the pool (uninitialised); give it back with ``release``."""
        free = self._pool.setdefault((dtype, numel), [])
        return free.pop() if free else torch.empty(numel, dtype=dtype, device=self.device)

    def release(self, buffer: torch.Tensor) -> None:
        self._pool[(buffer.dtype, buffer.numel())].append(buffer)

    def pooled_bytes(self) -> int:
        """Bytes of the reusable communication buffers (a few buckets, see [Note: bounded staging])."""
        return sum(buffer.numel() * buffer.element_size() for free in self._pool.values() for buffer in free)

    def persistent_gradient_bytes(self) -> int:
        if self.stage == 1:
            return sum(
                bucket.gradients.numel() * bucket.gradients.element_size()
                for bucket in self.buckets
                if bucket.gradients is not None
            )
        assert self.accumulator is not None
        return self.accumulator.numel() * self.accumulator.element_size()

    def zero_gradients(self) -> None:
        """Start a new optimizer step: clear the reduced gradients (and stage 1's full gradients)."""
        self.received.zero_()
        if self.stage == 1:
            for bucket in self.buckets:
                assert bucket.gradients is not None
                bucket.gradients.zero_()
        else:
            assert self.accumulator is not None
            self.accumulator.zero_()
            for member in self._member_of.values():
                member.parameter.grad = None

    # ---------------------------------------------------------------------------------------------- backward
    def _communicates_now(self) -> bool:
        # Stage 1 and stage 2 with local accumulation skip non-final micro-batches; stage 2 "sharded" reduces them.
        return not self.blocked or (self.stage == 2 and not self.accumulate_locally)

    def _on_gradient(self, parameter: torch.Tensor) -> None:
        self.received[self._position_of[id(parameter)]] = 1.0
        if not self._communicates_now():
            return
        if not self._callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
            self._callback_queued = True
        member = self._member_of[id(parameter)]
        bucket = self.buckets[member.bucket_index]
        if self.stage == 2:
            self._stage_gradient(member, bucket)
        else:
            self._keep_in_bucket(member, bucket)
        bucket.pending -= 1
        if self.overlap:
            self._launch_ready_buckets()

    def _bucket_view(self, member: ReducedParameter) -> torch.Tensor:
        """Stage 1: the slice of the bucket buffer holding ``member``'s full gradient."""
        bucket = self.buckets[member.bucket_index]
        assert bucket.gradients is not None
        parameter = member.parameter
        return bucket.gradients[member.bucket_offset : member.bucket_offset + parameter.numel()].view_as(parameter)

    def _keep_in_bucket(self, member: ReducedParameter, bucket: Bucket) -> None:
        """Stage 1: if something replaced ``.grad`` (e.g. ``zero_grad(set_to_none=True)`` on the module), put it back."""
        parameter = member.parameter
        assert parameter.grad is not None
        view = self._bucket_view(member)
        if parameter.grad.data_ptr() != view.data_ptr():
            view.copy_(parameter.grad)
            parameter.grad = view

    def _stage_gradient(self, member: ReducedParameter, bucket: Bucket) -> None:
        """Copy a fresh gradient into every rank's slot of the staging buffer, then free it."""
        parameter = member.parameter
        gradient = parameter.grad
        assert gradient is not None
        if bucket.gradients is None:
            bucket.gradients = self.acquire(bucket.dtype, self.world_size * bucket.numel).zero_()
        spec = member.spec
        slots = bucket.gradients.view(self.world_size, bucket.numel)
        if spec.replicated:
            # Every rank owns a zero-dimensional parameter: each slot receives the value.
            slots[:, member.bucket_offset].copy_(gradient.reshape(()).expand(self.world_size))
        else:
            rows = gradient.view(spec.num_rows, spec.row_numel)
            for rank in range(self.world_size):
                start, end = spec.rows_of(rank)
                if end > start:
                    destination = slots[
                        rank, member.bucket_offset : member.bucket_offset + (end - start) * spec.row_numel
                    ]
                    destination.copy_(rows[start:end].reshape(-1))
        parameter.grad = None

    def _launch_ready_buckets(self, force: bool = False) -> None:
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if bucket.pending > 0 and not force:
                return
            self._launch(bucket)
            self._next_to_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        if bucket.gradients is None:  # stage 2, no member got a gradient on this rank
            bucket.gradients = self.acquire(bucket.dtype, self.world_size * bucket.numel).zero_()
        if self.stage == 2 and self.use_reduce_scatter:
            bucket.received = self.acquire(bucket.dtype, bucket.numel)
            bucket.work = collectives.reduce_scatter_async(bucket.received, bucket.gradients, self.process_group)
        else:
            bucket.work = collectives.all_reduce_async(bucket.gradients, self.process_group)
        self._in_flight.append(bucket)
        if self.stage == 2:
            while len(self._in_flight) > MAX_STAGE2_BUCKETS_IN_FLIGHT:
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
            if self.stage == 1:
                for member in bucket.members:
                    # Parameters without a gradient this step never passed the hook; point them at their slot too.
                    member.parameter.grad = self._bucket_view(member)
        self._next_to_launch = 0
        self._callback_queued = False
        self.on_finished()

    def flush(self) -> None:
        """Reduce now what backward passes run under ``blocked`` accumulated (stage 1), then finish as backward would."""
        assert self.stage == 1, "stage 2 reduces during backward; it never holds unreduced full gradients"
        for bucket in self.buckets:
            for member in bucket.members:
                if member.parameter.grad is not None:
                    self._keep_in_bucket(member, bucket)
        self.finish()

    def _complete(self, bucket: Bucket) -> None:
        assert bucket.gradients is not None
        if self.stage == 1:
            bucket.gradients.div_(self.world_size)
            return
        assert self.accumulator is not None
        if bucket.received is not None:
            own_slot = bucket.received
        else:
            own_slot = bucket.gradients.view(self.world_size, bucket.numel)[self.rank]
        for member in bucket.members:
            numel = member.spec.local_numel
            if numel == 0:
                continue
            target = self.accumulator[member.accumulator_offset : member.accumulator_offset + numel]
            target.add_(own_slot[member.bucket_offset : member.bucket_offset + numel], alpha=1.0 / self.world_size)
        # Staging goes back to the pool: stage 2 keeps only this rank's rows between backward passes.
        self.release(bucket.gradients)
        if bucket.received is not None:
            self.release(bucket.received)
        bucket.gradients = None
        bucket.received = None

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
