"""After a ZeRO step: every rank's updated rows to every replica, bucket by bucket, optionally overlapped with the step.

[Note: parameter exchange per backend]
After a step each rank owns fresh rows of every parameter. By default they are all-gathered: NCCL's all-gather of a
rank-major buffer, or on gloo point-to-point sends of each parameter's rows straight from and into the parameters
(rows along dim 0 are contiguous, so nothing is packed or unpacked; a parameter whose data is not contiguous goes
through the rank-major buffer). With ``communication="all_reduce"`` each rank writes its rows
into a zeroed full-size buffer and all-reduces it: since the owned rows partition the parameter, the sum is exactly
the gathered tensor ([Note: exchanges per backend] in ``distributed/collectives.py``). The exchange works bucket by
bucket in buffers the reducer already has: stage 1's gradient buffers (their contents are spent once the bucket
stepped; the engine zeroes them after the step) or stage 2's pooled staging buffers.

[Note: exchange overlapped with the step]
DDP hides its whole all-reduce under backward. ZeRO hides the reduce-scatter half there too, but the all-gather half
can only start once the optimizer produced new rows, so done after the step it is exposed: on the benchmark GPT over
gloo it was the largest part of ZeRO-2's optimizer phase (benchmarks/RESULTS.md). So, when the optimizer's step of a
parameter depends on nothing but that parameter (``optimizer_takeover.steps_each_parameter_alone``), the engine steps
the masters one bucket at a time and starts that bucket's exchange before stepping the next: the network carries
bucket k while the CPU (or device) steps bucket k+1. At most ``MAX_EXCHANGES_IN_FLIGHT`` exchanges are in flight, so
the buffers stay a few buckets whatever the model size. Every value is the one the whole step would give: each
element's update reads only its own gradient and state, and the exchanges move the same rows in the same order on
every rank. Any other optimizer (or user hooks on its step, which expect one call per step) steps whole, then the
exchange runs as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity, RecordedWork
from lightning_colossal.engine_parts import optimizer_takeover, sharded_state
from lightning_colossal.engine_parts.rows import shard_spec
from lightning_colossal.engine_parts.staging import copy_out_of_flat, own_rows_into_whole, rows_from_slots
from lightning_colossal.zero.reducer import Bucket, GradientReducer, ReducedParameter

#: Exchanges started and not yet waited for while the step goes on ([Note: exchange overlapped with the step]).
MAX_EXCHANGES_IN_FLIGHT = 2


class ParameterExchange:
    """Gives every replica the rows each rank stepped, one reducer bucket at a time.

    Args:
        reducer: the engine's gradient reducer, whose buckets (and pooled buffers) the exchange follows.
        process_group: the data-parallel ranks.
        use_scatter_gather: all-gather rows (else all-reduce a zeroed full buffer): [Note: parameter exchange per
            backend].
    """

    def __init__(self, reducer: GradientReducer, process_group: ProcessGroup | None, use_scatter_gather: bool) -> None:
        self.reducer = reducer
        self.process_group = process_group
        self.use_scatter_gather = use_scatter_gather
        self.world_size = collectives.world_size(process_group)
        self.rank = collectives.rank(process_group)

    def all_buckets(self) -> None:
        """Exchange every bucket, each finished before the next starts."""
        if self.world_size == 1:
            return
        for index, bucket in enumerate(self.reducer.buckets):
            with Activity("gathering the updated parameters of bucket {} of {}", index + 1, len(self.reducer.buckets)):
                work = self.start(bucket)
                if work is not None:
                    work.wait()

    def start(self, bucket: Bucket) -> RecordedWork | None:
        """Start exchanging ``bucket``'s rows; the parameters hold every rank's rows once the handle was waited for
        (at once when ``None`` is returned)."""
        if not self.use_scatter_gather:
            return self._start_all_reduce(bucket)
        if collectives.sends_directly(self.process_group) and all(
            member.parameter.data.is_contiguous() for member in bucket.members
        ):
            return self._start_rows_in_place(bucket.members)
        return self._start_all_gather(bucket.members, bucket.dtype)

    def _start_rows_in_place(self, members: list[ReducedParameter]) -> RecordedWork | None:
        """Point-to-point sends on gloo: each rank's rows go from its parameters straight into the other ranks'
        parameters, with no rank-major buffer to pack and unpack ([Note: parameter exchange per backend])."""
        # A replicated parameter keeps its own value (engine.py [Note: replicated parameters follow rank 0]).
        sharded = [member for member in members if not member.spec.replicated]

        def rows_of(rank: int) -> list[Tensor]:
            return [_rows_of_rank(member, rank) for member in sharded]

        return collectives.all_gather_pieces_async(rows_of(self.rank), rows_of, group=self.process_group)

    def _start_all_reduce(self, bucket: Bucket) -> RecordedWork | None:
        total = sum(member.parameter.numel() for member in bucket.members)
        pooled = bucket.gradients is None
        buffer = (
            self.reducer.acquire(bucket.dtype, self.world_size * bucket.numel)
            if bucket.gradients is None
            else bucket.gradients
        )
        full = buffer[:total].zero_()
        offset = 0
        for member in bucket.members:
            numel = member.parameter.numel()
            own_rows_into_whole(owned_rows(member), member.spec, full[offset : offset + numel])
            offset += numel

        def finish() -> None:
            copy_out_of_flat(full, [member.parameter.data for member in bucket.members])
            if pooled:
                self.reducer.release(buffer)

        return collectives.all_reduce_async(full, self.process_group, then=finish)

    def _start_all_gather(self, members: list[ReducedParameter], dtype: torch.dtype) -> RecordedWork | None:
        slot = sum(member.spec.slot_numel for member in members)
        send = self.reducer.acquire(dtype, slot).zero_()
        offset = 0
        for member in members:
            if member.spec.local_numel:
                send[offset : offset + member.spec.local_numel].copy_(owned_rows(member).reshape(-1))
            offset += member.spec.slot_numel
        gathered = self.reducer.acquire(dtype, self.world_size * slot)

        def finish() -> None:
            slots = gathered.view(self.world_size, slot)
            offset = 0
            for member in members:
                # A replicated parameter keeps its own value: every rank stepped it from the same averaged gradient
                # (engine.py [Note: replicated parameters follow rank 0]).
                if not member.spec.replicated:
                    rows_from_slots(slots, offset, member.spec, member.parameter.data.view(-1))
                offset += member.spec.slot_numel
            self.reducer.release(send)
            self.reducer.release(gathered)

        return collectives.all_gather_into_async(gathered, send, group=self.process_group, then=finish)


def _rows_of_rank(member: ReducedParameter, rank: int) -> Tensor:
    """The rows of ``member``'s parameter that ``rank`` owns, as a flat view of the parameter's (contiguous) data."""
    spec = shard_spec(member.parameter.shape, member.spec.world_size, rank)
    return member.parameter.data.view(-1)[spec.row_start * spec.row_numel : spec.row_end * spec.row_numel]


def owned_rows(member: ReducedParameter) -> Tensor:
    """This rank's rows of ``member``'s parameter (a view of its data)."""
    return sharded_state.owned_rows_of(member.parameter.data, member.spec)


def step_overlapping_exchange(
    optimizer: Optimizer,
    exchange: ParameterExchange,
    masters_by_bucket: list[list[Tensor]],
    publish_rows: Callable[[Bucket], None],
    compute_device: torch.device,
) -> None:
    """One optimizer step, bucket by bucket, each bucket's exchange started before the next bucket steps ([Note:
    exchange overlapped with the step]). ``publish_rows`` writes a stepped bucket's masters into its parameters' rows
    (separate masters only). Masters in no bucket (parameters the engine keeps whole) step last, together; offloaded
    ones with torch's fused kernel (``optimizer_takeover.fused_host_step``)."""
    in_buckets = {id(master) for masters in masters_by_bucket for master in masters}
    rest = {
        id(master) for group in optimizer.param_groups for master in group["params"] if id(master) not in in_buckets
    }
    in_flight: deque[tuple[int, RecordedWork]] = deque()
    buckets = exchange.reducer.buckets

    def wait_oldest() -> None:
        index, work = in_flight.popleft()
        with Activity("gathering the updated parameters of bucket {} of {}", index + 1, len(buckets)):
            work.wait()

    for index, (bucket, masters) in enumerate(zip(buckets, masters_by_bucket, strict=True)):
        narrowed = optimizer_takeover.narrowed_to(optimizer, {id(master) for master in masters})
        with narrowed, optimizer_takeover.fused_host_step(optimizer, compute_device):
            optimizer.step()
        with torch.no_grad():
            publish_rows(bucket)
            if len(in_flight) == MAX_EXCHANGES_IN_FLIGHT:
                wait_oldest()
            with Activity("gathering the updated parameters of bucket {} of {}", index + 1, len(buckets)):
                work = exchange.start(bucket)
        if work is not None:
            in_flight.append((index, work))
    if rest:
        with (
            optimizer_takeover.narrowed_to(optimizer, rest),
            optimizer_takeover.fused_host_step(optimizer, compute_device),
        ):
            optimizer.step()
    while in_flight:
        wait_oldest()
