"""The two ZeRO stages as reducer types: where gradients live between backward and step, and how a bucket is reduced.

Stage 1 keeps full-size gradients (parameters' ``.grad`` are views into one buffer per bucket) and all-reduces
them, communicating only on the last micro-batch of an accumulation. Stage 2 copies each gradient into a
rank-major staging buffer as soon as autograd produced it, frees it, and adds the reduced slot into a persistent
fp32 accumulator of this rank's rows only.

[Note: ZeRO-2 reduction per backend]
Stage 2 needs each rank to end with the sum of its own rows: a reduce-scatter of the rank-major staging buffer (the
default; point-to-point on gloo), or, with ``communication="all_reduce"``, an all-reduce of the same buffer after
which each rank keeps its slot (``collectives.reduce_own_slot_async``, [Note: exchanges per backend]). Both give the
same sums. On gloo's point-to-point route nothing is staged: each gradient is held as autograd produced it until its
bucket is reduced, every other rank's rows go to that rank straight from it, and the contributions to this rank's
rows are added up in rank order, as the staged reduce-scatter adds them (same bits; ``direct_exchange.py``).

[Note: bounded staging]
Stage 2's staging buffers come from a small pool and go back to it once their bucket is reduced; at most
``MAX_STAGE2_BUCKETS_IN_FLIGHT`` buckets wait on the network at once (launching another retires the oldest).
So stage 2 holds a few buckets of staging memory, independent of the model size, and allocates nothing per step:
on CPU a fresh zeroed buffer of the model's size costs page faults every step, measurably more than the
communication it feeds.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import RecordedWork
from lightning_colossal.engine_parts.staging import rows_into_slots
from lightning_colossal.zero.reducer import Bucket, GradientReducer, ReducedParameter, ReducerSetup

MAX_STAGE2_BUCKETS_IN_FLIGHT = 2


class Stage1Reducer(GradientReducer):
    """ZeRO-1: full gradients in persistent buckets, all-reduced and averaged; each rank reads its own rows."""

    def bucket_numel_of(self, member: ReducedParameter) -> int:
        return member.parameter.numel()

    def _prepare_bucket(self, bucket: Bucket) -> None:
        # Persistent: parameters' .grad are views into it, so autograd accumulates straight into the buffer.
        bucket.gradients = torch.zeros(bucket.numel, dtype=bucket.dtype, device=self.device)
        for member in bucket.members:
            member.parameter.grad = _full_gradient_in(bucket, member)

    def _bucket_view(self, member: ReducedParameter) -> Tensor:
        return _full_gradient_in(self.buckets[member.bucket_index], member)

    def owned_gradient(self, member: ReducedParameter) -> Tensor:
        gradient = self._bucket_view(member)
        if member.spec.replicated:
            return gradient
        return gradient[member.spec.row_start : member.spec.row_end]

    def persistent_gradient_bytes(self) -> int:
        return sum(
            bucket.gradients.numel() * bucket.gradients.element_size()
            for bucket in self.buckets
            if bucket.gradients is not None
        )

    def _zero_own_gradients(self) -> None:
        for bucket in self.buckets:
            assert bucket.gradients is not None
            bucket.gradients.zero_()

    def _communicates_now(self) -> bool:
        # Non-final micro-batches accumulate into the full-size buckets; only the last one communicates.
        return not self.blocked

    def _take_gradient(self, member: ReducedParameter, bucket: Bucket) -> None:
        """If something replaced ``.grad`` (e.g. ``zero_grad(set_to_none=True)`` on the module), put it back."""
        parameter = member.parameter
        assert parameter.grad is not None
        view = self._bucket_view(member)
        if parameter.grad.data_ptr() != view.data_ptr():
            view.copy_(parameter.grad)
            parameter.grad = view

    def _start_reduction(self, bucket: Bucket) -> RecordedWork | None:
        assert bucket.gradients is not None
        return collectives.all_reduce_async(bucket.gradients, self.process_group)

    def _complete(self, bucket: Bucket) -> None:
        assert bucket.gradients is not None
        bucket.gradients.div_(self.world_size)

    def _after_backward(self) -> None:
        for bucket in self.buckets:
            for member in bucket.members:
                # Parameters without a gradient this step never passed the hook; point them at their slot too.
                member.parameter.grad = self._bucket_view(member)

    def flush(self) -> None:
        for bucket in self.buckets:
            for member in bucket.members:
                if member.parameter.grad is not None:
                    self._take_gradient(member, bucket)
        self.finish()


class Stage2Reducer(GradientReducer):
    """ZeRO-2: each gradient staged into rank-major slots and freed; the reduced own slot is averaged into an fp32
    accumulator of this rank's rows (see the Notes above).

    Args:
        members: the parameters taking part.
        setup: what every reducer is built with.
        accumulate_locally: on non-final micro-batches keep full gradients in ``.grad`` and reduce once per step
            (``stage2_accumulation="local"``) instead of reducing every micro-batch into the accumulator.
        use_reduce_scatter: reduce-scatter the staging buffers instead of all-reducing them ([Note: ZeRO-2 reduction
            per backend]).
    """

    max_in_flight = MAX_STAGE2_BUCKETS_IN_FLIGHT

    def __init__(
        self, members: list[ReducedParameter], setup: ReducerSetup, accumulate_locally: bool, use_reduce_scatter: bool
    ) -> None:
        super().__init__(members, setup)
        self.accumulate_locally = accumulate_locally
        self.use_reduce_scatter = use_reduce_scatter
        offset = 0
        for member in members:
            member.accumulator_offset = offset
            offset += member.spec.local_numel
        self.accumulator = torch.zeros(offset, dtype=torch.float32, device=self.device)
        #: Send rows straight from the held gradients instead of staging them ([Note: ZeRO-2 reduction per backend]).
        self.sends_in_place = use_reduce_scatter and collectives.sends_directly(self.process_group)
        #: One rank: each gradient is its own average, added straight into the accumulator ([Note: ZeRO-2 on one
        #: rank]).
        self.adds_directly = self.world_size == 1
        self._zeros: dict[torch.dtype, Tensor] = {}  # what a member without a gradient on this rank sends

    def bucket_numel_of(self, member: ReducedParameter) -> int:
        return member.spec.slot_numel

    def owned_gradient(self, member: ReducedParameter) -> Tensor:
        spec = member.spec
        flat = self.accumulator[member.accumulator_offset : member.accumulator_offset + spec.local_numel]
        return flat.view(spec.local_shape)

    def persistent_gradient_bytes(self) -> int:
        return self.accumulator.numel() * self.accumulator.element_size()

    def _zero_own_gradients(self) -> None:
        self.accumulator.zero_()
        for member in self._member_of.values():
            member.parameter.grad = None

    def _communicates_now(self) -> bool:
        # "sharded" accumulation reduces every micro-batch; "local" keeps full gradients until the last one.
        return not self.blocked or not self.accumulate_locally

    def _staging(self, bucket: Bucket) -> Tensor:
        """The bucket's zeroed rank-major staging buffer, taken from the pool on first use in this backward."""
        if bucket.gradients is None:
            bucket.gradients = self.acquire(bucket.dtype, self.world_size * bucket.numel).zero_()
        return bucket.gradients

    def _take_gradient(self, member: ReducedParameter, bucket: Bucket) -> None:
        """Copy a fresh gradient into every rank's slot of the staging buffer (or, sending in place, hold it until
        the bucket is reduced), then free ``.grad``."""
        parameter = member.parameter
        gradient = parameter.grad
        assert gradient is not None
        if self.adds_directly:
            # [Note: ZeRO-2 on one rank]
            # With one rank there is nothing to exchange: staging a gradient, "reducing" it and adding the slot into
            # the accumulator was a memset per bucket, a copy and an add per parameter, three kernels where torch's
            # DDP launches at most one. The add alone gives the same bits (the staged route adds the same values of
            # the same dtype with alpha 1).
            numel = member.spec.local_numel
            target = self.accumulator[member.accumulator_offset : member.accumulator_offset + numel]
            target.add_(gradient.reshape(-1))
            parameter.grad = None
            return
        if self.sends_in_place:
            if bucket.held is None:
                bucket.held = [None] * len(bucket.members)
            bucket.held[member.bucket_position] = gradient.reshape(-1)
            parameter.grad = None
            return
        slots = self._staging(bucket).view(self.world_size, bucket.numel)
        rows_into_slots(gradient.reshape(-1), member.spec, slots, member.bucket_offset)
        parameter.grad = None

    def _start_reduction(self, bucket: Bucket) -> RecordedWork | None:
        if self.adds_directly:
            return None  # the gradients are in the accumulator already
        if self.sends_in_place:
            return self._start_in_place(bucket)
        staging = self._staging(bucket)  # a bucket no member gave a gradient on this rank takes part with zeros
        output = self.acquire(bucket.dtype, bucket.numel) if self.use_reduce_scatter else None
        work, bucket.own_slot = collectives.reduce_own_slot_async(
            staging, self.process_group, scatter=self.use_reduce_scatter, output=output
        )
        return work

    def _rows_for(self, bucket: Bucket, member: ReducedParameter, rank: int) -> Tensor:
        """What this rank contributes to ``rank``'s rows of ``member``: rows of the held gradient, or zeros."""
        spec = member.spec
        start, end = (0, 1) if spec.replicated else spec.rows_of(rank)  # a replicated value goes to every rank
        held = bucket.held[member.bucket_position] if bucket.held is not None else None
        if held is not None:
            return held[start * spec.row_numel : end * spec.row_numel]
        zeros = self._zeros.get(bucket.dtype)
        if zeros is None:
            largest = max(other.spec.slot_numel for other in self._member_of.values())
            zeros = self._zeros[bucket.dtype] = torch.zeros(largest, dtype=bucket.dtype, device=self.device)
        return zeros[: (end - start) * spec.row_numel]

    def _start_in_place(self, bucket: Bucket) -> RecordedWork | None:
        others = self.world_size - 1
        received = bucket.received = self.acquire(bucket.dtype, others * bucket.numel)
        slots = received.view(others, bucket.numel)
        me = collectives.rank(self.process_group)

        def pieces_for(rank: int) -> list[Tensor]:
            return [self._rows_for(bucket, member, rank) for member in bucket.members]

        def pieces_from(rank: int) -> list[Tensor]:
            slot = slots[rank - (rank > me)]
            return [
                slot[member.bucket_offset : member.bucket_offset + member.spec.local_numel] for member in bucket.members
            ]

        return collectives.reduce_scatter_pieces_async(pieces_for, pieces_from, self.process_group)

    def _complete_in_place(self, bucket: Bucket) -> None:
        assert bucket.received is not None
        slots = bucket.received.view(self.world_size - 1, bucket.numel)
        me = collectives.rank(self.process_group)
        members = [member for member in bucket.members if member.spec.local_numel]
        if members:
            targets = [
                self.accumulator[member.accumulator_offset : member.accumulator_offset + member.spec.local_numel]
                for member in members
            ]
            by_rank = [
                [self._rows_for(bucket, member, me) for member in members]
                if rank == me
                else [
                    slots[rank - (rank > me), m.bucket_offset : m.bucket_offset + m.spec.local_numel] for m in members
                ]
                for rank in range(self.world_size)
            ]
            # Added in rank order in the bucket's dtype, then averaged into the accumulator: the staged route's bits.
            # One foreach call per rank over the bucket's members, not one small kernel per member and rank.
            if self.world_size == 1:
                torch._foreach_add_(targets, by_rank[0])  # its own sum: nothing to add up first
            else:
                total = self.acquire(bucket.dtype, bucket.numel)
                sums = [total[m.bucket_offset : m.bucket_offset + m.spec.local_numel] for m in members]
                torch._foreach_copy_(sums, by_rank[0])
                for contributions in by_rank[1:]:
                    torch._foreach_add_(sums, contributions)
                torch._foreach_add_(targets, sums, alpha=1.0 / self.world_size)
                self.release(total)
        self.release(bucket.received)
        bucket.received = None
        bucket.held = None

    def _complete(self, bucket: Bucket) -> None:
        if self.adds_directly:
            return
        if self.sends_in_place:
            self._complete_in_place(bucket)
            return
        assert bucket.gradients is not None and bucket.own_slot is not None
        own_slot = bucket.own_slot
        members = [member for member in bucket.members if member.spec.local_numel]
        if members:
            # One foreach call over the bucket's members rather than one small kernel each (same values per element).
            torch._foreach_add_(
                [self.accumulator[m.accumulator_offset : m.accumulator_offset + m.spec.local_numel] for m in members],
                [own_slot[m.bucket_offset : m.bucket_offset + m.spec.local_numel] for m in members],
                alpha=1.0 / self.world_size,
            )
        # Staging goes back to the pool: stage 2 keeps only this rank's rows between backward passes.
        self.release(bucket.gradients)
        if self.use_reduce_scatter:
            self.release(own_slot)
        bucket.gradients = None
        bucket.own_slot = None

    def flush(self) -> None:
        raise RuntimeError(
            "ZeRO stage 2 reduces gradients during backward and never holds unreduced full gradients to flush: use"
            " stage 1 where gradients are reduced after the backward passes (pipeline schedules)."
        )


def _full_gradient_in(bucket: Bucket, member: ReducedParameter) -> Tensor:
    """Stage 1: the slice of ``bucket``'s gradient buffer holding ``member``'s full gradient."""
    assert bucket.gradients is not None
    parameter = member.parameter
    return bucket.gradients[member.bucket_offset : member.bucket_offset + parameter.numel()].view_as(parameter)
