"""Gemini: ZeRO-3 with chunks placed across compute-device and CPU memory. No Lightning here.

The engine builds the chunks and is what the strategy talks to. The pieces it composes, each in its own module:

- ``layout.py`` / ``placement.py``: which parameters share a chunk, and where each chunk's pieces live (pure logic);
- ``manager.py`` (``ChunkManager``): the chunks' storage and every collective for it;
- ``initialise.py``: a meta-device model's values, straight into the shards;
- ``hooks.py`` (``ChunkHooks``): the module and gradient hooks, gather rounds and reductions in a fixed order;
- ``eviction.py`` / ``prefetch.py`` / ``tracer.py``: automatic placement's evictions, gathers ahead of use, and
  the warm-up trace both plan against;
- ``checkpoint_state.py``: the chunks by parameter name, for checkpoints and for the end of a run.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer

from lightning_colossal.config import DEFAULT_COLLECTIVE_TIMEOUT, AutoPlacement, GeminiConfig
from lightning_colossal.disk.engine_tier import EngineDiskTier
from lightning_colossal.disk.optimizer_state import (
    DiskOptimizerState,
    open_disk_state,
    record_bytes,
    staging_bytes_for,
)
from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import optimizer_takeover, sharded_state
from lightning_colossal.engine_parts.meta_init import has_meta_tensors
from lightning_colossal.engine_parts.sharded_state import ShardedMaster
from lightning_colossal.gemini import checkpoint_state
from lightning_colossal.gemini.chunk import Chunk, Location
from lightning_colossal.gemini.eviction import Evictor, compute_budget
from lightning_colossal.gemini.hooks import ChunkHooks
from lightning_colossal.gemini.initialise import materialise_chunks
from lightning_colossal.gemini.layout import ChunkSpec, build_layout, check_chunk_numel, search_chunk_numel
from lightning_colossal.gemini.manager import ChunkBytes, ChunkManager
from lightning_colossal.gemini.masters_on_disk import DiskMasters, can_go_to_disk, leave_for_disk
from lightning_colossal.gemini.placement import (
    HostBudgetTooSmall,
    PlacementPlan,
    auto_plan,
    disk_by_host_budget,
    static_plan,
)
from lightning_colossal.gemini.prefetch import Prefetcher
from lightning_colossal.gemini.tracer import MemoryTracer


class GeminiMemoryReport(NamedTuple):
    """Bytes this rank holds for model state, from the real tensors."""

    chunks: ChunkBytes
    peak_working_set_bytes: int  # most gathered chunks + full gradients held at once so far
    evictions: int  # chunks automatic placement moved off the compute device so far
    replicated_bytes: int  # parameters outside chunks, whole on every rank (see ``_split_parameters``)
    num_parameters: int
    chunk_numel: int
    num_chunks: int
    frozen_shard_bytes: int  # this rank's shards of frozen chunks (part of ``chunks.shard``)
    disk_bytes: int = 0  # optimizer state the disk tier holds for this rank (not in ``chunks``)
    disk_staging_bytes: int = 0  # host buffers the disk tier streams that state through during a step


class GeminiEngine(EngineDiskTier, sharded_state.ShardedClipping):
    """Shards ``module``'s parameters in chunks over the ranks of ``device_mesh`` and runs them (frozen ones too:
    layout.py [Note: frozen chunks]).

    Args:
        module: the model (its parameters may live on the meta device: see ``initialise``).
        optimizer: the user's optimizer over ``module``'s parameters, not stepped yet; ``None`` outside fitting.
        config: Gemini settings.
        device_mesh: 1-D mesh of the data-parallel ranks.
        compute_device: where modules run.
        timeout: collective timeout of the engine's own reduction group.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        config: GeminiConfig,
        device_mesh: DeviceMesh,
        compute_device: torch.device,
        timeout: timedelta = DEFAULT_COLLECTIVE_TIMEOUT,
    ) -> None:
        self.module = module
        self.optimizer = optimizer
        self.config = config
        self.device_mesh = device_mesh
        self.process_group: ProcessGroup = device_mesh.get_group()
        self.world_size = collectives.world_size(self.process_group)
        self.rank = collectives.rank(self.process_group)
        self.compute_device = compute_device
        trainable, frozen, self.replicated = _split_parameters(
            module, _held_parameters(optimizer, module), config.shard_frozen_parameters
        )
        chunked = trainable + frozen
        self.names_of = _all_names(module)
        specs = self._lay_out(trainable, frozen)
        self.auto = isinstance(config.placement, AutoPlacement)
        # Gradient reductions get their own group: see manager.py [Note: two groups].
        self.reduce_group = collectives.new_group_like(self.process_group, timeout) if self.world_size > 1 else None
        # The gather rounds' and the gradients' votes: collectives.py [Note: votes on the host].
        self.vote_group = collectives.host_group_like(self.process_group, timeout) if self.world_size > 1 else None
        scatter_gather = collectives.use_scatter_gather(config.communication, self.process_group)
        self.manager = ChunkManager(
            specs,
            _parameters_by_chunk(specs, chunked, self.names_of),
            self._plan(specs, chunked),
            self.process_group,
            compute_device,
            scatter_gather,
            self.reduce_group,
            masters_on_disk=config.masters_on_disk and optimizer is not None,
        )
        self.chunk_of: dict[int, tuple[Chunk, int]] = {
            id(parameter): (chunk, position)
            for chunk in self.manager.chunks
            for position, parameter in enumerate(chunk.parameters)
        }
        self._fill_shards()
        # What the optimizer steps, clipping sees and optimizer checkpoints name: the trainable chunks only.
        self.sharded_masters = [
            ShardedMaster(member.name, member.spec, view)
            for chunk in self.manager.chunks
            if not chunk.frozen
            for member, view in zip(chunk.spec.members, chunk.master_views, strict=True)
        ]
        #: The masters the disk tier holds ([Note: Gemini's masters on disk]; none without ``masters_on_disk``) and the
        #: tier itself (``disk_state``).
        self.disk_masters = DiskMasters([])
        self.disk_state: DiskOptimizerState | None = None
        if optimizer is not None:
            self._take_over(optimizer)
        self.tracer = MemoryTracer(compute_device, self._model_bytes_on_device)
        self.hooks = self._install_hooks()
        # After restore_full_parameters() the parameters own their storage again; the chunks stay readable (for a
        # checkpoint saved after the run) but no longer drive the parameters.
        self.detached = False

    # ---------------------------------------------------------------------------------------------- set-up
    def _take_over(self, optimizer: Optimizer) -> None:
        """The optimizer steps the trainable chunks' masters from now on; the disk tier takes its share."""
        masters = {
            key: chunk.master_views[position] for key, (chunk, position) in self.chunk_of.items() if not chunk.frozen
        }
        optimizer_takeover.swap_parameters(optimizer, masters)
        self.disk_state = self._open_disk_tier(optimizer)

    def attach_optimizer(self, optimizer: Optimizer) -> None:
        """Take over an optimizer made after the chunks (an engine built without one: a Fabric loop's
        ``setup_module`` then ``setup_optimizers``, litgpt's order), over every parameter the chunks hold as
        trainable: what the optimizer given at construction would have held."""
        if self.optimizer is not None:
            raise ValueError("This Gemini engine already took over an optimizer: it shards exactly one.")
        if self.config.masters_on_disk:
            raise ValueError(
                "masters_on_disk=True lays the masters out on disk with the chunks, so the optimizer must come with the"
                " model: set them up in one call (`fabric.setup(model, optimizer)`)."
            )
        held = _held_parameters(optimizer, self.module)
        assert held is not None
        trainable = {key for key, (chunk, _) in self.chunk_of.items() if not chunk.frozen}
        # Frozen parameters in the optimizer are left alone, as at construction (optimizer_takeover.py).
        frozen = {id(parameter) for parameter in self.module.parameters() if not parameter.requires_grad}
        if held - frozen != trainable:
            raise ValueError(
                f"The optimizer holds {len(held - frozen - trainable)} trainable parameter(s) the chunks do not train"
                f" and leaves out {len(trainable - held)} trainable one(s): after the model was set up, Gemini steps"
                " every parameter with requires_grad=True. Build the optimizer over all of them (one param group per"
                " setting; a learning rate of 0 for a group that must not move), or set up the model and optimizer in"
                " one call."
            )
        self.optimizer = optimizer
        self._take_over(optimizer)

    def _lay_out(self, trainable: list[nn.Parameter], frozen: list[nn.Parameter]) -> list[ChunkSpec]:
        """This rank's chunk layout, with the configured chunk size or the searched one: the trainable chunks, then
        the frozen ones (layout.py [Note: frozen chunks]), one capacity for both."""
        config = self.config
        trainable_shapes = [(self.names_of[id(parameter)][0], parameter.shape) for parameter in trainable]
        frozen_shapes = [(self.names_of[id(parameter)][0], parameter.shape) for parameter in frozen]
        if config.chunk_numel is not None:
            # A frozen parameter larger than a chosen size gets a chunk of exactly its size (layout.pack) instead of
            # a refusal: a size that fit the trainable parameters before frozen ones were sharded keeps working.
            check_chunk_numel(config.chunk_numel, trainable_shapes)
            self.chunk_numel = config.chunk_numel
        else:
            numels = [parameter.numel() for parameter in trainable + frozen]
            self.chunk_numel = search_chunk_numel(
                numels, config.min_chunk_numel, config.search_range_numel, config.search_step_numel
            ).chunk_numel
        specs = build_layout(trainable_shapes, self.chunk_numel, self.world_size, self.rank)
        return specs + build_layout(
            frozen_shapes, self.chunk_numel, self.world_size, self.rank, frozen=True, first_index=len(specs)
        )

    def _plan(self, specs: list[ChunkSpec], chunked: list[nn.Parameter]) -> PlacementPlan:
        placement = self.config.placement
        if isinstance(placement, AutoPlacement):
            return auto_plan(len(specs), budgeted=math.isfinite(compute_budget(placement, self.compute_device)))
        element_size = chunked[0].element_size() if chunked else 4
        plan = static_plan([spec.numel * element_size for spec in specs], placement)
        # Optimizer offloading is a share of the optimizer's bytes: frozen chunks have none, so they do not count.
        trainable_bytes = [spec.numel * element_size for spec in specs if not spec.frozen]
        trainable_plan = static_plan(trainable_bytes, placement)
        return plan._replace(
            offload_optimizer=trainable_plan.offload_optimizer, disk_optimizer=trainable_plan.disk_optimizer
        )

    def _open_disk_tier(self, optimizer: Optimizer) -> DiskOptimizerState | None:
        """Put the optimizer state of the chunks the placement sends to disk there: static placement's
        ``disk_fraction``, or what does not fit automatic placement's ``host_memory_budget``; with
        ``masters_on_disk`` their separate masters too ([Note: Gemini's masters on disk])."""
        placement = self.config.placement
        trainable = [chunk for chunk in self.manager.chunks if not chunk.frozen]
        masters_too = [self.config.masters_on_disk and can_go_to_disk(chunk) for chunk in trainable]
        if isinstance(placement, AutoPlacement):
            if placement.host_memory_budget is None:
                return None
            state_bytes = record_bytes(optimizer, [chunk.master_views for chunk in trainable], masters_too)
            # A master that would go to disk is counted in its record's bytes, not beside them.
            host_bytes = [
                _host_bytes_without_state(chunk, master_in_record=moves) + state
                for chunk, state, moves in zip(trainable, state_bytes, masters_too, strict=True)
            ]
            frozen_host = sum(_tensor_bytes(chunk.shard) for chunk in self.manager.chunks if chunk.frozen)
            refusal: HostBudgetTooSmall | None = None
            try:
                on_disk = disk_by_host_budget(
                    [*host_bytes, frozen_host],
                    [*state_bytes, 0],
                    placement.host_memory_budget,
                    has_disk=self.config.offload_dir is not None,
                    staging_bytes=staging_bytes_for,
                )
            except HostBudgetTooSmall as error:
                refusal = error
            self._agree_on_the_host_budget(refusal)
            for chunk, moves in zip(trainable, masters_too, strict=True):
                if moves and chunk.index in on_disk:
                    leave_for_disk(chunk)  # its values are written from its shard below
        else:
            on_disk = self.manager.plan.disk_optimizer
        chosen = [chunk for chunk in trainable if chunk.index in on_disk]
        if not chosen:
            return None
        assert self.config.offload_dir is not None
        with_masters = [chunk.masters_on_disk for chunk in chosen]
        if self.config.masters_on_disk and not any(with_masters) and self.rank == 0:
            warnings.warn(
                "masters_on_disk=True moved no master to disk: every chunk whose optimizer state is on disk is an fp32"
                " shard in host memory, which is its own master (the working weights). It takes effect with bf16/fp16"
                " parameters (precision='bf16-true') or shards on an accelerator.",
                stacklevel=2,
            )
        self.disk_masters = DiskMasters(chosen)
        what = f"the optimizer state of {len(chosen)} of {len(trainable)} chunks"
        if any(with_masters):
            what += f" and {sum(with_masters)} chunks' fp32 masters"
        return open_disk_state(
            optimizer,
            [chunk.master_views for chunk in chosen],
            self.config.offload_dir,
            rank=collectives.rank(),
            beside=self.compute_device,
            what=what,
            initial_masters=self.disk_masters.initial_values if any(with_masters) else None,
            after_record=self.disk_masters.after_record if any(with_masters) else None,
            masters_of_groups=with_masters,
        )

    @property
    def disk_state(self) -> DiskOptimizerState | None:  # type: ignore[override]
        """The optimizer state of some chunks on disk between steps (``lightning_colossal/disk``), or ``None``: kept
        by ``disk_masters``, so closing the tier (``close_disk_tier``) leaves no stale reference there."""
        return self.disk_masters.disk_state

    @disk_state.setter
    def disk_state(self, value: DiskOptimizerState | None) -> None:
        self.disk_masters.disk_state = value

    def _agree_on_the_host_budget(self, refusal: HostBudgetTooSmall | None) -> None:
        """Every rank raises when one rank's share does not fit ``host_memory_budget`` (the ranks' shares differ by a
        few rows, so one rank may fit where another does not): without this the others would go on into the next
        collective and wait there for a rank that has stopped. One small all-reduce."""
        flag = torch.tensor([0 if refusal is None else 1])
        with Activity("agreeing whether every rank's model state fits host_memory_budget"):
            collectives.all_reduce(flag, op="max", group=self.process_group)
        if refusal is not None:
            raise refusal
        if flag.item():
            raise HostBudgetTooSmall(
                "Another rank's model state does not fit host_memory_budget (that rank's error names the bytes; the"
                " ranks hold different shares of the chunks), though this rank's does: raise host_memory_budget or"
                " train on more ranks."
            )

    def _fill_shards(self) -> None:
        if has_meta_tensors(self.module):
            # Every rank runs the same initialisation, window by window, and keeps its rows (initialise.py).
            materialise_chunks(self.module, self.manager, self.compute_device, self.config.init_window_bytes)
            return
        with torch.no_grad(), Activity("broadcasting rank 0's initial weights into the chunks"):
            for chunk in self.manager.chunks:
                for member, parameter in zip(chunk.spec.members, chunk.parameters, strict=True):
                    # Replicas must start identical (as DDP guarantees): rank 0's values win.
                    full = parameter.data.to(self.compute_device, copy=True)
                    collectives.broadcast_tensor(full, source_rank=0, group=self.process_group)
                    rows = sharded_state.owned_rows_of(full, member.spec).reshape(-1)
                    chunk.member_shard(chunk.shard, member).view(-1).copy_(rows)
                self.manager.detach_parameters(chunk)
        self.manager.shards_to_masters()
        with Activity("broadcasting rank 0's replicated parameters and buffers"):
            for tensor in [*self.replicated, *self.module.buffers()]:
                collectives.broadcast_tensor(tensor.data, source_rank=0, group=self.process_group)

    def _install_hooks(self) -> ChunkHooks:
        placement = self.config.placement
        evictor = None
        if isinstance(placement, AutoPlacement):
            evictor = Evictor(self.manager, self.tracer, placement, self.compute_device, self._model_bytes_on_device)
        prefetcher = Prefetcher(self.manager, self.tracer, self.config.max_prefetch)
        return ChunkHooks(
            self.module,
            self.manager,
            self.chunk_of,
            self.process_group,
            self.vote_group,
            self.compute_device,
            self.tracer,
            evictor,
            prefetcher,
        )

    def _model_bytes_on_device(self) -> int:
        return self.manager.compute_bytes(self._optimizer_state())

    def _optimizer_state(self) -> dict[Any, Any] | None:
        return None if self.optimizer is None else self.optimizer.state

    def whole_numel(self, parameter: Tensor) -> int:
        """Elements of ``parameter`` as the model defines it, also while it is an empty placeholder between gathers."""
        if id(parameter) not in self.chunk_of:
            return parameter.numel()  # replicated: whole on every rank
        chunk, position = self.chunk_of[id(parameter)]
        return chunk.spec.members[position].numel

    def remove(self) -> None:
        """Remove every hook (the chunks stay as they are) and let go of the host buffers kept for reuse."""
        self.hooks.remove()
        self.manager.buffers.clear()

    # ---------------------------------------------------------------------------------------------- forward/backward
    def step_context(self) -> AbstractContextManager[None]:
        """Wrap a training step's forward: during the warm-up of automatic placement it traces activations."""
        if not self.auto or self.tracer.finished:
            return nullcontext()
        chunked = {id(parameter) for chunk in self.manager.chunks for parameter in chunk.parameters}
        outside = {
            parameter.untyped_storage().data_ptr()
            for parameter in self.module.parameters()
            if id(parameter) not in chunked
        }

        def model_storages() -> set[int]:
            # Asked at every save of the warm-up forward: a chunk's parameters live in its buffer only while gathered.
            gathered = {
                chunk.full.untyped_storage().data_ptr() for chunk in self.manager.chunks if chunk.full is not None
            }
            return gathered | outside

        return self.tracer.saving_context(model_storages)

    def gather_every_chunk(self) -> None:
        """Make every chunked parameter whole until the next forward releases it (a collective: every rank)."""
        if not self.detached:
            self.hooks.gather_every_chunk()

    def finish_phase(self) -> None:
        """End of a forward (or backward) on this rank: serve the gathers other ranks still need (a collective;
        hooks.py [Note: gathering in rounds])."""
        if self.detached:
            return
        self.hooks.finish_phase()

    def prepare_backward(self, loss: Tensor) -> None:
        """Before ``loss.backward()``: count, per chunk, the parameters this backward will reach.

        A chunk is reduced as soon as its reachable gradients are in, so a parameter without a gradient on this rank
        (a branch whose output this rank did not use) delays nothing, like DDP's ``find_unused_parameters``.
        """
        self.hooks.prepare_backward(loss)

    # ---------------------------------------------------------------------------------------------- step
    def after_step(self, stepped: bool) -> None:
        """Refresh the working shards from the stepped masters, drop gathered (now stale) chunks, zero gradients."""
        self.release_all()
        if stepped:
            self.manager.masters_to_shards()
        self.manager.zero_gradients()
        self.hooks.received.clear()

    def release_all(self) -> None:
        """Release every gathered chunk (between stages; chunks stay valid, only the gathered copies go)."""
        self.manager.release_all()

    @property
    def norm_device(self) -> torch.device:
        """Where the global gradient norm is summed (``sharded_state.ShardedClipping``): where the shards are."""
        return self.compute_device

    # ---------------------------------------------------------------------------------------------- accounting
    @property
    def evictions(self) -> int:
        """Chunks automatic placement moved off the compute device so far."""
        evictor = self.hooks.evictor
        return 0 if evictor is None else evictor.evictions

    def memory_report(self) -> GeminiMemoryReport:
        replicated = sum(parameter.numel() * parameter.element_size() for parameter in self.replicated)
        num_parameters = sum(chunk.spec.numel for chunk in self.manager.chunks) + sum(
            parameter.numel() for parameter in self.replicated
        )
        return GeminiMemoryReport(
            chunks=self.manager.chunk_bytes(self._optimizer_state()),
            peak_working_set_bytes=self.manager.peak_working_set_bytes,
            evictions=self.evictions,
            replicated_bytes=replicated,
            num_parameters=num_parameters,
            chunk_numel=self.chunk_numel,
            num_chunks=len(self.manager.chunks),
            frozen_shard_bytes=sum(_tensor_bytes(chunk.shard) for chunk in self.manager.chunks if chunk.frozen),
            disk_bytes=0 if self.disk_state is None else self.disk_state.planned_bytes,
            disk_staging_bytes=0 if self.disk_state is None else self.disk_state.staging_bytes,
        )

    def memory_by_chunk(self) -> list[ChunkBytes]:
        """``memory_report().chunks`` of each chunk on its own, in chunk order (compute device vs offloaded)."""
        return self.manager.chunk_bytes_by_chunk(self._optimizer_state())

    def placement_summary(self) -> dict[str, list[int]]:
        """Chunk indices by where their pieces live (what the placement policy decided)."""
        chunks = self.manager.chunks
        return {
            "shards_offloaded": [c.index for c in chunks if c.shard_location is Location.OFFLOAD],
            "optimizer_offloaded": [c.index for c in chunks if c.master_location is Location.OFFLOAD],
            "kept_gathered": [c.index for c in chunks if c.keep_gathered],
        }

    # ---------------------------------------------------------------------------------------------- checkpoints
    def state_by_name(self) -> dict[str, Tensor]:
        """Every chunked parameter (all its names, tied ones too) as its fp32 master rows, a dim-0 DTensor.
        Masters on disk enter as the tier's stand-ins, which a checkpoint reads or fills one at a time."""
        return checkpoint_state.state_by_name(self.manager, self.names_of, self.device_mesh, self.disk_masters.value_of)

    def chunked_names(self) -> set[str]:
        """Every name of every chunked parameter (what ``state_by_name`` describes)."""
        return {
            name
            for chunk in self.manager.chunks
            for parameter in chunk.parameters
            for name in self.names_of[id(parameter)]
        }

    def masters_loaded(self) -> None:
        """After masters were filled in place (a sharded checkpoint): refresh the working shards."""
        self.release_all()
        self.manager.masters_to_shards()
        if self.disk_state is not None:
            self.disk_masters.into_shards()

    def load_full_weights(self, weights: Mapping[str, Tensor]) -> list[str]:
        """Take this rank's rows from whole tensors by name; returns the chunked names ``weights`` lacks."""
        missing = checkpoint_state.load_full_weights(self.manager, self.names_of, weights, self.disk_masters)
        self.masters_loaded()
        return missing

    def full_state_dict(self) -> dict[str, Tensor]:
        """Whole weights on every rank (CPU), gathered one chunk at a time; buffers and frozen parameters too."""
        if self.detached:
            return {name: tensor.detach().cpu() for name, tensor in self.module.state_dict().items()}
        return checkpoint_state.full_state_dict(self.manager, self.names_of, self.module)

    def restore_full_parameters(self) -> None:
        """Give every parameter its whole value in its own storage again and remove the hooks (end of a run)."""
        if self.detached:
            return
        self.detached = True
        self.remove()
        # Not destroyed: the next engine in this process reuses it ([Note: one set of process groups per process]).
        self.reduce_group = None
        checkpoint_state.give_parameters_their_values(self.manager)

    def optimizer_state_by_name(self) -> dict[str, Any]:
        assert self.optimizer is not None
        self._read_disk_state_for_checkpoint()
        return sharded_state.optimizer_state_by_name(self.optimizer, self.sharded_masters, self.device_mesh)

    def load_optimizer_state_by_name(self, loaded: dict[str, Any]) -> None:
        assert self.optimizer is not None
        self._prepare_disk_state_for_load(loaded)
        sharded_state.load_optimizer_state_by_name(self.optimizer, self.sharded_masters, loaded)
        self._write_loaded_state_to_disk()


def _held_parameters(optimizer: Optimizer | None, module: nn.Module) -> set[int] | None:
    """The ids of the parameters ``optimizer`` holds, after the takeover checks; ``None`` without an optimizer."""
    if optimizer is None:
        return None
    optimizer_takeover.check_optimizer(optimizer, "Gemini")
    optimizer_takeover.refuse_accelerator_only_options(
        optimizer, cpu_steps="Gemini may step chunks in CPU memory", fix="", fused=False
    )
    return optimizer_takeover.held_parameters(optimizer, module)


def _split_parameters(
    module: nn.Module, in_optimizer: set[int] | None, shard_frozen: bool
) -> tuple[list[nn.Parameter], list[nn.Parameter], list[nn.Parameter]]:
    """Trainable parameters the optimizer holds (all trainable ones without an optimizer), frozen parameters (into
    chunks of their own: layout.py [Note: frozen chunks]; whole on every rank unless ``shard_frozen``), and the rest,
    whole on every rank: trainable parameters the optimizer leaves out get ``.grad`` from autograd as in plain
    PyTorch, which needs them whole."""
    trainable, frozen, replicated = [], [], []
    for parameter in module.parameters():
        if parameter.requires_grad and (in_optimizer is None or id(parameter) in in_optimizer):
            trainable.append(parameter)
        elif not parameter.requires_grad and shard_frozen:
            frozen.append(parameter)
        else:
            replicated.append(parameter)
    return trainable, frozen, replicated


def _tensor_bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _host_bytes_without_state(chunk: Chunk, master_in_record: bool = False) -> int:
    """What a trainable chunk keeps in host memory besides optimizer state under automatic placement: its shard
    (counted there: automatic placement may park any shard on the host), its fp32 master unless the shard is it (or
    ``master_in_record``: the disk record's bytes count it), and its fp32 gradient shard."""
    shard = _tensor_bytes(chunk.shard)
    master = 0 if chunk.masters_alias_shard or master_in_record else chunk.spec.shard_numel * 4
    return shard + master + chunk.spec.shard_numel * 4


def _parameters_by_chunk(
    specs: list[ChunkSpec], chunked: list[nn.Parameter], names_of: Mapping[int, list[str]]
) -> list[list[nn.Parameter]]:
    """Per chunk, the parameter objects of its members, in member order."""
    by_name = {names_of[id(parameter)][0]: parameter for parameter in chunked}
    return [[by_name[member.name] for member in spec.members] for spec in specs]


def _all_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names
