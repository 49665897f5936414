"""Gemini: ZeRO-3 with chunks placed across compute-device and CPU memory. No Lightning here.

The runtime hooks every module that owns chunked parameters:

- before its forward, the module's chunks are gathered (or awaited, if prefetched) and marked COMPUTING; chunks no
  longer in use are released (static placement keeps the ``keep_gathered`` ones until the optimizer step);
- after its forward, a hook on its outputs waits for backward: before the module's backward its chunks are
  gathered again and held (AWAITING_GRADIENTS);
- each parameter's post-accumulate-grad hook copies the gradient into its chunk's fp32 full-gradient buffer and
  frees ``.grad``; once a chunk has every gradient it is reduced and released, in a fixed order (descending chunk
  index) so all ranks issue the same collectives in the same order ([Note: fixed reduction order]).

[Note: fixed reduction order]
Whether a chunk's gradients are complete is a local fact (a parameter may get no gradient on one rank), but
collectives must match across ranks. Chunk ``k`` is reduced only after every chunk above it was, on a group of its
own (manager.py [Note: two groups]); before backward the strategy counts which parameters the loss reaches
(``prepare_backward``), so a chunk is complete when those are in; chunks left at the end of backward are reduced
then, with zeros for missing gradients. So a parameter that gets no gradient neither hangs nor desynchronises.
Gathers are collectives too, and the modules a rank runs may depend on its data (an expert that got no token is
not called): see [Note: gathering in rounds].

[Note: gathering in rounds]
Ranks may run different modules (mixture-of-experts layers skip experts without tokens), so "gather when a module
needs its chunks" alone would pair one rank's gather of chunk 4 with another rank's gather of chunk 5: a size error,
or silently summed rows of different chunks when the sizes agree. Gathers therefore happen in rounds that every rank
enters together. A rank that needs chunks it does not hold (plus its prefetch candidates) enters a round; one small
all-reduce tells every rank which chunks anyone asked for, and every rank then takes part in the gather of each of
them in chunk order: it keeps the chunks it asked for and contributes its rows to the others without keeping them.
A rank that finished a forward or a backward keeps entering empty rounds until no rank asks for anything
(``finish_phase``): the strategy ends every forward step with it, the end of backward starts with it. Ranks that
run the same modules pay one small all-reduce per round. During backward no rank blocks on a gradient reduction
before that final round (a rank waiting on a reduction that another rank can only start after a gather would
deadlock), so reductions in flight are bounded only after it.

[Note: gradients nobody produced]
A parameter a rank did not use contributes zeros to the average. A parameter no rank used has no gradient in
single-process torch (``grad is None``), and optimizers skip it: no weight decay, no momentum, no Adam step count.
Each rank records which parameters received a gradient since the last optimizer step; at the end of backward the
records are combined (one small all-reduce) and masters of parameters nobody gave a gradient get none.

[Note: gradient accumulation]
Each micro-batch's gradients are reduced into the fp32 shard gradient, which sums over micro-batches: accumulation
keeps ZeRO-3 memory and fp32 sums (ColossalAI's Gemini has no accumulation, or halves precision for it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_colossal.config import DEFAULT_COLLECTIVE_TIMEOUT, AutoPlacement, GeminiConfig
from lightning_colossal.distributed import collectives, sharded_state
from lightning_colossal.distributed.autograd_graph import leaves_reached_from
from lightning_colossal.distributed.meta_init import has_meta_tensors
from lightning_colossal.distributed.sharded_state import ShardedMaster
from lightning_colossal.gemini.chunk import Chunk, ChunkState, Location
from lightning_colossal.gemini.initialise import materialise_chunks
from lightning_colossal.gemini.layout import ChunkSpec, build_layout, check_chunk_numel, search_chunk_numel
from lightning_colossal.gemini.manager import ChunkBytes, ChunkManager
from lightning_colossal.gemini.placement import (
    BudgetTooSmall,
    auto_plan,
    choose_evictions,
    next_use_distance,
    static_plan,
)
from lightning_colossal.gemini.tracer import MemoryTracer


class GeminiMemoryReport(NamedTuple):
    """Bytes this rank holds for model state, from the real tensors."""

    chunks: ChunkBytes
    peak_working_set_bytes: int  # most gathered chunks + full gradients held at once so far
    evictions: int  # chunks automatic placement moved off the compute device so far
    replicated_bytes: int  # parameters outside chunks (frozen ones), whole on every rank
    num_parameters: int
    chunk_numel: int
    num_chunks: int


class GeminiEngine:
    """Shards ``module``'s trainable parameters in chunks over the ranks of ``device_mesh`` and runs them.

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
        if optimizer is not None:
            _validate_optimizer(optimizer)
        chunked, self.replicated = self._split_parameters()
        self.names_of = _all_names(module)
        named_shapes = [(self.names_of[id(parameter)][0], parameter.shape) for parameter in chunked]
        numels = [parameter.numel() for parameter in chunked]
        if config.chunk_numel is not None:
            check_chunk_numel(config.chunk_numel, named_shapes)
            self.chunk_numel = config.chunk_numel
        else:
            self.chunk_numel = search_chunk_numel(
                numels, config.min_chunk_numel, config.search_range_numel, config.search_step_numel
            ).chunk_numel
        specs = build_layout(named_shapes, self.chunk_numel, self.world_size, self.rank)
        by_name = {name: parameter for (name, _), parameter in zip(named_shapes, chunked, strict=True)}
        members = [[by_name[member.name] for member in spec.members] for spec in specs]
        element_size = chunked[0].element_size() if chunked else 4
        chunk_bytes = [spec.numel * element_size for spec in specs]
        self.auto = isinstance(config.placement, AutoPlacement)
        plan = auto_plan(len(specs)) if self.auto else static_plan(chunk_bytes, config.placement)  # type: ignore[arg-type]
        if config.communication == "auto":
            use_scatter_gather = collectives.backend(self.process_group) not in ("gloo", "none")
        else:
            use_scatter_gather = config.communication == "scatter_gather"
        # Gradient reductions get their own group: see manager.py [Note: two groups].
        self.reduce_group = collectives.new_group_like(self.process_group, timeout) if self.world_size > 1 else None
        self.manager = ChunkManager(
            specs, members, plan, self.process_group, compute_device, use_scatter_gather, self.reduce_group
        )
        self.chunk_of: dict[int, tuple[Chunk, int]] = {}
        for chunk in self.manager.chunks:
            for position, parameter in enumerate(chunk.parameters):
                self.chunk_of[id(parameter)] = (chunk, position)
        self._fill_shards(specs)
        self.sharded_masters = [
            ShardedMaster(member.name, member.spec, view)
            for chunk in self.manager.chunks
            for member, view in zip(chunk.spec.members, chunk.master_views, strict=True)
        ]
        if optimizer is not None:
            self._replace_optimizer_parameters(optimizer)
        self.tracer = MemoryTracer(compute_device, lambda: self.manager.chunk_bytes(self._optimizer_state()).compute)
        self._module_chunks: dict[int, frozenset[int]] = {}
        self._handles: list[RemovableHandle] = []
        self._install_hooks()
        self._next_to_reduce = len(self.manager.chunks) - 1
        self._backward_callback_queued = False
        self._expect_every_gradient()
        self._prefetched: set[int] = set()
        # [Note: gradients nobody produced]: one flag per chunked parameter, in chunk and member order.
        self._flag_of = {
            id(parameter): position
            for position, parameter in enumerate(p for chunk in self.manager.chunks for p in chunk.parameters)
        }
        self._received = torch.zeros(len(self._flag_of), dtype=torch.float32, device=compute_device)
        self.budget = self._budget()
        # After restore_full_parameters() the parameters own their storage again; the chunks stay readable (for a
        # checkpoint saved after the run) but no longer drive the parameters.
        self.detached = False
        self.evictions = 0

    # ---------------------------------------------------------------------------------------------- set-up
    def _split_parameters(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """Trainable parameters the optimizer holds go into chunks; the others stay whole on every rank."""
        in_optimizer: set[int] | None = None
        if self.optimizer is not None:
            in_optimizer = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        chunked, replicated = [], []
        for parameter in self.module.parameters():
            if parameter.requires_grad and (in_optimizer is None or id(parameter) in in_optimizer):
                chunked.append(parameter)
            else:
                replicated.append(parameter)
        if in_optimizer is not None:
            known = {id(p) for p in self.module.parameters()}
            strangers = len(in_optimizer - known)
            if strangers:
                raise ValueError(
                    f"The optimizer holds {strangers} tensor(s) that are not trainable parameters of the model: build"
                    " it in `configure_optimizers` from `self.parameters()` (or named subsets of them)."
                )
        return chunked, replicated

    def _fill_shards(self, specs: list[ChunkSpec]) -> None:
        if has_meta_tensors(self.module):
            # Every rank runs the same initialisation, window by window, and keeps its rows (initialise.py).
            materialise_chunks(self.module, self.manager, self.compute_device, self.config.init_window_bytes)
        else:
            with torch.no_grad():
                for chunk in self.manager.chunks:
                    for member, parameter in zip(chunk.spec.members, chunk.parameters, strict=True):
                        # Replicas must start identical (as DDP guarantees): rank 0's values win.
                        full = parameter.data.to(self.compute_device, copy=True)
                        collectives.broadcast_tensor(full, source_rank=0, group=self.process_group)
                        rows = sharded_state.owned_rows_of(full, member.spec).reshape(-1)
                        chunk.member_shard(chunk.shard, member).view(-1).copy_(rows)
                    self.manager.detach_parameters(chunk)
            self.manager.shards_to_masters()
            for tensor in [*self.replicated, *self.module.buffers()]:
                collectives.broadcast_tensor(tensor.data, source_rank=0, group=self.process_group)

    def _replace_optimizer_parameters(self, optimizer: Optimizer) -> None:
        for group in optimizer.param_groups:
            views = []
            for parameter in group["params"]:
                if id(parameter) not in self.chunk_of:
                    continue  # frozen: it stays whole outside the chunks and never has a gradient to step
                chunk, position = self.chunk_of[id(parameter)]
                views.append(chunk.master_views[position])
            group["params"] = views
        if optimizer.state:
            raise ValueError(
                "The optimizer already holds state (it was stepped before Gemini took it over): build it fresh in"
                " `configure_optimizers`, and resume state through `ckpt_path`."
            )

    def _budget(self) -> float:
        if not self.auto:
            return math.inf
        placement = self.config.placement
        assert isinstance(placement, AutoPlacement)
        if placement.compute_memory_budget is not None:
            return float(placement.compute_memory_budget)
        if self.compute_device.type == "cuda":
            return float(torch.cuda.get_device_properties(self.compute_device).total_memory)
        return math.inf

    def _install_hooks(self) -> None:
        for module_id, module in enumerate(self.module.modules()):
            chunks = frozenset(
                self.chunk_of[id(parameter)][0].index
                for parameter in module.parameters(recurse=False)
                if id(parameter) in self.chunk_of
            )
            if not chunks:
                continue
            self._module_chunks[module_id] = chunks
            self._handles.append(module.register_forward_pre_hook(self._forward_pre_hook(module_id)))
            self._handles.append(module.register_forward_hook(self._forward_hook(module_id)))
        for chunk in self.manager.chunks:
            for parameter in chunk.parameters:
                if parameter.requires_grad:
                    self._handles.append(parameter.register_post_accumulate_grad_hook(self._on_gradient))

    def whole_numel(self, parameter: Tensor) -> int:
        """Elements of ``parameter`` as the model defines it, also while it is an empty placeholder between gathers."""
        if id(parameter) not in self.chunk_of:
            return parameter.numel()  # frozen or replicated: whole on every rank
        chunk, position = self.chunk_of[id(parameter)]
        return chunk.spec.members[position].numel

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------------------------------------- forward
    def step_context(self) -> AbstractContextManager[None]:
        """Wrap a training step's forward: during the warm-up of automatic placement it traces activations."""
        if not self.auto or self.tracer.finished:
            return nullcontext()
        pointers = {parameter.data_ptr() for parameter in self.module.parameters()}
        return self.tracer.saving_context(pointers)

    # [Note: hooks under torch.compile]
    # The hooks gather chunks and swap each parameter's ``.data`` between an empty placeholder and its gathered view.
    # Traced by dynamo, that swap becomes a ``set_`` on a graph input, which AOTAutograd cannot keep in the graph and
    # inductor then compiles against the placeholder's shape (a 1-D empty tensor). Run eagerly instead: a compiled
    # model breaks its graph at each hooked module and its compiled pieces see the gathered parameters, as eager does.
    def _forward_pre_hook(self, module_id: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._before_forward(module_id)

        return torch.compiler.disable(hook)

    def _forward_hook(self, module_id: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._after_forward(module_id, output)

        return torch.compiler.disable(hook)

    def _before_forward(self, module_id: int) -> None:
        needed = self._module_chunks[module_id]
        position = self._trace("forward", module_id, needed)
        for chunk in self.manager.chunks:
            if chunk.state is ChunkState.GATHERED and chunk.index not in needed and not chunk.keep_gathered:
                self.manager.release(chunk)
        self._make_room(needed, position)
        self._gather_missing(needed, position)
        for index in sorted(needed):
            chunk = self.manager.chunks[index]
            self._gather(chunk)  # only waits: the round above issued every gather this module needs
            chunk.users += 1
            if chunk.state is ChunkState.GATHERED:
                chunk.move(ChunkState.COMPUTING)

    def _after_forward(self, module_id: int, output: Any) -> None:
        for index in self._module_chunks[module_id]:
            chunk = self.manager.chunks[index]
            chunk.users -= 1
            if chunk.users == 0 and chunk.state is ChunkState.COMPUTING:
                chunk.move(ChunkState.GATHERED)
        self.tracer.forward_ended(module_id)
        if not torch.is_grad_enabled():
            return
        tensors = [tensor for tensor in _tensors_in(output) if tensor.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _: self._before_backward(module_id), mode="any"
            )

    def _gather(self, chunk: Chunk, asynchronous: bool = False) -> None:
        if chunk.shard_location is Location.OFFLOAD and chunk.index not in self.manager.plan.offload_parameters:
            # Automatic placement evicted it earlier: its shard comes back with it.
            self.manager.move_shard(chunk, Location.COMPUTE)
        self.manager.gather(chunk, asynchronous=asynchronous)
        if not asynchronous:
            self._prefetched.discard(chunk.index)

    def _gather_missing(self, needed: Iterable[int], position: int) -> None:
        """Gather, in a round with every rank, the chunks of ``needed`` this rank does not hold (and prefetch)."""
        missing = {index for index in needed if self.manager.chunks[index].state is ChunkState.SHARDED}
        if not missing:
            return
        prefetch = self._prefetch_candidates(position) - missing
        self._prefetched |= prefetch
        self._gather_round(missing | prefetch, asynchronous=prefetch)

    def _gather_round(self, requested: set[int], asynchronous: set[int] | None = None) -> bool:
        """One round of [Note: gathering in rounds]; returns whether any rank asked for a chunk."""
        chunks = self.manager.chunks
        if self.world_size == 1:
            union = sorted(requested)
            anyone_asked = bool(requested)
        else:
            flags = torch.zeros(len(chunks) + 1, dtype=torch.float32, device=self.compute_device)
            if requested:
                flags[sorted(requested)] = 1.0
                flags[-1] = 1.0
            collectives.all_reduce(flags, op="max", group=self.process_group)
            asked = flags.bool().tolist()
            union = [index for index in range(len(chunks)) if asked[index]]
            anyone_asked = asked[-1]
        for index in union:
            chunk = chunks[index]
            if index in requested and chunk.state is ChunkState.SHARDED:
                self._gather(chunk, asynchronous=asynchronous is not None and index in asynchronous)
            else:
                self.manager.contribute_to_gather(chunk)
        return anyone_asked

    def finish_phase(self) -> None:
        """End of a forward (or backward) on this rank: serve the gathers other ranks still need (a collective)."""
        if self.world_size == 1 or self.detached:
            return
        while self._gather_round(set()):
            pass

    # ---------------------------------------------------------------------------------------------- backward
    def _before_backward(self, module_id: int) -> None:
        self._queue_end_of_backward()
        needed = self._module_chunks[module_id]
        position = self._trace("backward", module_id, needed)
        self._make_room(needed, position)
        # Chunks reduced already (their gradients were complete): nothing here needs their weights again.
        needed = frozenset(index for index in needed if not self.manager.chunks[index].reduced_this_backward)
        self._gather_missing(needed, position)
        for index in sorted(needed):
            chunk = self.manager.chunks[index]
            self._gather(chunk)
            if chunk.state is ChunkState.GATHERED:
                chunk.move(ChunkState.AWAITING_GRADIENTS)

    def _expect_every_gradient(self) -> None:
        """Without ``prepare_backward``, a chunk waits for every trainable parameter it holds."""
        for chunk in self.manager.chunks:
            chunk.gradients_expected = sum(1 for parameter in chunk.parameters if parameter.requires_grad)

    def _queue_end_of_backward(self) -> None:
        if not self._backward_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._backward_callback_queued = True

    def prepare_backward(self, loss: Tensor) -> None:
        """Before ``loss.backward()``: count, per chunk, the parameters this backward will reach.

        A chunk is reduced as soon as its reachable gradients are in, so a parameter without a gradient on this rank
        (a branch whose output this rank did not use) delays nothing, like DDP's ``find_unused_parameters``.
        """
        reached = leaves_reached_from(loss)
        for chunk in self.manager.chunks:
            chunk.gradients_expected = sum(1 for parameter in chunk.parameters if id(parameter) in reached)

    def _on_gradient(self, parameter: Tensor) -> None:
        chunk, position = self.chunk_of[id(parameter)]
        member = chunk.spec.members[position]
        full_gradient = chunk.full_gradient
        if full_gradient is None:
            full_gradient = self.manager.allocate_full_gradient(chunk)
        assert parameter.grad is not None
        chunk.member_full(full_gradient, member).add_(parameter.grad)
        parameter.grad = None
        self._received[self._flag_of[id(parameter)]] = 1.0
        chunk.gradients_arrived += 1
        self._queue_end_of_backward()
        self._reduce_in_order(force=False)

    def _reduce_in_order(self, force: bool) -> None:
        # See [Note: fixed reduction order].
        while self._next_to_reduce >= 0:
            chunk = self.manager.chunks[self._next_to_reduce]
            if not force and chunk.gradients_arrived < chunk.gradients_expected:
                return
            # Unbounded while other ranks may still need a gather round ([Note: gathering in rounds]).
            self.manager.reduce(chunk, bound_in_flight=force)
            chunk.reduced_this_backward = True
            if chunk.state is ChunkState.AWAITING_GRADIENTS:
                chunk.move(ChunkState.GATHERED)
                if not chunk.keep_gathered:
                    self.manager.release(chunk)
            self._next_to_reduce -= 1

    def _end_of_backward(self) -> None:
        self.finish_phase()
        self._reduce_in_order(force=True)
        self.manager.complete_reductions(block=True)
        for chunk in self.manager.chunks:
            chunk.reduced_this_backward = False
            if chunk.state is ChunkState.GATHERING:
                self.manager.wait(chunk)
            if chunk.state is ChunkState.AWAITING_GRADIENTS:
                chunk.move(ChunkState.GATHERED)
        self._next_to_reduce = len(self.manager.chunks) - 1
        self._backward_callback_queued = False
        self._expect_every_gradient()
        received_anywhere = self._received.clone()
        collectives.all_reduce(received_anywhere, op="max", group=self.process_group)
        received = received_anywhere.bool().tolist()
        self.manager.attach_master_gradients(
            lambda parameter: received[self._flag_of[id(parameter)]]  # [Note: gradients nobody produced]
        )
        self.tracer.finish()

    # ---------------------------------------------------------------------------------------------- placement
    def _trace(self, phase: str, module_id: int, needed: frozenset[int]) -> int:
        if not self.tracer.finished:
            self.tracer.record(phase, module_id, needed)
            return len(self.tracer.ops) - 1
        return self.tracer.advance(phase, module_id)

    def _make_room(self, needed: frozenset[int], position: int) -> None:
        """Automatic placement: move chunks off the compute device until this module's chunks fit the budget."""
        if not self.auto or math.isinf(self.budget):
            return
        placement = self.config.placement
        assert isinstance(placement, AutoPlacement)
        chunks = self.manager.chunks
        full_bytes = {chunk.index: chunk.spec.numel * chunk.shard.element_size() for chunk in chunks}
        needed_bytes = 0
        for index in needed:
            chunk = chunks[index]
            if not chunk.is_gathered and chunk.state is not ChunkState.GATHERING:
                needed_bytes += full_bytes[index]
                if chunk.shard_location is Location.OFFLOAD:
                    needed_bytes += chunk.shard.numel() * chunk.shard.element_size()
        evictable: dict[int, int] = {}
        for chunk in chunks:
            if chunk.index in needed or chunk.state not in (ChunkState.SHARDED, ChunkState.GATHERED):
                continue
            freed = full_bytes[chunk.index] if chunk.state is ChunkState.GATHERED else 0
            if chunk.shard_location is Location.COMPUTE and chunk.index not in self.manager.plan.offload_parameters:
                freed += chunk.shard.numel() * chunk.shard.element_size()
            if freed:
                evictable[chunk.index] = freed
        resident = self.manager.chunk_bytes(self._optimizer_state()).compute
        if self.tracer.finished:
            budget = int(self.budget * placement.steady_compute_cap_ratio)
            non_model = self.tracer.expected_non_model_bytes(position)
            sequence = self.tracer.sequence
            next_use = {index: next_use_distance(sequence, position, index) for index in evictable}
        else:
            budget = int(self.budget)
            non_model = int(self.budget * placement.warmup_non_model_data_ratio)
            next_use = {}
        try:
            victims = choose_evictions(evictable, needed_bytes, resident, non_model, budget, next_use)
        except BudgetTooSmall as error:
            if not self.tracer.finished:
                # Warm-up works from a guess of activation memory; evict all it can and learn the real figure.
                victims = list(evictable)
            else:
                raise BudgetTooSmall(
                    f"{error} (AutoPlacement(compute_memory_budget={placement.compute_memory_budget}) times"
                    f" steady_compute_cap_ratio={placement.steady_compute_cap_ratio} leaves {budget} bytes usable.)"
                ) from None
        self.evictions += len(victims)
        for index in victims:
            chunk = chunks[index]
            if chunk.state is ChunkState.GATHERED:
                self.manager.release(chunk)
            self.manager.move_shard(chunk, Location.OFFLOAD)

    def _prefetch_candidates(self, position: int) -> set[int]:
        """Chunks of the next ops (in the traced order) to gather without waiting for them, within max_prefetch."""
        candidates: set[int] = set()
        if self.config.max_prefetch == 0 or not self.tracer.finished:
            return candidates
        sequence = self.tracer.sequence
        # Prefetched chunks not yet used count against the limit: the working set stays max_prefetch chunks ahead.
        self._prefetched = {
            index
            for index in self._prefetched
            if self.manager.chunks[index].is_gathered or self.manager.chunks[index].state is ChunkState.GATHERING
        }
        started = len(self._prefetched)
        for distance in range(1, len(sequence)):
            for index in sorted(sequence[(position + distance) % len(sequence)]):
                if started >= self.config.max_prefetch:
                    return candidates
                chunk = self.manager.chunks[index]
                if (
                    chunk.state is ChunkState.SHARDED
                    and chunk.shard_location is Location.COMPUTE
                    and index not in candidates
                ):
                    candidates.add(index)
                    started += 1
        return candidates

    # ---------------------------------------------------------------------------------------------- step
    def after_step(self, stepped: bool) -> None:
        """Refresh the working shards from the stepped masters, drop gathered (now stale) chunks, zero gradients."""
        self.release_all()
        if stepped:
            self.manager.masters_to_shards()
        self.manager.zero_gradients()
        self._received.zero_()

    def release_all(self) -> None:
        """Release every gathered chunk (between stages; chunks stay valid, only the gathered copies go)."""
        for chunk in self.manager.chunks:
            if chunk.state is ChunkState.GATHERING:
                self.manager.wait(chunk)
            if chunk.state in (ChunkState.GATHERED, ChunkState.AWAITING_GRADIENTS):
                if chunk.state is ChunkState.AWAITING_GRADIENTS:
                    chunk.move(ChunkState.GATHERED)
                self.manager.release(chunk)

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip all gradient shards by their global L2 norm (one scalar all-reduce); returns the norm."""
        return sharded_state.clip_by_global_norm(
            self.sharded_masters, max_norm, self.process_group, self.rank, self.compute_device
        )

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        sharded_state.clip_by_value(self.sharded_masters, clip_value)

    def _optimizer_state(self) -> dict[Any, Any] | None:
        return None if self.optimizer is None else self.optimizer.state

    # ---------------------------------------------------------------------------------------------- accounting
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
        """Every chunked parameter (all its names, tied ones too) as its fp32 master rows, a dim-0 DTensor."""
        state: dict[str, Tensor] = {}
        for chunk in self.manager.chunks:
            for member, parameter, view in zip(chunk.spec.members, chunk.parameters, chunk.master_views, strict=True):
                shard = sharded_state.as_global(view, member.spec, self.device_mesh)
                for name in self.names_of[id(parameter)]:
                    state[name] = shard
        return state

    def masters_loaded(self) -> None:
        """After masters were filled in place (a sharded checkpoint): refresh the working shards."""
        self.release_all()
        self.manager.masters_to_shards()

    def load_full_weights(self, weights: Mapping[str, Tensor]) -> list[str]:
        """Take this rank's rows from whole tensors by name; returns the chunked names ``weights`` lacks."""
        self.release_all()
        missing = []
        with torch.no_grad():
            for chunk in self.manager.chunks:
                for member, parameter, view in zip(
                    chunk.spec.members, chunk.parameters, chunk.master_views, strict=True
                ):
                    source = next((weights[n] for n in self.names_of[id(parameter)] if n in weights), None)
                    if source is None:
                        missing.append(member.name)
                        continue
                    view.copy_(sharded_state.owned_rows_of(source, member.spec))
        self.manager.masters_to_shards()
        return missing

    def full_state_dict(self) -> dict[str, Tensor]:
        """Whole weights on every rank (CPU), gathered one chunk at a time; buffers and frozen parameters too."""
        if self.detached:
            return {name: tensor.detach().cpu() for name, tensor in self.module.state_dict().items()}
        self.release_all()
        state: dict[str, Tensor] = {}
        for chunk in self.manager.chunks:
            self.manager.gather(chunk)
            for parameter in chunk.parameters:
                for name in self.names_of[id(parameter)]:
                    state[name] = parameter.detach().to("cpu", copy=True)
            self.manager.release(chunk)
        for name, tensor in self.module.state_dict().items():
            if name not in state:
                state[name] = tensor.detach().cpu()
        return state

    def restore_full_parameters(self) -> None:
        """Give every parameter its whole value in its own storage again and remove the hooks (end of a run)."""
        if self.detached:
            return
        self.detached = True
        self.remove()
        collectives.destroy_group(self.reduce_group)
        self.reduce_group = None
        self.release_all()
        for chunk in self.manager.chunks:
            self.manager.gather(chunk)
            for parameter in chunk.parameters:
                parameter.data = parameter.data.clone()
            chunk.full = None
            chunk.state = ChunkState.SHARDED  # the parameters no longer point into chunk storage

    def optimizer_state_by_name(self) -> dict[str, Any]:
        assert self.optimizer is not None
        return sharded_state.optimizer_state_by_name(self.optimizer, self.sharded_masters, self.device_mesh)

    def load_optimizer_state_by_name(self, loaded: dict[str, Any]) -> None:
        assert self.optimizer is not None
        sharded_state.load_optimizer_state_by_name(self.optimizer, self.sharded_masters, loaded)


def _all_names(module: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def _tensors_in(output: Any) -> Iterator[Tensor]:
    if isinstance(output, Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for item in output:
            yield from _tensors_in(item)
    elif isinstance(output, Mapping):
        for item in output.values():
            yield from _tensors_in(item)
    elif hasattr(output, "__dataclass_fields__") or hasattr(output, "to_tuple"):
        # Hugging Face ModelOutput and dataclasses
        values = output.to_tuple() if hasattr(output, "to_tuple") else vars(output).values()
        for item in values:
            yield from _tensors_in(item)


def _validate_optimizer(optimizer: Optimizer) -> None:
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"Gemini shards a torch.optim.Optimizer; got {type(optimizer).__name__}.")
    name = type(optimizer).__name__
    if name in ("LBFGS",):
        raise ValueError(
            f"{name} needs whole parameters and re-evaluates the loss: it cannot be stepped per chunk shard. Use an"
            " elementwise optimizer (Adam, AdamW, SGD, ...) or `colossal_ddp`."
        )
    for group in optimizer.param_groups:
        if group.get("capturable"):
            raise ValueError(
                f"{name}(capturable=True) steps only on an accelerator, but Gemini may step chunks in CPU memory:"
                " drop capturable=True."
            )
