"""ZeRO-1/2: optimizer state (and, for stage 2, gradients) sharded over data-parallel ranks. No Lightning here.

The user's optimizer is kept (so LR schedulers and ``param_groups`` edits keep working) but its parameter lists are
replaced by *masters*: this rank's rows of each parameter (``engine_parts/rows.py`` [Note: sharding along dim 0]). An fp32
parameter that is not offloaded is its own master (a view, no copy). Low-precision parameters and CPU offload get
fp32 masters in one flat buffer on the offload device. After each optimizer step the updated rows are written back
and every rank's rows are exchanged, so all replicas hold the full, identical parameters again.

After each step the updated rows reach every replica through ``exchange.py`` ([Note: parameter exchange per backend]),
bucket by bucket and, for an optimizer that steps each parameter alone, overlapped with the step itself ([Note:
exchange overlapped with the step]).

[Note: masters or parameters in checkpoints]
A checkpoint holds the fp32 masters instead of the parameters exactly when some trainable parameter is not fp32
(``checkpoints_hold_masters``): the masters are then the only unrounded copy of the weights (ColossalAI saves only
the rounded parameters). With fp32 parameters the masters hold the same values, also when ``cpu_offload`` keeps them
in a separate buffer, so the parameters are saved. Loading resynchronises the other copy from the one that was
loaded (``resync_after_model_state_loaded``). The ZeRO strategy and hybrid parallelism with ZeRO both go through
these methods.

With ``masters_on_disk`` the masters of the shards whose optimizer state is on disk live in the disk tier's records
too (``disk/optimizer_state.py`` [Note: masters on disk]): the flat buffer holds only the other masters, each on-disk
master is a placeholder between steps, the tier calls back after each record steps so its masters reach the
parameters, and everything else that reads or writes master values (checkpoints, resynchronisation after a load) goes
through the tier one record at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.config import DEFAULT_COLLECTIVE_TIMEOUT, ZeroConfig, bucket_numel
from lightning_colossal.disk.engine_tier import EngineDiskTier
from lightning_colossal.disk.optimizer_state import DiskOptimizerState, is_placeholder, open_disk_state, placeholder
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed import device as devices
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import optimizer_takeover, sharded_state
from lightning_colossal.engine_parts.rows import shard_spec
from lightning_colossal.engine_parts.sharded_state import ShardedMaster
from lightning_colossal.zero.exchange import ParameterExchange, step_overlapping_exchange
from lightning_colossal.zero.reducer import Bucket, GradientReducer, ReducedParameter, ReducerSetup
from lightning_colossal.zero.stages import Stage1Reducer, Stage2Reducer


class ZeroMemoryReport(NamedTuple):
    """Bytes this rank holds, summed from the real tensors."""

    parameter_bytes: int
    gradient_bytes: int
    master_bytes: int
    optimizer_state_bytes: int
    bucket_bytes: int
    num_parameters: int
    disk_bytes: int = 0  # optimizer state the disk tier holds for this rank (not in ``optimizer_state_bytes``)
    disk_staging_bytes: int = 0  # host buffers the disk tier streams that state through during a step

    @classmethod
    def combined(cls, reports: Sequence[ZeroMemoryReport]) -> ZeroMemoryReport:
        """What several engines over one model hold together (one engine per optimizer): the model's parameters
        once, as each report counts all of them, and the sum of everything each engine holds of its own."""
        first = reports[0]
        summed = {field: sum(getattr(report, field) for report in reports) for field in cls._fields}
        return cls(**{**summed, "parameter_bytes": first.parameter_bytes, "num_parameters": first.num_parameters})


class _Publication(NamedTuple):
    """Masters written into their parameters' rows together ([Note: masters to the device in one copy])."""

    members: list[ReducedParameter]  # with rows on this rank and a master in the flat buffer
    masters: list[Tensor]  # theirs, in the same order
    span: tuple[int, int] | None  # the part of the flat master buffer they fill without a gap, if they do


class ReducedGradient(NamedTuple):
    """A reduced gradient this rank holds for the optimizer step: the rows it owns under ZeRO, the whole gradient
    under plain averaging."""

    parameter: nn.Parameter  # the model parameter it belongs to
    gradient: Tensor
    replicated: bool  # every rank of the reduction group holds the same values (counted once in a global norm)


class ZeroEngine(EngineDiskTier, sharded_state.ShardedClipping):
    """Shards the optimizer of ``module`` over the ranks of ``device_mesh`` (a 1-D data-parallel mesh).

    Args:
        module: the model; its trainable parameters that ``optimizer`` holds take part.
        optimizer: the user's optimizer, built on ``module``'s parameters and not stepped yet.
        config: ZeRO settings.
        device_mesh: 1-D mesh of the data-parallel ranks (describes optimizer state shards in checkpoints).
        compute_device: where the model computes.
        describe: how a master (or state shaped like it) is described as a piece of the whole tensor in checkpoints;
            by default a ``Shard(0)`` DTensor on ``device_mesh``. Hybrid parallelism passes one for tensor-parallel
            shards.
        kept_whole: ids of parameters that differ between the ranks of ``device_mesh`` (hybrid's expert slices),
            which the caller reduces: no master, no broadcast, no sharding; the optimizer steps them as they are, and
            their state is saved by name beside the masters' (described by ``describe`` too).
        timeout: collective timeout of the host group the engine votes on (made only over the whole world).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer,
        config: ZeroConfig,
        device_mesh: DeviceMesh,
        compute_device: torch.device,
        describe: Callable[[ShardedMaster, Tensor], Tensor] | None = None,
        kept_whole: frozenset[int] = frozenset(),
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        self.module = module
        self.describe = describe
        self.kept_whole = kept_whole
        self.optimizer = optimizer
        self.config = config
        self.device_mesh = device_mesh
        self.process_group: ProcessGroup = device_mesh.get_group()
        self.world_size = collectives.world_size(self.process_group)
        self.rank = collectives.rank(self.process_group)
        # Which parameters got a gradient on any rank is voted on the host (collectives.py [Note: votes on the host]).
        # Making that group is a collective of the whole world, so only an engine over the whole world makes one
        # (inside hybrid parallelism each data-parallel group's engine votes on its own group).
        spans_world = self.world_size == collectives.world_size(None)
        self.vote_group = (
            collectives.host_group_like(self.process_group, timeout)
            if self.world_size > 1 and spans_world
            else self.process_group
        )
        self.compute_device = compute_device
        self.offload_device = torch.device("cpu") if config.cpu_offload else compute_device
        _validate_optimizer(optimizer, config)
        self.members = self._members(optimizer_takeover.held_parameters(optimizer, module))
        self._broadcast_parameters()
        self.masters_alias_parameters = not config.cpu_offload and all(
            member.parameter.dtype == torch.float32 for member in self.members
        )
        # Decided before the masters exist: masters on disk get no room in the flat buffer.
        disk_groups = self._disk_groups() if config.disk_fraction > 0 else []
        on_disk = {index for group in disk_groups for index in group} if config.masters_on_disk else set()
        self.master_buffer, self.master_gradient_buffer = self._allocate_masters(on_disk)
        #: Whether the masters live on the host apart from the parameters, and reach them through a staging buffer on
        #: the device ([Note: masters to the device in one copy]).
        self._stages_masters = self.master_buffer is not None and config.cpu_offload
        self.masters = []
        #: Where each master in the flat buffer starts, by the id of its parameter (masters on disk have no place).
        self._master_offset: dict[int, int] = {}
        offset = 0
        for index, member in enumerate(self.members):
            if index in on_disk:
                # Its values are written to the tier once it is open; in between steps it stays a placeholder.
                self.masters.append(placeholder(_owned_rows(member.parameter.data, member), torch.float32))
            else:
                self.masters.append(self._master_view(offset, member))
                self._master_offset[id(member.parameter)] = offset
                offset += member.spec.local_numel
        #: Each member by the id of its master.
        self._member_of_master = {id(master): member for member, master in zip(self.members, self.masters, strict=True)}
        #: Each member's master, by the id of its parameter.
        self._master_of = {
            id(member.parameter): master for member, master in zip(self.members, self.masters, strict=True)
        }
        master_of = dict(self._master_of)
        # Parameters kept whole stay in the optimizer as themselves; each rank's state for them is its own.
        held_whole = self._held_whole(optimizer)
        self.whole_entries = [
            ShardedMaster(name, shard_spec(parameter.shape, 1, 0), parameter)
            for name, parameter in module.named_parameters()
            if id(parameter) in held_whole
        ]
        master_of.update({id(entry.master): entry.master for entry in self.whole_entries})
        #: The groups as the user built them, and the parameters they held frozen (which the takeover drops): what
        #: ``give_back_optimizer`` restores when parameters join later ([Note: parameters that join the optimizer]).
        self._user_groups = [list(group["params"]) for group in optimizer.param_groups]
        self._held_frozen = [
            parameter for group in self._user_groups for parameter in group if id(parameter) not in master_of
        ]
        optimizer_takeover.swap_parameters(optimizer, master_of)
        #: The masters by parameter id once the optimizer was given back ([Note: parameters that join the optimizer]).
        self._given_back: dict[int, Tensor] | None = None
        optimizer_takeover.on_group_added(optimizer, self._give_back_before_a_group_joins)
        # See exchange.py [Note: parameter exchange per backend]; for gradients, stages.py's [Note: ZeRO-2 reduction
        # per backend].
        self.use_scatter_gather = collectives.use_scatter_gather(config.communication, self.process_group)
        self.reducer = self._build_reducer()
        #: Whether the host gradient buffer is laid out as ZeRO-2's accumulator, member by member (one copy moves both).
        self._master_gradients_mirror_accumulator = self._mirrors_accumulator()
        #: Separate masters written into the parameters' rows together ([Note: masters to the device in one copy]):
        #: each bucket's after it stepped (the exchange overlapped with the step), and after a whole step.
        self._bucket_publications = {id(bucket): self._publication(bucket.members) for bucket in self.reducer.buckets}
        self._step_publications = self._publications_after_step()
        #: Stage 1's staging room, taken from the reducer's pool for one bucket at a time.
        spans = [publication.span for publication in self._bucket_publications.values() if publication.span is not None]
        self._largest_span = max((end - start for start, end in spans), default=0)
        self.exchange = ParameterExchange(self.reducer, self.process_group, self.use_scatter_gather)
        #: Whether this step's ``step_optimizer`` already exchanged the rows ([Note: exchange overlapped with the step]).
        self._exchanged_in_step = False
        #: The masters given a gradient since the last step ([Note: gradients stay until the step]).
        self._masters_with_gradients: list[Tensor] = []
        self.sharded_masters = [
            ShardedMaster(member.name, member.spec, master)
            for member, master in zip(self.members, self.masters, strict=True)
        ]
        #: The optimizer state (and, with ``masters_on_disk``, the masters) of the leading ``disk_fraction`` of the
        #: masters on disk between steps, or ``None``.
        self.disk_state: DiskOptimizerState | None = self._open_disk_tier(disk_groups) if disk_groups else None

    # ---------------------------------------------------------------------------------------------- set-up
    def _disk_groups(self) -> list[list[int]]:
        """The members (by index) of each disk record: about one gradient bucket of masters each, the first
        ``disk_fraction`` of the elements."""
        limit = self.config.disk_fraction * sum(member.spec.local_numel for member in self.members) * (1 + 1e-9)
        record_numel = bucket_numel(self.config.bucket_size_mb)
        groups: list[list[int]] = []
        counted = 0
        for index, member in enumerate(self.members):
            if counted + member.spec.local_numel > limit:
                break
            counted += member.spec.local_numel
            if not groups or sum(self.members[other].spec.local_numel for other in groups[-1]) >= record_numel:
                groups.append([])
            groups[-1].append(index)
        return groups

    def _open_disk_tier(self, groups: list[list[int]]) -> DiskOptimizerState:
        config = self.config
        assert config.offload_dir is not None
        what = f"the optimizer state of {sum(map(len, groups))} of {len(self.masters)} parameter shards"
        return open_disk_state(
            self.optimizer,
            [[self.masters[index] for index in group] for group in groups],
            config.offload_dir,
            rank=collectives.rank(),
            beside=self.compute_device,
            what=what + (" and their fp32 masters" if config.masters_on_disk else ""),
            initial_masters=self._initial_master if config.masters_on_disk else None,
            after_record=self._record_into_parameters if config.masters_on_disk else None,
        )

    def _initial_master(self, master: Tensor, target: Tensor) -> None:
        """A master's first values (this rank's rows of its parameter), written into its disk record."""
        member = self._member_of_master[id(master)]
        devices.copy_into(target, _owned_rows(member.parameter.data, member))

    def _record_into_parameters(self, masters: Sequence[Tensor]) -> None:
        """After a disk record stepped: its masters into this rank's rows of their parameters."""
        self._into_parameter_rows([(self._member_of_master[id(master)], master) for master in masters])

    def _into_parameter_rows(self, values: list[tuple[ReducedParameter, Tensor]]) -> None:
        """Copy each value into this rank's rows of its member's parameter. Waited for when the parameters are on an
        accelerator: a master on disk is a view of a buffer that the tier reuses as soon as this returns."""
        devices.copy_all([(_owned_rows(member.parameter.data, member), value) for member, value in values])
        if devices.is_accelerator(self.compute_device):
            devices.synchronize(self.compute_device)

    def _members(self, in_optimizer: set[int]) -> list[ReducedParameter]:
        # Frozen parameters in the optimizer get no master, gradient slot or state (optimizer_takeover.py [Note:
        # optimizer takeover]).
        return [
            ReducedParameter(name, parameter, shard_spec(parameter.shape, self.world_size, self.rank))
            for name, parameter in self.module.named_parameters()
            if id(parameter) in in_optimizer and parameter.requires_grad and id(parameter) not in self.kept_whole
        ]

    def _held_whole(self, optimizer: Optimizer) -> set[int]:
        return {
            id(parameter)
            for group in optimizer.param_groups
            for parameter in group["params"]
            if id(parameter) in self.kept_whole and parameter.requires_grad
        }

    def _mirrors_accumulator(self) -> bool:
        if self.master_gradient_buffer is None or not isinstance(self.reducer, Stage2Reducer):
            return False
        offset = 0
        for member in self.members:
            if member.accumulator_offset != offset:
                return False
            offset += member.spec.local_numel
        accumulator = self.reducer.accumulator
        return accumulator.numel() == self.master_gradient_buffer.numel() == offset and accumulator.dtype == (
            self.master_gradient_buffer.dtype
        )

    def _publication(self, members: Sequence[ReducedParameter]) -> _Publication:
        """``members`` with rows on this rank and a master in the flat buffer, and the span of the buffer their masters
        fill without a gap, if they do ([Note: masters to the device in one copy])."""
        chosen = [
            member for member in members if member.spec.local_numel and id(member.parameter) in self._master_offset
        ]
        masters = [self._master_of[id(member.parameter)] for member in chosen]
        placed = sorted((self._master_offset[id(member.parameter)], member.spec.local_numel) for member in chosen)
        if not placed:
            return _Publication(chosen, masters, None)
        start = end = placed[0][0]
        for offset, numel in placed:
            if offset != end:
                return _Publication(chosen, masters, None)  # a gap: each master is copied alone
            end += numel
        return _Publication(chosen, masters, (start, end))

    def _publications_after_step(self) -> list[_Publication]:
        """What a whole step writes into the parameters: every master at once, where no staging is needed (masters
        beside the parameters) or the staging buffer holds them all (stage 2's accumulator); else bucket by bucket."""
        if self.master_buffer is None:
            return []
        if not self._stages_masters or isinstance(self.reducer, Stage2Reducer):
            return [self._publication(self.members)]
        return [self._bucket_publications[id(bucket)] for bucket in self.reducer.buckets]

    def _build_reducer(self) -> GradientReducer:
        """The reducer of the configured stage (the one place the stage is looked at)."""
        config = self.config
        setup = ReducerSetup(
            process_group=self.process_group,
            bucket_numel=bucket_numel(config.bucket_size_mb),
            overlap=config.overlap_communication,
            device=self.compute_device,
            on_finished=self._attach_master_gradients,
        )
        if config.stage == 1:
            return Stage1Reducer(self.members, setup)
        return Stage2Reducer(
            self.members,
            setup,
            accumulate_locally=config.stage2_accumulation == "local",
            use_reduce_scatter=self.use_scatter_gather,
        )

    def _broadcast_parameters(self) -> None:
        # Replicas must start identical, as DDP guarantees at wrap time: frozen weights too (a LoRA base), which no
        # step ever re-synchronises.
        with torch.no_grad(), Activity("broadcasting rank 0's initial parameters"):
            for parameter in self.module.parameters():
                if id(parameter) not in self.kept_whole:  # those differ between the ranks by design
                    collectives.broadcast_tensor(parameter.data, source_rank=0, group=self.process_group)

    def _allocate_masters(self, on_disk: set[int]) -> tuple[Tensor | None, Tensor | None]:
        """The flat buffers of the masters (those not on disk: ``on_disk`` holds member indices) and of their
        gradients (all of them)."""
        if self.masters_alias_parameters:
            return None, None
        total = sum(member.spec.local_numel for member in self.members)
        resident = sum(member.spec.local_numel for index, member in enumerate(self.members) if index not in on_disk)
        if self.offload_device.type == "cpu":
            masters = devices.host_buffer(resident, torch.float32, beside=self.compute_device)
            gradients = devices.host_buffer(total, torch.float32, beside=self.compute_device, zeroed=True)
        else:
            masters = torch.empty(resident, dtype=torch.float32, device=self.offload_device)
            gradients = torch.zeros(total, dtype=torch.float32, device=self.offload_device)
        return masters, gradients

    def _master_view(self, offset: int, member: ReducedParameter) -> Tensor:
        owned = _owned_rows(member.parameter.data, member)
        if self.master_buffer is None:
            return owned
        master = self.master_buffer[offset : offset + member.spec.local_numel].view(member.spec.local_shape)
        master.copy_(owned)
        return master

    # ---------------------------------------------------------------------------------------------- step
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: a non-final micro-batch of gradient accumulation (what it skips depends on stage and mode)."""
        self.reducer.blocked = True
        try:
            yield
        finally:
            self.reducer.blocked = False

    def _attach_master_gradients(self) -> None:
        """After a reduction: point (or copy) each master's ``.grad`` at this rank's reduced gradient rows; masters
        of parameters that no rank gave a gradient get none (sharded_state.py [Note: gradients nobody produced]).

        [Note: gradients stay until the step]
        The reduced gradients accumulate in the engine's own buffers (stage 1's buckets, stage 2's accumulator) over
        every backward pass until the optimizer step, which clears them (``after_step``); the masters' ``.grad`` only
        show them. So ``optimizer.zero_grad()`` between two backward passes of one step (manual optimization) cannot
        drop what the first one reduced: that is refused here, at the next reduction, rather than stepping on
        gradients the user meant to discard. Right after a step, or before the first backward of a step, it is fine.
        """
        if any(master.grad is None for master in self._masters_with_gradients):
            raise RuntimeError(
                "The optimizer's gradients were cleared (`optimizer.zero_grad()`) between two backward passes with no"
                " optimizer step in between. ZeRO keeps the gradients reduced so far in its own buffers until the"
                " step, so it cannot drop them there. Call `zero_grad()` right after `optimizer.step()` (or before the"
                " first backward of a step), and to leave a backward's gradients out of a step, do not run it."
            )
        received = self.reducer.received.on_any_rank(self.vote_group)
        offset = 0
        copies: list[tuple[Tensor, Tensor]] = []
        # Offloaded ZeRO-2: the accumulator and the host gradient buffer share one layout, so one copy moves every
        # member's rows (one kernel, not one per parameter); rows no rank produced are zeros there and get no `.grad`.
        whole = self._master_gradients_mirror_accumulator
        if whole and any(received):
            copies.append((self.master_gradient_buffer, self.reducer.accumulator))  # type: ignore[arg-type,attr-defined]
        for member, master, member_received in zip(self.members, self.masters, received, strict=True):
            if not member_received:
                master.grad = None
                offset += member.spec.local_numel
                continue
            gradient = self.reducer.owned_gradient(member)
            if self.master_gradient_buffer is None:
                master.grad = gradient
            else:
                numel = member.spec.local_numel
                target = self.master_gradient_buffer[offset : offset + numel].view(member.spec.local_shape)
                if not whole:
                    copies.append((target, gradient))
                master.grad = target
                offset += numel
        devices.copy_all(copies)  # waited for: the optimizer reads them on the host
        self._masters_with_gradients = [master for master in self.masters if master.grad is not None]
        replicated = [
            master.grad
            for member, master in zip(self.members, self.masters, strict=True)
            if member.spec.replicated and master.grad is not None
        ]
        if replicated and self._sums_differ_per_slot():
            # [Note: replicated parameters follow rank 0]
            # A zero-dimensional parameter's gradient goes into every rank's slot and each rank keeps its own slot's
            # sum. NCCL's ring reduce-scatter adds each slot up in a different order, so at 3+ ranks those sums can
            # differ in the last bits, and replicas stepped from them would drift apart step after step. Every rank
            # takes rank 0's (one small broadcast); the point-to-point route on gloo adds every slot in rank order.
            with Activity("giving every rank rank 0's gradients of replicated parameters"):
                collectives.broadcast_tensors(replicated, source_rank=0, group=self.process_group)

    def _sums_differ_per_slot(self) -> bool:
        """Whether ranks may hold different bits for the same replicated gradient ([Note: replicated parameters follow
        rank 0]): stage 2 reduce-scattering with the backend's own collective."""
        return (
            isinstance(self.reducer, Stage2Reducer)
            and self.use_scatter_gather
            and not collectives.sends_directly(self.process_group)
        )

    def stepped_parameters(self) -> list[Tensor]:
        """The model parameters the optimizer steps through this engine (their masters, or as they are when kept
        whole)."""
        return [member.parameter for member in self.members] + [entry.master for entry in self.whole_entries]

    def after_backward(self, reduction_deferred: bool) -> None:
        """After the last backward of a step. The gradient hooks reduced during backward, unless it ran inside
        ``no_sync`` (``reduction_deferred``: a pipeline schedule's micro-batches); then reduce now."""
        if reduction_deferred:
            self.reduce_now()

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)``: bucket by bucket with each bucket's exchange started at once when the optimizer
        allows it ([Note: exchange overlapped with the step] in ``exchange.py``), else whole (the exchange then
        follows in ``after_step``); through the disk tier when it holds state."""
        if not self._overlaps_exchange(optimizer, kwargs):
            return super().step_optimizer(optimizer, **kwargs)
        masters_by_bucket = [
            [self._master_of[id(member.parameter)] for member in bucket.members] for bucket in self.reducer.buckets
        ]
        step_overlapping_exchange(
            optimizer, self.exchange, masters_by_bucket, self._masters_into_parameters, self.compute_device
        )
        self._exchanged_in_step = True
        return None

    def _overlaps_exchange(self, optimizer: Optimizer, kwargs: dict[str, Any]) -> bool:
        return (
            self.config.overlap_parameter_exchange
            and self.world_size > 1
            and len(self.reducer.buckets) > 1  # nothing to overlap with one bucket
            and self.disk_state is None  # the disk tier streams the step record by record
            and optimizer is self.optimizer
            and not kwargs  # a closure (or other step arguments) would run once per bucket
            and optimizer_takeover.steps_each_parameter_alone(optimizer)
        )

    def _masters_into_parameters(self, bucket: Bucket) -> None:
        """Separate masters only: write a stepped bucket's masters into this rank's rows of its parameters (masters
        on disk reached them during their record's step)."""
        self._publish(self._bucket_publications[id(bucket)])

    def _publish(self, publication: _Publication) -> None:
        """Write the masters of ``publication`` into this rank's rows of their parameters.

        [Note: masters to the device in one copy]
        Offloaded masters step on the host, and after every step they must reach this rank's rows of the parameters
        on the device. Copied one master at a time, that was one host-to-device transfer launched per parameter tensor
        per step (53 on the 4-block demo GPT; low-precision parameters add a conversion kernel each). Instead the
        masters go over in one copy of their span of the flat master buffer (pinned beside a GPU:
        ``devices.host_buffer``, so the copy is asynchronous) into a flat fp32 buffer on the device laid out the same
        way, and one foreach copy on the device writes (and rounds) them into the rows. A whole step makes one such copy under stage 2; with the
        exchange overlapped with the step ([Note: exchange overlapped with the step] in ``exchange.py``), one per
        bucket, as each bucket's rows must be in place before its exchange starts. Whether a bucket's masters fill
        one span without a gap is decided once, at construction; those that do not are copied one at a time, as is a
        bucket of one parameter (staged, it would take two kernels for one copy).

        The device buffer costs no memory under stage 2: it is the fp32 gradient accumulator, whose rows went to the
        host gradients before the step (``_attach_master_gradients``) and which ``after_step`` zeroes right after.
        Stage 1 has no such buffer on the device and takes one bucket's room from the reducer's pool, bucket by
        bucket. The values are the masters' exactly: each element is copied once, then rounded once to the
        parameter's dtype, as the direct copy did (bit for bit: the offload oracle tests). Separate masters on the
        device (low-precision parameters without offload) need no staging: one foreach copy writes them.
        Loading a checkpoint (``masters_to_parameters``) still copies one master at a time: it must not overwrite
        the accumulator between steps, and it runs once per load, not per step.
        """
        if not publication.members:
            return
        rows = [_owned_rows(member.parameter.data, member) for member in publication.members]
        if not self._stages_masters:
            torch._foreach_copy_(rows, publication.masters)  # beside the parameters: on the device already
            return
        if publication.span is None or len(publication.members) == 1:  # alone, staging would add a kernel
            devices.copy_all(list(zip(rows, publication.masters, strict=True)))
            return
        start, end = publication.span
        # Stage 2: the accumulator, at the masters' own offsets; stage 1: a pooled buffer, from the span's start.
        pooled = not isinstance(self.reducer, Stage2Reducer)
        if isinstance(self.reducer, Stage2Reducer):
            staging, base = self.reducer.accumulator, 0
        else:
            staging, base = self.reducer.acquire(torch.float32, self._largest_span), start
        assert self.master_buffer is not None
        devices.copy_into(staging[start - base : end - base], self.master_buffer[start:end])
        sources = []
        for member in publication.members:
            offset = self._master_offset[id(member.parameter)] - base
            sources.append(staging[offset : offset + member.spec.local_numel].view(member.spec.local_shape))
        torch._foreach_copy_(rows, sources)
        if pooled:
            self.reducer.release(staging)  # reused in stream order: its next copy is queued after this one's reads

    def after_step(self, stepped: bool) -> None:
        """Publish the step's result to every replica (unless ``step_optimizer`` already did), then clear gradients
        for the next step."""
        exchanged, self._exchanged_in_step = self._exchanged_in_step, False
        self._masters_with_gradients = []
        if stepped and not exchanged:
            with torch.no_grad():
                # Masters on disk reached the parameters during their record's step (``_record_into_parameters``).
                for publication in self._step_publications:
                    self._publish(publication)
                self.sync_parameters()
        # Not the host buffer of offloaded master gradients: the next reduction overwrites the rows of every parameter
        # that got a gradient, and the others' masters get no ``.grad`` (a memset of 4 bytes per owned element per step,
        # 4.3 GB on a 1B model at one rank, for nothing).
        self.reducer.zero_gradients()

    def sync_parameters(self) -> None:
        """Give every rank the rows the other ranks own ([Note: parameter exchange per backend] in ``exchange.py``)."""
        self.exchange.all_buckets()

    # ---------------------------------------------------------------------------------------------- clipping
    @property
    def norm_device(self) -> torch.device:
        """Where the global gradient norm is summed (``sharded_state.ShardedClipping``): where the shards are."""
        return self.offload_device

    def reduced_gradients(self) -> list[ReducedGradient]:
        """This rank's reduced gradient rows, for a caller that counts them in a norm over more ranks than this
        engine's (hybrid parallelism: each element once across tensor, pipeline and data parallelism)."""
        return [
            ReducedGradient(member.parameter, entry.master.grad, entry.spec.replicated)
            for entry, member in zip(self.sharded_masters, self.members, strict=True)
            if entry.master.grad is not None
        ]

    # ---------------------------------------------------------------------------------------------- accounting
    def memory_report(self) -> ZeroMemoryReport:
        def nbytes(tensor: Tensor | None) -> int:
            if tensor is None or is_placeholder(tensor):
                return 0  # state on disk: counted in disk_bytes
            return tensor.numel() * tensor.element_size()

        parameters = list(self.module.parameters())
        gradient_bytes = self.reducer.persistent_gradient_bytes() + nbytes(self.master_gradient_buffer)
        # Reusable communication buffers: a few buckets, whatever the model size (stages.py [Note: bounded staging]).
        bucket_bytes = self.reducer.pooled_bytes()
        state_bytes = sum(
            nbytes(value)
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, Tensor)
        )
        return ZeroMemoryReport(
            parameter_bytes=sum(nbytes(parameter) for parameter in parameters),
            gradient_bytes=gradient_bytes,
            master_bytes=nbytes(self.master_buffer),
            optimizer_state_bytes=state_bytes,
            bucket_bytes=bucket_bytes,
            num_parameters=sum(parameter.numel() for parameter in parameters),
            disk_bytes=0 if self.disk_state is None else self.disk_state.planned_bytes,
            disk_staging_bytes=0 if self.disk_state is None else self.disk_state.staging_bytes,
        )

    # ---------------------------------------------------------------------------------------------- checkpoints
    @property
    def checkpoints_hold_masters(self) -> bool:
        """Whether checkpoints hold the fp32 masters rather than the parameters ([Note: masters or parameters in
        checkpoints])."""
        return any(member.parameter.dtype != torch.float32 for member in self.members)

    def with_precise_masters(self, model_state: dict[str, Any], always: bool = False) -> dict[str, Any]:
        """``model_state`` (tensors by parameter name) with the fp32 masters in place of rounded parameters, when
        checkpoints hold masters; with ``always``, also where the masters are rows of the fp32 parameters themselves
        (this rank's part only: what a weight average keeps)."""
        if always or self.checkpoints_hold_masters:
            precise = self.masters_by_name()
            # Only under names the state has: a module whose state_dict renames its parameters gets its masters
            # through the identity below, under its own keys, not the parameter names beside them.
            model_state.update((name, master) for name, master in precise.items() if name in model_state)
            # A tied parameter is in the state under every name that holds it: each name gets the master, so the
            # checkpoint does not keep one weight at two precisions.
            master_of = {
                (member.parameter.data_ptr(), member.parameter.shape): precise[member.name]
                for member in self.members
                if member.parameter.numel() > 0
            }
            for name, value in model_state.items():
                if isinstance(value, Tensor) and not isinstance(value, DTensor) and value.numel() > 0:
                    model_state[name] = master_of.get((value.data_ptr(), value.shape), value)
        return model_state

    def resync_after_model_state_loaded(self) -> None:
        """After a checkpoint filled the tensors ``with_precise_masters`` named: copy what was loaded into the other
        copy of the weights (masters into parameters, or parameters into masters)."""
        if self.checkpoints_hold_masters:
            self.masters_to_parameters()
        else:
            self.parameters_to_masters()
        if self.disk_state is not None:
            self.disk_state.withdraw_master_stand_ins()  # filled by now

    def masters_by_name(self) -> dict[str, Tensor]:
        """fp32 masters as global tensors, by parameter name (only when they are not the parameters themselves).
        Masters on disk enter as the tier's stand-ins, which a checkpoint reads or fills one at a time."""
        return {entry.name: self._described(entry, self._master_value(entry.master)) for entry in self.sharded_masters}

    def _master_value(self, master: Tensor) -> Tensor:
        if self.disk_state is None or not self.disk_state.holds_master(master):
            return master
        return self.disk_state.master_stand_in(master)

    def _on_disk(self, master: Tensor) -> bool:
        """Whether ``master``'s values live in the disk tier ([Note: masters on disk])."""
        return self.disk_state is not None and self.disk_state.holds_master(master)

    def _described(self, entry: ShardedMaster, value: Tensor) -> Tensor:
        if self.describe is not None:
            return self.describe(entry, value)
        return sharded_state.as_global(value, entry.spec, self.device_mesh)

    def masters_to_parameters(self) -> None:
        """After masters were loaded: write them into the parameters and re-synchronise the replicas."""
        with torch.no_grad():
            for member, master in zip(self.members, self.masters, strict=True):
                if not self._on_disk(master):
                    _owned_rows(member.parameter.data, member).copy_(master)
            if self.disk_state is not None:
                self.disk_state.read_masters(
                    lambda master, value: self._into_parameter_rows([(self._member_of_master[id(master)], value)])
                )
            self.sync_parameters()

    def parameters_to_masters(self, full_weights: Mapping[str, Tensor] | None = None) -> None:
        """After the parameters were loaded in full: refresh separate masters from them.

        With ``full_weights`` (the loaded file, by parameter name) masters take their rows from it instead, so fp32
        weights in the file reach fp32 masters unrounded even when the parameters are bf16.
        """
        if self.master_buffer is None:
            return

        def loaded_rows(member: ReducedParameter) -> Tensor:
            source = full_weights.get(member.name) if full_weights is not None else None
            return _owned_rows(source if source is not None else member.parameter.data, member)

        with torch.no_grad():
            for member, master in zip(self.members, self.masters, strict=True):
                if not self._on_disk(master):
                    master.copy_(loaded_rows(member))
            if self.disk_state is not None:
                # One record at a time: the masters on disk are never all in host memory.
                self.disk_state.write_masters(
                    lambda master, target: devices.copy_into(target, loaded_rows(self._member_of_master[id(master)]))
                )

    def optimizer_state_by_name(self) -> dict[str, Any]:
        """The optimizer state keyed by parameter name, shards as DTensors aliasing the live state."""
        self._read_disk_state_for_checkpoint()
        return sharded_state.optimizer_state_by_name(
            self.optimizer, self.sharded_masters + self.whole_entries, self.device_mesh, self.describe
        )

    def load_optimizer_state_by_name(self, loaded: dict[str, Any]) -> None:
        """Apply a name-keyed state: shards DCP already filled in place, or full tensors (plain checkpoints)."""
        self._prepare_disk_state_for_load(loaded)
        sharded_state.load_optimizer_state_by_name(self.optimizer, self.sharded_masters + self.whole_entries, loaded)
        self._write_loaded_state_to_disk()

    def reduce_now(self) -> None:
        """Reduce the gradients accumulated so far, outside of a backward pass (after a pipeline schedule, whose
        micro-batches ran inside ``no_sync``)."""
        self.reducer.flush()

    def remove(self) -> None:
        self.reducer.remove_hooks()
        optimizer_takeover.stop_watching_groups(self.optimizer)

    # ---------------------------------------------------------------------------------------------- joining parameters
    def optimizer_gained_parameters(self) -> bool:
        """Whether parameters joined the optimizer since the engine took it over: a group added
        (``optimizer.add_param_group``, as ``BaseFinetuning`` does) or a parameter it held frozen now trainable.

        [Note: parameters that join the optimizer]
        The engine lays out masters, buckets and hooks for the parameters it takes over, once. A parameter that joins
        later (a backbone unfrozen at some epoch) would otherwise train on each rank's own gradient, or, held frozen
        when the optimizer was taken over, never train at all. So between steps the strategy asks this, and when it
        is true hands the optimizer back (``give_back_optimizer``: the user's groups of parameters and the state keyed
        by them) and builds a new engine over it, which continues from this one's masters (``adopt_masters``): the
        optimizer state and the fp32 masters carry over exactly, as a checkpoint would carry them, and the new
        parameters get their masters and hooks. A group added gives the optimizer back at once (``add_param_group``
        is watched): whoever adds it may read the groups' parameters next, as ``BaseFinetuning`` does by name. It costs one rebuild (a broadcast of the weights) when it happens,
        and nothing per step but this check.
        """
        if self._given_back is not None or len(self.optimizer.param_groups) > len(self._user_groups):
            return True
        return any(parameter.requires_grad for parameter in self._held_frozen)

    def _give_back_before_a_group_joins(self) -> None:
        # Whoever adds a group may read the groups' parameters next (BaseFinetuning names them right away): they must
        # be the user's, not masters. The strategy builds the next engine before the next batch.
        if self._given_back is None:
            self._given_back = self.give_back_optimizer()

    def give_back_optimizer(self) -> dict[int, Tensor]:
        """Stop driving the model and give the optimizer back as the user built it, groups added since included, its
        state keyed by the parameters again ([Note: parameters that join the optimizer]). Returns the masters by
        their parameter's id, for the next engine's ``adopt_masters``."""
        if self._given_back is not None:
            return self._given_back
        if self.disk_state is not None:
            raise ValueError(
                "Parameters joined the optimizer (a param group added, or a frozen parameter made trainable), but the"
                " disk tier holds this engine's optimizer state in records laid out once. Put every parameter in the"
                " optimizer from the start (a frozen stage is a learning rate of 0 for its group), or turn the disk"
                " tier off (disk_fraction=0)."
            )
        self.remove()
        pairs = list(zip(self.members, self.masters, strict=True))
        optimizer_takeover.give_back(
            self.optimizer, self._user_groups, {id(master): member.parameter for member, master in pairs}
        )
        self._given_back = {id(member.parameter): master for member, master in pairs}
        return self._given_back

    def adopt_masters(self, masters: Mapping[int, Tensor]) -> None:
        """Continue from an earlier engine over the same optimizer (``give_back_optimizer``): its optimizer state moves
        to this engine's masters, and its fp32 masters replace the ones this engine made from possibly rounded
        parameters (the same rows: same ranks, same layout)."""
        optimizer_takeover.rekey_state(self.optimizer, self._master_of)
        if self.masters_alias_parameters:
            return  # the parameters hold the exact values
        with torch.no_grad():
            for member, master in zip(self.members, self.masters, strict=True):
                earlier = masters.get(id(member.parameter))
                if earlier is not None and not self._on_disk(master):
                    master.copy_(earlier)
        self.masters_to_parameters()


def _owned_rows(tensor: Tensor, member: ReducedParameter) -> Tensor:
    return sharded_state.owned_rows_of(tensor, member.spec)


def _validate_optimizer(optimizer: Optimizer, config: ZeroConfig) -> None:
    optimizer_takeover.check_optimizer(optimizer, "ZeRO")
    if config.cpu_offload:
        optimizer_takeover.refuse_accelerator_only_options(
            optimizer, cpu_steps="cpu_offload=True steps the optimizer on the CPU", fix=" or turn cpu_offload off"
        )
