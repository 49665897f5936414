"""The chunk manager: allocates chunks, gathers, releases, reduces and moves them, and counts their bytes.

Only this module moves chunk storage or communicates for it; the runtime (``hooks``, ``eviction``, and the
engine's checkpoint and end-of-run paths in ``checkpoint_state``) decides *when*.

[Note: chunk collectives per backend]
By default (``communication="auto"``) a gather all-gathers rank-major slots and copies them out into the chunk's
parameter-major layout, and a gradient is staged into rank-major slots and reduce-scattered: NCCL's collectives, or
on gloo the point-to-point exchanges of ``distributed/direct_exchange.py`` ([Note: exchanges per backend] in
``distributed/collectives.py``; ``"scatter_gather"`` forces them where ``"auto"`` would not, so CPU tests cover the
slot layout NCCL uses). Reductions in backward retire when their handle reports completion
(``complete_reductions``; they cannot be waited for before the last gather round, hooks.py [Note: gathering in
rounds]). gloo reports a point-to-point exchange complete only once it was waited for, which would keep every
chunk's full gradient in flight to the end of backward, the whole model instead of a few chunks (measured by
``test_working_set_is_a_few_chunks_not_the_model``); so reductions are *watched* exchanges, which a thread waits for
as they arrive (``direct_exchange.py`` [Note: a thread that watches exchanges]).
With ``communication="all_reduce"`` a gather writes this rank's rows into a zeroed
parameter-major buffer and all-reduces it (the rows partition every parameter, so the sum is the gathered chunk), and
a gradient is all-reduced in its own layout, keeping the own rows. Both routes give identical results and both are
tested. Both gathers can run ahead of the module that needs them (prefetch); the copy-out of the first happens in
``wait``. Every gathered buffer, staging buffer and full gradient is allocated when it is needed and dropped after
(no pool: on CUDA the caching allocator recycles the blocks).

[Note: weights autograd saved]
Autograd keeps what a module's backward needs from its forward, and for a linear layer that includes a view of the
weight (the transposed weight of the matrix product), which holds the gathered chunk's buffer after the engine
released the chunk. The values in it are the gathered values, unchanged until the optimizer steps. So a chunk
released in a forward while something else still holds its buffer keeps that buffer as ``released_full`` (instead of
handing it to the pool, which could give it to another gather), and its next gather in the same step (its module's
backward, or a second use in the forward, as a tied embedding) *reinstates* it: no exchange, no second buffer. Only
FSDP2's kind of engine, which frees the storage at release and gathers into it again, needs the second gather. The
hooks reinstate before a gather round, so a rank that reinstates asks for nothing and takes part in the others' gathers
with its rows as usual. A released buffer is dropped (back to the pool) at the end of a forward if nothing but the
chunk holds it (no gradient was recorded), at the end of backward, at a fresh gather of its chunk, and when the
step or a load changes the shards (``release_all``, ``masters_to_shards``). Without torch's storage use count nothing
is kept.

[Note: two groups]
Gathers happen where modules need their chunks; a chunk's gradient reduction happens once its gradients are complete,
which is a local fact (a parameter may get no gradient on one rank, so that rank reduces the chunk only at the end of
backward). On one process group the two kinds would interleave differently on different ranks and be matched
wrongly. Reductions therefore run on a second group over the same ranks, asynchronously: each group sees its
collectives in the same order on every rank (gathers in module order, reductions in fixed chunk order), and no rank
blocks on a reduction another rank has not started yet; they are waited for at the end of backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_colossal.disk.optimizer_state import is_placeholder, placeholder
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices
from lightning_colossal.distributed.in_flight import Activity, RecordedWork
from lightning_colossal.engine_parts.buffer_pool import BufferPool, held_elsewhere
from lightning_colossal.engine_parts.staging import own_rows_into_whole, rows_from_slots, rows_into_slots
from lightning_colossal.gemini.chunk import Chunk, ChunkState, Location
from lightning_colossal.gemini.layout import ChunkMember, ChunkSpec
from lightning_colossal.gemini.placement import PlacementPlan

MAX_REDUCTIONS_IN_FLIGHT = 2


class ChunkBytes(NamedTuple):
    """Bytes one rank holds for chunks, by kind and by location (summed from the real tensors)."""

    shard: int
    gathered: int
    master: int
    gradient: int
    optimizer_state: int
    compute: int
    offload: int


class ChunkManager:
    """Owns every chunk of one rank.

    Args:
        specs: the layout (this rank's view).
        parameters: per chunk, the ``nn.Parameter`` objects of its members, in member order.
        plan: which chunks keep gathered / offload their optimizer / offload their parameter shards.
        process_group: the data-parallel ranks.
        compute_device: where modules run.
        use_scatter_gather: gather with an all-gather of slots ([Note: chunk collectives per backend]).
        reduce_group: the same ranks as ``process_group``, for gradient reductions ([Note: two groups]).
        masters_on_disk: the chunks whose optimizer state the plan puts on disk keep their separate fp32 masters
            there too: they get no master storage here (``masters_on_disk.py``).
    """

    def __init__(
        self,
        specs: list[ChunkSpec],
        parameters: list[list[nn.Parameter]],
        plan: PlacementPlan,
        process_group: ProcessGroup,
        compute_device: torch.device,
        use_scatter_gather: bool,
        reduce_group: ProcessGroup | None = None,
        masters_on_disk: bool = False,
    ) -> None:
        self.process_group = process_group
        self.reduce_group = reduce_group if reduce_group is not None else process_group
        self._pending: deque[_PendingReduction] = deque()
        #: Reduced gradients of offloaded chunks on their way to the host, folded in after one wait at the end of
        #: backward ([Note: reduced gradients drained to the host once]), and the pinned buffers they land in.
        self._drains: list[_Drain] = []
        self._drain_buffers: dict[tuple[int, torch.dtype], list[Tensor]] = {}
        # Gathered chunks and full gradients held at once: the working set on top of the shards (16Ψ/N).
        self.working_set_bytes = 0
        self.peak_working_set_bytes = 0
        self.world_size = collectives.world_size(process_group)
        self.compute_device = compute_device
        self.offload_device = torch.device("cpu")
        self.use_scatter_gather = use_scatter_gather
        self.plan = plan
        #: Host buffers of gathers, full gradients and staging, reused from step to step ([Note: reusing large host
        #: buffers] in ``engine_parts/buffer_pool.py``).
        self.buffers = BufferPool()
        #: Gathers served by a buffer autograd kept ([Note: weights autograd saved]), for tests and benchmarks.
        self.reinstated = 0
        self.chunks: list[Chunk] = []
        for spec, members in zip(specs, parameters, strict=True):
            dtype = members[0].dtype
            if any(parameter.dtype != dtype for parameter in members):
                raise TypeError(
                    f"chunk {spec.index} mixes parameter dtypes {sorted({str(p.dtype) for p in members})}: Gemini"
                    " chunks hold one dtype. Cast the model to one dtype (the precision plugin does this)."
                )
            starts_offloaded = spec.index in plan.offload_parameters or spec.index in plan.start_offloaded
            shard_location = Location.OFFLOAD if starts_offloaded else Location.COMPUTE
            master_location = Location.OFFLOAD if spec.index in plan.offload_optimizer else Location.COMPUTE
            if spec.frozen:
                master_location = shard_location  # nothing steps a frozen chunk: layout.py [Note: frozen chunks]
            shard = self._zeros(spec.shard_numel, dtype, shard_location)
            # A shard that automatic placement will bring onto the compute device cannot share storage with a
            # master the optimizer keeps on the CPU.
            will_move = spec.index in plan.start_offloaded and self.offload_device != compute_device
            master_on_disk = False
            if spec.frozen or (
                dtype == torch.float32
                and self.device_of(shard_location) == self.device_of(master_location)
                and not will_move
            ):
                # An fp32 shard is its own master: no second copy (see chunk.py ``Chunk``); a frozen shard, of any
                # dtype, is never stepped, so its "master" (what checkpoints read and load) is the shard itself.
                master = shard
            elif masters_on_disk and spec.index in plan.disk_optimizer:
                # Never allocated: its values go straight from the shard into the disk tier (masters_on_disk.py).
                master = placeholder(shard, torch.float32)
                master_on_disk = True
            else:
                master = self._zeros(spec.shard_numel, torch.float32, master_location)
            chunk = Chunk(
                spec=spec,
                shard=shard,
                master=master,
                shard_location=shard_location,
                master_location=master_location,
                parameters=list(members),
                keep_gathered=spec.index in plan.keep_gathered,
                masters_on_disk=master_on_disk,
            )
            chunk.master_views = [chunk.member_shard(master, member) for member in spec.members]
            chunk.gradients_expected = sum(1 for parameter in members if parameter.requires_grad)
            self.chunks.append(chunk)
        self.placeholders = {
            chunk.index: torch.empty(0, dtype=chunk.shard.dtype, device=compute_device) for chunk in self.chunks
        }

    def device_of(self, location: Location) -> torch.device:
        return self.compute_device if location is Location.COMPUTE else self.offload_device

    def _zeros(self, numel: int, dtype: torch.dtype, location: Location) -> Tensor:
        """A chunk's zeroed shard, master or gradient at ``location``: in host memory beside a GPU, pinned, so that
        the copies to and from the GPU run asynchronously (from pageable memory each one waits for the GPU's queue)."""
        device = self.device_of(location)
        if device.type == "cpu":
            return devices.host_buffer(numel, dtype, beside=self.compute_device, zeroed=True)
        return torch.zeros(numel, dtype=dtype, device=device)

    # ---------------------------------------------------------------------------------------------- gather
    def gather(self, chunk: Chunk, asynchronous: bool = False) -> None:
        """Make the whole chunk available on the compute device and point its parameters into it."""
        if chunk.state is ChunkState.GATHERING:
            self.wait(chunk)
            return
        if chunk.is_gathered:
            return
        self._forget_released(chunk)  # a fresh gather supersedes it
        if chunk.shard_location is Location.OFFLOAD and self.offload_device != self.compute_device:
            source = devices.to_device(chunk.shard, self.compute_device)
        else:
            source = chunk.shard
        # The slots' copies and a one-rank copy write every element; the all-reduce route sums into zeros.
        zeroed = self.world_size > 1 and not self.use_scatter_gather
        full = self.buffers.take(chunk.spec.numel, chunk.shard.dtype, self.compute_device, zeroed=zeroed)
        work = None
        if self.world_size == 1:
            full.copy_(source)
        else:
            with Activity(describe_chunk, "gathering", chunk):
                work = self._exchange_rows(chunk, source, full)
        chunk.full = full
        self._count_working_set(_nbytes(full))
        if work is not None and asynchronous:
            chunk.pending_gather = work
            chunk.move(ChunkState.GATHERING)
            return
        if work is not None:
            work.wait()
        chunk.move(ChunkState.GATHERED)
        self._point_parameters(chunk)

    def reinstate(self, chunk: Chunk) -> bool:
        """Gather ``chunk`` by taking back the buffer of its release earlier in this step, which autograd kept
        ([Note: weights autograd saved]); ``False`` when there is none (the caller gathers in a round)."""
        full = chunk.released_full
        if full is None or chunk.state is not ChunkState.SHARDED:
            return False
        chunk.released_full = None
        chunk.full = full
        self._count_working_set(_nbytes(full))
        chunk.move(ChunkState.GATHERED)
        self._point_parameters(chunk)
        self.reinstated += 1
        return True

    def forget_released(self, unless_held: bool = False) -> None:
        """Drop the released buffers ([Note: weights autograd saved]); with ``unless_held``, only those nothing else
        holds any more."""
        for chunk in self.chunks:
            if chunk.released_full is not None and not (unless_held and held_elsewhere(chunk.released_full)):
                self._forget_released(chunk)

    def _forget_released(self, chunk: Chunk) -> None:
        full, chunk.released_full = chunk.released_full, None
        if full is not None:
            self.buffers.give_back(full)

    def _count_working_set(self, delta: int) -> None:
        self.working_set_bytes += delta
        self.peak_working_set_bytes = max(self.peak_working_set_bytes, self.working_set_bytes)

    def allocate_full_gradient(self, chunk: Chunk) -> Tensor:
        chunk.full_gradient = self.buffers.take(chunk.spec.numel, torch.float32, self.compute_device, zeroed=True)
        self._count_working_set(_nbytes(chunk.full_gradient))
        return chunk.full_gradient

    def wait(self, chunk: Chunk) -> None:
        if chunk.state is not ChunkState.GATHERING:
            return
        chunk.pending_gather.wait()
        chunk.pending_gather = None
        chunk.move(ChunkState.GATHERED)
        self._point_parameters(chunk)

    def _exchange_rows(self, chunk: Chunk, source: Tensor, full: Tensor) -> RecordedWork | None:
        """Start filling the zeroed ``full`` with every rank's rows of ``chunk``, this rank giving its shard
        ``source`` ([Note: chunk collectives per backend]); returns the handle to wait on (``None``: done)."""
        if self.use_scatter_gather:
            return self._all_gather_slots(chunk, source, full)
        for member in chunk.spec.members:
            own_rows_into_whole(chunk.member_shard(source, member), member.spec, _flat_member(full, member))
        return collectives.all_reduce_async(full, group=self.process_group)

    def _all_gather_slots(self, chunk: Chunk, source: Tensor, full: Tensor) -> RecordedWork | None:
        slot = chunk.spec.slot_numel
        send = self.buffers.take(slot, source.dtype, self.compute_device, zeroed=True)
        for member in chunk.spec.members:
            send[member.slot_offset : member.slot_offset + member.spec.local_numel].copy_(
                chunk.member_shard(source, member).reshape(-1)
            )
        slots = self.buffers.take(self.world_size * slot, source.dtype, self.compute_device, zeroed=False)

        def copy_rows() -> None:
            rank_major = slots.view(self.world_size, slot)
            for member in chunk.spec.members:
                rows_from_slots(rank_major, member.slot_offset, member.spec, _flat_member(full, member))
            self.buffers.give_back(slots)
            self.buffers.give_back(send)

        return collectives.all_gather_into_async(slots, send, group=self.process_group, then=copy_rows)

    def _point_parameters(self, chunk: Chunk) -> None:
        assert chunk.full is not None
        for member, parameter in zip(chunk.spec.members, chunk.parameters, strict=True):
            parameter.data = chunk.member_full(chunk.full, member)

    def detach_parameters(self, chunk: Chunk) -> None:
        """Point the parameters at empty placeholders (after set-up filled the shard from their values)."""
        placeholder = self.placeholders[chunk.index]
        for parameter in chunk.parameters:
            parameter.data = placeholder

    def release(self, chunk: Chunk) -> None:
        """Drop the gathered buffer (kept for a later gather in this step while autograd holds it, outside backward:
        [Note: weights autograd saved]); the parameters become empty placeholders until the next gather."""
        if chunk.state is ChunkState.GATHERING:
            self.wait(chunk)
        self._drop_gathered(chunk, keep_if_held=not inside_backward())
        self.detach_parameters(chunk)

    def release_all(self) -> None:
        """Release every gathered chunk (after each step and between stages; chunks stay valid, only the gathered
        copies go; their buffers stay kept for the next step's gathers, until ``buffers.clear()``)."""
        self.forget_released()  # the step changes the shards: what was gathered before it is stale
        for chunk in self.chunks:
            if chunk.state is ChunkState.GATHERING:
                self.wait(chunk)
            if chunk.state is ChunkState.AWAITING_GRADIENTS:
                chunk.move(ChunkState.GATHERED)
            if chunk.state is ChunkState.GATHERED:
                self.release(chunk)

    def release_keeping_values(self, chunk: Chunk) -> None:
        """Release a gathered chunk, leaving each parameter a copy of its whole value in its own storage (end of a
        run: the chunk stops driving the parameters; its shard and master stay readable)."""
        for parameter in chunk.parameters:
            parameter.data = parameter.data.clone()
        self._drop_gathered(chunk)

    def _drop_gathered(self, chunk: Chunk, keep_if_held: bool = False) -> None:
        chunk.move(ChunkState.SHARDED)
        full, chunk.full = chunk.full, None
        self._count_working_set(-_nbytes(full))
        if keep_if_held and full is not None and held_elsewhere(full):
            chunk.released_full = full  # [Note: weights autograd saved]
            return
        # Reused once autograd let go of the weights it saved from it ([Note: reusing large host buffers]).
        self.buffers.give_back(full)

    def move_shard(self, chunk: Chunk, location: Location) -> None:
        """Move this rank's working shard to ``location`` (its master, if separate, stays where it is)."""
        if chunk.shard_location is location:
            return
        device = self.device_of(location)
        if device != chunk.shard.device:
            if chunk.masters_alias_shard and not chunk.frozen:
                # Placement never asks for this: the optimizer holds views of an aliased master, so it must stay.
                raise RuntimeError(f"chunk {chunk.index}: cannot move a shard that is its own master across devices.")
            # Towards the host the copy is waited for: checkpoints and shards_to_masters read the shard there.
            moved = devices.to_host(chunk.shard) if not devices.is_accelerator(device) else None
            chunk.shard = moved if moved is not None else devices.to_device(chunk.shard, device)
            if chunk.frozen:
                # A frozen chunk's shard is its master (nothing steps it); checkpoints read the views, so they follow.
                chunk.master = chunk.shard
                chunk.master_views = [chunk.member_shard(chunk.shard, member) for member in chunk.spec.members]
        chunk.shard_location = location

    # ---------------------------------------------------------------------------------------------- gradients
    def contribute_to_gather(self, chunk: Chunk) -> None:
        """Take part in another rank's gather of ``chunk`` with this rank's rows, keeping nothing (the chunk's own
        state is unchanged: it may be gathered here already, or not needed)."""
        source = devices.to_device(chunk.shard, self.compute_device)
        zeroed = not self.use_scatter_gather
        full = self.buffers.take(chunk.spec.numel, chunk.shard.dtype, self.compute_device, zeroed=zeroed)
        with Activity(describe_chunk, "contributing rows to another rank's gather of", chunk):
            work = self._exchange_rows(chunk, source, full)
            if work is not None:
                work.wait()
        self.buffers.give_back(full)

    def reduce(self, chunk: Chunk, bound_in_flight: bool = True) -> None:
        """Start averaging the chunk's full gradient over the ranks; ``complete_reductions`` adds the own rows to the
        fp32 shard gradient. Runs on ``reduce_group`` without waiting ([Note: two groups])."""
        if chunk.frozen:
            raise RuntimeError(
                f"chunk {chunk.index} holds frozen parameters and has no gradient to reduce. This is a bug in the"
                " Gemini runtime; please report it with the model that triggered it."
            )
        full = chunk.full_gradient
        if full is None:  # no gradient reached this chunk on this rank: it still takes part with zeros
            full = self.allocate_full_gradient(chunk)
        chunk.full_gradient = None
        chunk.gradients_arrived = 0
        with Activity(describe_chunk, "reducing the gradients of", chunk):
            self._launch_reduction(chunk, full)
        # Bound the full gradients in flight: the working set stays a few chunks, not the whole model (once no rank
        # can still need a gather round from this one: hooks.py [Note: gathering in rounds]).
        self.complete_reductions(block=False, keep_at_most=MAX_REDUCTIONS_IN_FLIGHT if bound_in_flight else None)

    def _launch_reduction(self, chunk: Chunk, full: Tensor) -> None:
        """Start the collective of ``reduce`` and queue it (its handle keeps the activity label for the wait)."""
        if self.use_scatter_gather and self.world_size > 1:
            staging = self.buffers.take(
                self.world_size * chunk.spec.slot_numel, torch.float32, self.compute_device, zeroed=True
            ).view(self.world_size, chunk.spec.slot_numel)
            for member in chunk.spec.members:
                rows_into_slots(_flat_member(full, member), member.spec, staging, member.slot_offset)
            self.buffers.give_back(full)
            # The other ranks' rows arrive in a pooled scratch and the sum stays in it or in the staging, so a
            # reduction allocates nothing (gloo's point-to-point route; benchmarks/RESULTS.md, Gemini's peak memory).
            scratch = (
                self.buffers.take(
                    (self.world_size - 1) * chunk.spec.slot_numel, torch.float32, self.compute_device, zeroed=False
                )
                if collectives.sends_directly(self.reduce_group)
                else None
            )
            work, received = collectives.reduce_own_slot_async(
                staging.view(-1), self.reduce_group, scatter=True, reports_completion=True, scratch=scratch
            )
            buffers = (staging,) if scratch is None else (staging, scratch)
            self._pending.append(_PendingReduction(chunk, work, received, buffers, rank_major=True))
        else:
            work = collectives.all_reduce_async(full, group=self.reduce_group)
            self._pending.append(_PendingReduction(chunk, work, full, (), rank_major=False))

    def complete_reductions(self, block: bool, keep_at_most: int | None = None) -> None:
        """Fold finished reductions into the shard gradients, in launch order: all of them with ``block``, else
        the finished ones and, waiting, enough to leave at most ``keep_at_most`` in flight."""
        while self._pending:
            pending = self._pending[0]
            must_wait = block or (keep_at_most is not None and len(self._pending) > keep_at_most)
            if pending.work is not None and not must_wait and not pending.work.is_completed():
                return
            self._pending.popleft()
            if pending.work is not None:
                pending.work.wait()
            self._count_working_set(-chunk_gradient_bytes(pending.chunk))
            chunk = pending.chunk
            if chunk.gradient is None:
                chunk.gradient = self._zeros(chunk.spec.shard_numel, torch.float32, chunk.master_location)
            result = pending.result
            if result.device != chunk.gradient.device:
                self._start_drain(chunk, result, pending.rank_major)
            else:
                self._fold(chunk, result, pending.rank_major)
            for buffer in pending.buffers:
                self.buffers.give_back(buffer)
            if not pending.rank_major:
                self.buffers.give_back(pending.result)  # the chunk's full gradient, summed in place
        if block:
            self._finish_drains()

    def _fold(self, chunk: Chunk, result: Tensor, rank_major: bool) -> None:
        """Add this rank's rows of a reduced sum (``result``, on the gradient's device) to the chunk's shard gradient."""
        assert chunk.gradient is not None
        targets, owns = [], []
        for member in chunk.spec.members:
            numel = member.spec.local_numel
            if numel == 0:
                continue
            if rank_major:
                owns.append(result[member.slot_offset : member.slot_offset + numel])
            else:
                owns.append(chunk.member_owned_in_full(result, member))
            targets.append(chunk.gradient[member.shard_offset : member.shard_offset + numel])
        if targets:
            # One foreach call per chunk rather than one small kernel per member (same values per element).
            torch._foreach_add_(targets, owns, alpha=1.0 / self.world_size)

    def _start_drain(self, chunk: Chunk, result: Tensor, rank_major: bool) -> None:
        """Start copying a reduced sum on the device to the host, to fold in after ``_finish_drains``' one wait.

        [Note: reduced gradients drained to the host once]
        With the optimizer offloaded, each chunk's reduced gradient goes to the host shard gradient the host step
        reads. Copied and folded one chunk at a time, each copy was waited for inside backward (62 waits a step on
        the 1.07B GPT, each draining the GPU's queue while backward still had work to queue). Instead each copy is
        started without waiting, into a pinned host buffer kept for the next step (allocating pinned memory is itself
        slow on a GPU host), and the host adds the rows in only at the end of backward, after one wait for all of
        them: the host must not read a buffer before its copy landed (device.py [Note: copies between host and
        device]). The buffers cost the reduced rows of each offloaded chunk in host memory, the size of its shard
        gradient. Where the compute device is the host itself nothing is copied (no drain starts).
        """
        kept = self._drain_buffers.get((result.numel(), result.dtype))
        host = kept.pop() if kept else devices.host_buffer(result.numel(), result.dtype, beside=result.device)
        devices.start_copy_to_host(host, result.reshape(-1))
        self._drains.append(_Drain(chunk, host.view(result.shape), rank_major, result.device))

    def _finish_drains(self) -> None:
        """Wait once for every copy ``_start_drain`` started, then fold them in (the end of backward)."""
        if not self._drains:
            return
        for device in {drain.source_device for drain in self._drains}:
            devices.synchronize(device)
        drains, self._drains = self._drains, []
        for drain in drains:
            self._fold(drain.chunk, drain.host, drain.rank_major)
            flat = drain.host.reshape(-1)
            self._drain_buffers.setdefault((flat.numel(), flat.dtype), []).append(flat)

    def attach_master_gradients(self, has_gradient: Callable[[nn.Parameter], bool] = lambda parameter: True) -> None:
        """Point each master's ``.grad`` at its reduced rows; ``None`` where ``has_gradient(parameter)`` is false."""
        for chunk in self.chunks:
            if chunk.gradient is None:
                continue
            for member, parameter, view in zip(chunk.spec.members, chunk.parameters, chunk.master_views, strict=True):
                view.grad = chunk.member_shard(chunk.gradient, member) if has_gradient(parameter) else None

    def zero_gradients(self) -> None:
        for chunk in self.chunks:
            if chunk.gradient is not None:
                chunk.gradient.zero_()

    def masters_to_shards(self) -> None:
        """After the optimizer stepped (or masters were loaded): refresh the working shards from the masters."""
        self.forget_released()
        with torch.no_grad():
            for chunk in self.chunks:
                # A master on disk reaches its shard as its record steps, or through the engine after a load.
                if not chunk.masters_alias_shard and not chunk.masters_on_disk:
                    devices.copy_into(chunk.shard, chunk.master)

    def shards_to_masters(self) -> None:
        with torch.no_grad():
            for chunk in self.chunks:
                if not chunk.masters_alias_shard and not chunk.masters_on_disk:
                    chunk.master.copy_(chunk.shard)

    # ---------------------------------------------------------------------------------------------- accounting
    def chunk_bytes(self, optimizer_state: dict[Any, Any] | None = None) -> ChunkBytes:
        """Bytes held for chunks on this rank, from the tensors themselves (placement decisions use this)."""
        per_chunk = self.chunk_bytes_by_chunk(optimizer_state)
        return (
            ChunkBytes(*(sum(values) for values in zip(*per_chunk, strict=True)))
            if per_chunk
            else ChunkBytes(0, 0, 0, 0, 0, 0, 0)
        )

    def compute_bytes(self, optimizer_state: dict[Any, Any] | None = None) -> int:
        """``chunk_bytes(optimizer_state).compute`` without adding up the rest: automatic placement asks before
        every module call, and at hundreds of chunks the whole account (every chunk's tensors and optimizer state)
        was most of a step (66 s of host-bound steps at 511 chunks). A chunk whose storage is all off the device
        costs two attribute reads."""
        total = 0
        for chunk in self.chunks:
            if chunk.full is not None:
                total += _nbytes(chunk.full)
            if chunk.full_gradient is not None:
                total += _nbytes(chunk.full_gradient)
            if chunk.shard_location is Location.COMPUTE:
                total += _nbytes(chunk.shard)
            if chunk.master_location is Location.COMPUTE:
                bytes_of = _one_chunk_bytes(chunk, optimizer_state)
                total += bytes_of.master + bytes_of.gradient + bytes_of.optimizer_state
        return total

    def chunk_bytes_by_chunk(self, optimizer_state: dict[Any, Any] | None = None) -> list[ChunkBytes]:
        """``chunk_bytes`` of each chunk on its own, in chunk order (where each chunk's bytes live)."""
        return [_one_chunk_bytes(chunk, optimizer_state) for chunk in self.chunks]


def describe_chunk(doing: str, chunk: Chunk) -> str:
    """``gathering chunk 3 (blocks.2.attn.qkv.weight, ... 4 parameters)`` (without ``doing`` when it is empty): an
    activity label, formatted only when a hang report is made (``distributed/in_flight.py``)."""
    members = chunk.spec.members
    names = members[0].name if members else ""
    if len(members) > 1:
        names += f", ... {len(members)} parameters"
    return f"{doing} chunk {chunk.index} ({names})".lstrip()


def _flat_member(full: Tensor, member: ChunkMember) -> Tensor:
    """``member``'s whole flat value inside a gathered-shaped flat ``full``."""
    return full[member.offset : member.offset + member.numel]


def chunk_gradient_bytes(chunk: Chunk) -> int:
    return chunk.spec.numel * 4  # full gradients are fp32


class _Drain(NamedTuple):
    chunk: Chunk
    host: Tensor  # the pinned buffer the reduced sum is being copied into
    rank_major: bool
    source_device: torch.device


class _PendingReduction(NamedTuple):
    chunk: Chunk
    work: Any
    result: Tensor  # the all-reduced full gradient, or this rank's reduce-scattered slot
    buffers: tuple[Tensor, ...]  # the staging and scratch, kept alive until the collective is done, then pooled
    rank_major: bool


def _one_chunk_bytes(chunk: Chunk, optimizer_state: dict[Any, Any] | None) -> ChunkBytes:
    shard_bytes = _nbytes(chunk.shard)
    full_bytes = _nbytes(chunk.full) + _nbytes(chunk.full_gradient)
    compute = full_bytes
    offload = 0
    own = {
        "shard": (shard_bytes, chunk.shard_location),
        "master": (0 if chunk.masters_alias_shard else _nbytes(chunk.master), chunk.master_location),
        "gradient": (_nbytes(chunk.gradient), chunk.master_location),
    }
    states = 0
    if optimizer_state is not None:
        for view in chunk.master_views:
            states += sum(
                _nbytes(value) for value in optimizer_state.get(view, {}).values() if isinstance(value, Tensor)
            )
    own["state"] = (states, chunk.master_location)
    for size, location in own.values():
        if location is Location.COMPUTE:
            compute += size
        else:
            offload += size
    return ChunkBytes(shard_bytes, full_bytes, own["master"][0], own["gradient"][0], states, compute, offload)


def _nbytes(tensor: Tensor | None) -> int:
    if tensor is None or is_placeholder(tensor):
        return 0  # state on disk between steps: held by the disk tier, not here
    return tensor.numel() * tensor.element_size()


def inside_backward() -> bool:
    """Whether autograd is running a backward on this thread (a forward now is a checkpoint's recomputation)."""
    # torch.utils.checkpoint asks the same private question to tell its recomputation from a first forward.
    return torch._C._current_graph_task_id() != -1
