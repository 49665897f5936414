"""Gemini's run time: the hooks on every module that owns chunked parameters, and the collectives they drive.

- before a module's forward, its chunks are gathered (or awaited, if prefetched) and marked COMPUTING; chunks no
  longer in use are released (static placement keeps the ``keep_gathered`` ones until the optimizer step);
- after its forward, a hook on its outputs waits for backward: before the module's backward its chunks are
  gathered again and held (AWAITING_GRADIENTS), frozen chunks only until the next module's backward ([Note: frozen
  chunks in backward]);
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

[Note: reductions launched at agreed points]
The two groups keep their own sequences identical on every rank, but NCCL also asks that communicators which can
block each other see their operations in one order across ranks: each is a kernel that spins until its peers join, and
a rank whose reduction kernel waits while its peer's gather kernel waits behind a device-wide synchronisation (the
caching allocator freeing memory, one hardware queue under CUDA_DEVICE_MAX_CONNECTIONS=1) hangs both. Ranks reach a
complete chunk at different moments whenever their gradients differ (experts without tokens), so on a route where
the groups are such communicators (everything but gloo's point-to-point exchanges, which progress each group on its
own threads) a complete chunk is not reduced at once: each gather round's all-reduce also carries how many chunks,
in the fixed order, each rank has complete, and every rank then launches the smallest of those counts, between the
round's agreement and its gathers. The end of backward launches the rest. Every rank therefore issues the same
sequence over both groups; a rank ahead of the others holds its complete chunks' full gradients until the slowest
catches up (on ranks that run the same modules, that is never).

[Note: the end of a forward]
Only Gemini's own code enters gather rounds, so a rank that has finished its forward must keep serving rounds until
every rank has: a rank that went on to another collective first (``self.log(..., sync_dist=True)`` in the training
step, an ``all_gather`` in the loss) would wait there for a rank that waits in a round for it. Ranks differ in their
rounds whenever their chunks differ: experts without tokens, and also automatic placement and prefetch, whose
decisions follow this rank's bytes (shards and optimizer state differ by a few rows between ranks, enough to cross
the budget on one rank only). So the forward of every module with chunks below it is bracketed, and when the
outermost one returns (the model user code called) the rank runs ``finish_phase`` there. A recomputation inside
backward is not bracketed (``manager.inside_backward``): backward ends with its own ``finish_phase``.

[Note: gradient accumulation]
Each micro-batch's gradients are reduced into the fp32 shard gradient, which sums over micro-batches: accumulation
keeps ZeRO-3 memory and fp32 sums (ColossalAI's Gemini has no accumulation, or halves precision for it).

Parameters no rank produced a gradient for are not stepped: ``engine_parts/sharded_state.py`` [Note: gradients nobody
produced].

[Note: activation checkpointing]
A checkpointed region (``torch.utils.checkpoint``, Hugging Face's ``gradient_checkpointing_enable``) runs its
modules' forwards again inside backward. Such a recomputation is not a forward step: its chunks are gathered and held
for the backward that follows (AWAITING_GRADIENTS, as ``_before_backward`` does), and it counts no users, because a
non-reentrant recomputation stops as soon as it has the tensors it needed, without the forward hook that would undo
the count. A reentrant checkpoint also runs a backward of its own inside ours, so the end of backward is queued from
the loss's node (``_queue_end_of_backward_from``), and the parameters inside are read from the checkpoint's function
(``engine_parts/autograd_graph.py``).

[Note: frozen chunks in backward]
A frozen chunk (layout.py [Note: frozen chunks]) is needed in backward only for the input gradients of the modules
using it, and no gradient of its own tells when that is done. It is gathered before such a module's backward like any
chunk but stays GATHERED, and the next module's backward that does not need it releases it (as the next forward does
in forward). That is safe because autograd runs ready nodes latest-created first: once a module's output node runs,
every node created inside that module's forward is later than anything still waiting and earlier than nothing that
can still become ready, so the module's whole backward has run before another module's hook fires. Frozen chunks
never enter the reduction order and nothing is counted for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import sharded_state
from lightning_colossal.engine_parts.autograd_graph import leaves_reached_from
from lightning_colossal.gemini.chunk import Chunk, ChunkState, Location
from lightning_colossal.gemini.eviction import Evictor
from lightning_colossal.gemini.manager import ChunkManager, describe_chunk, inside_backward
from lightning_colossal.gemini.prefetch import Prefetcher
from lightning_colossal.gemini.tracer import MemoryTracer

MAX_CHUNKS_NAMED = 3  # in a hang report's label for a gather round; the rest are counted


class ChunkHooks:
    """Installs the hooks on ``module`` and runs what they trigger: gather rounds, reductions, eviction, prefetch.

    Args:
        module: the model whose modules own chunked parameters.
        manager: every chunk of this rank.
        chunk_of: ``id(parameter)`` to its chunk and member position, for every chunked parameter.
        process_group: the data-parallel ranks (gather rounds).
        vote_group: the same ranks on the host, for the rounds' and the gradients' votes (``None`` at one rank;
            collectives.py [Note: votes on the host]).
        compute_device: where modules run.
        tracer: the warm-up trace (automatic placement and prefetch plan against it).
        evictor: automatic placement's evictions; ``None`` under static placement.
        prefetcher: which chunks to gather ahead of use.
    """

    def __init__(
        self,
        module: nn.Module,
        manager: ChunkManager,
        chunk_of: Mapping[int, tuple[Chunk, int]],
        process_group: ProcessGroup,
        vote_group: ProcessGroup | None,
        compute_device: torch.device,
        tracer: MemoryTracer,
        evictor: Evictor | None,
        prefetcher: Prefetcher,
    ) -> None:
        self.manager = manager
        self.chunk_of = chunk_of
        self.process_group = process_group
        self.vote_group = vote_group if vote_group is not None else process_group
        self.world_size = collectives.world_size(process_group)
        self.compute_device = compute_device
        self.tracer = tracer
        self.evictor = evictor
        self.prefetcher = prefetcher
        # Chunks gathered for a module's forward, and for its backward ([Note: weights read by the parent]).
        self._module_chunks: dict[int, frozenset[int]] = {}
        self._backward_chunks: dict[int, frozenset[int]] = {}
        # Modules with chunks below them whose forward is running ([Note: the end of a forward]).
        self._forward_depth = 0
        self._handles: list[RemovableHandle] = []
        self._install(module)
        self._next_to_reduce = len(manager.chunks) - 1
        self._backward_callback_queued = False
        self._expect_every_gradient()
        # sharded_state.py [Note: gradients nobody produced]: one flag per chunked parameter, in chunk and member order.
        self._flag_of = {
            id(parameter): position
            for position, parameter in enumerate(p for chunk in manager.chunks for p in chunk.parameters)
        }
        self.received = sharded_state.GradientArrivals(len(self._flag_of))
        # [Note: reductions launched at agreed points]
        self.reductions_wait_for_rounds = self.world_size > 1 and not collectives.sends_directly(process_group)

    def _install(self, module: nn.Module) -> None:
        for module_id, submodule in enumerate(module.modules()):
            chunks = self._chunks_holding(_parameters_its_forward_may_read(submodule))
            if chunks:  # its hooks also bracket its forward ([Note: the end of a forward])
                self._module_chunks[module_id] = chunks
                self._backward_chunks[module_id] = self._chunks_holding(submodule.parameters(recurse=False))
                self._handles.append(submodule.register_forward_pre_hook(self._forward_pre_hook(module_id)))
                self._handles.append(submodule.register_forward_hook(self._forward_hook(module_id)))
            elif any(id(parameter) in self.chunk_of for parameter in submodule.parameters()):
                # A container with chunks below it: it may be the model user code calls.
                self._handles.append(submodule.register_forward_pre_hook(self._enter_forward))
                self._handles.append(submodule.register_forward_hook(self._leave_forward))
        for chunk in self.manager.chunks:
            for parameter in chunk.parameters:
                if parameter.requires_grad:
                    self._handles.append(parameter.register_post_accumulate_grad_hook(self._on_gradient))

    def _chunks_holding(self, parameters: Iterable[nn.Parameter]) -> frozenset[int]:
        """Indices of the chunks that hold any of ``parameters`` (parameters outside chunks are skipped)."""
        return frozenset(
            self.chunk_of[id(parameter)][0].index for parameter in parameters if id(parameter) in self.chunk_of
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ---------------------------------------------------------------------------------------------- forward
    # [Note: hooks under torch.compile]
    # The hooks gather chunks and swap each parameter's ``.data`` between an empty placeholder and its gathered view.
    # Traced by dynamo, that swap becomes a ``set_`` on a graph input, which AOTAutograd cannot keep in the graph and
    # inductor then compiles against the placeholder's shape (a 1-D empty tensor). Run eagerly instead: a compiled
    # model breaks its graph at each hooked module and its compiled pieces see the gathered parameters, as eager does.
    def _forward_pre_hook(self, module_id: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self._enter_forward(module, args)
            self._before_forward(module_id)

        return torch.compiler.disable(hook)

    def _forward_hook(self, module_id: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._after_forward(module_id, output)
            self._leave_forward(module, args, output)  # after this module's chunks are released

        return torch.compiler.disable(hook)

    @torch.compiler.disable
    def _enter_forward(self, module: nn.Module, args: Any) -> None:
        if not inside_backward():
            self._forward_depth += 1

    @torch.compiler.disable
    def _leave_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if inside_backward():
            return
        self._forward_depth -= 1
        if self._forward_depth == 0:
            self.finish_phase()
            # Buffers nothing recorded for backward go back to the pool ([Note: weights autograd saved]).
            self.manager.forget_released(unless_held=True)

    def _before_forward(self, module_id: int) -> None:
        if inside_backward():
            self._before_recomputation(module_id)
            return
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
        if not inside_backward():  # a recomputation counted no users ([Note: activation checkpointing])
            for index in self._module_chunks[module_id]:
                chunk = self.manager.chunks[index]
                chunk.users -= 1
                if chunk.users == 0 and chunk.state is ChunkState.COMPUTING:
                    chunk.move(ChunkState.GATHERED)
            self.tracer.forward_ended(module_id)
        if not torch.is_grad_enabled() or not self._backward_chunks[module_id]:
            return
        tensors = [tensor for tensor in _tensors_in(output) if tensor.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda _: self._before_backward(module_id), mode="any"
            )

    def _before_recomputation(self, module_id: int) -> None:
        """A forward run again inside backward ([Note: activation checkpointing]): gather and hold for backward."""
        needed = self._module_chunks[module_id]
        position = self._trace("backward", module_id, needed)
        self._make_room(needed, position)
        # Reduced chunks too: the recomputation needs their weights, though their gradients are done.
        self._gather_and_hold_for_backward(needed, position)

    def _trace(self, phase: str, module_id: int, needed: frozenset[int]) -> int:
        """Record the op in the warm-up step, or find it in the trace afterwards; returns its position."""
        if not self.tracer.finished:
            self.tracer.record(phase, module_id, needed)
            return len(self.tracer.ops) - 1
        return self.tracer.advance(phase, module_id)

    def _make_room(self, needed: frozenset[int], position: int) -> None:
        if self.evictor is not None:
            self.evictor.make_room(needed, position)

    # ---------------------------------------------------------------------------------------------- gathers
    def _gather(self, chunk: Chunk, asynchronous: bool = False) -> None:
        if chunk.shard_location is Location.OFFLOAD and chunk.index not in self.manager.plan.offload_parameters:
            # Automatic placement evicted it earlier: its shard comes back with it.
            self.manager.move_shard(chunk, Location.COMPUTE)
        self.manager.gather(chunk, asynchronous=asynchronous)
        if not asynchronous:
            self.prefetcher.prefetched.discard(chunk.index)

    def _gather_missing(self, needed: Iterable[int], position: int) -> None:
        """Gather, in a round with every rank, the chunks of ``needed`` this rank does not hold (and prefetch), after
        taking back the buffers autograd kept (manager.py [Note: weights autograd saved])."""
        needed = list(needed)
        reinstated = [index for index in needed if self.manager.reinstate(self.manager.chunks[index])]
        missing = {index for index in needed if self.manager.chunks[index].state is ChunkState.SHARDED}
        if not missing:
            if reinstated and inside_backward():
                # Keep the round this module's gathers would have entered: it is where complete reductions launch on
                # NCCL ([Note: reductions launched at agreed points]), and it keeps the ranks in step, so a rank
                # does not run ahead while its reductions wait for a slower peer's sends (full gradients would pile
                # up: test_working_set_is_a_few_chunks_not_the_model). It says this rank is still running, so a rank
                # already in ``finish_phase`` (experts without tokens) keeps serving rounds instead of leaving.
                self._gather_round(set(), still_running=True)
            return
        candidates = self.prefetcher.candidates(position) - missing
        prefetch = {index for index in candidates if not self.manager.reinstate(self.manager.chunks[index])}
        self.prefetcher.prefetched |= prefetch
        self._gather_round(missing | prefetch, asynchronous=prefetch)

    def _gather_round(
        self, requested: set[int], asynchronous: set[int] | None = None, still_running: bool = False
    ) -> bool:
        """One round of [Note: gathering in rounds]; returns whether any rank asked for a chunk (or, with
        ``still_running``, said it has not finished its phase: ranks in ``finish_phase`` then keep serving rounds)."""
        chunks = self.manager.chunks
        if self.world_size == 1:
            union = sorted(requested)
            anyone_asked = bool(requested) or still_running
        else:
            # Per chunk "someone asked", then "anyone asked", then minus this rank's complete chunks (a MAX of
            # negated counts is minus the smallest: [Note: reductions launched at agreed points]).
            # Built on the host: written element by element into a device tensor, each flag would be a blocking
            # copy (sharded_state.py [Note: gradients nobody produced]); the small all-reduce moves it once.
            values = [1.0 if index in requested else 0.0 for index in range(len(chunks))]
            values.append(1.0 if requested or still_running else 0.0)
            values.append(-float(self._complete_in_order()) if self.reductions_wait_for_rounds else 0.0)
            flags = torch.tensor(values, dtype=torch.float32)
            with Activity(_describe_round, requested, chunks):
                collectives.all_reduce(flags, op="max", group=self.vote_group)
            agreed = flags.tolist()
            union = [index for index in range(len(chunks)) if agreed[index] > 0]
            anyone_asked = agreed[-2] > 0
            self._launch_reductions(int(-agreed[-1]), force=False)
        for index in union:
            chunk = chunks[index]
            if index in requested and chunk.state is ChunkState.SHARDED:
                self._gather(chunk, asynchronous=asynchronous is not None and index in asynchronous)
            else:
                self.manager.contribute_to_gather(chunk)
        return anyone_asked

    def gather_every_chunk(self) -> None:
        """Gather every chunk this rank does not hold, in one round with every rank (a collective), so that every
        parameter reads whole outside a forward (engine_parts/whole_parameters.py [Note: reading sharded parameters
        outside a forward]).

        Nothing holds them: the next forward releases the ones it does not need, as after any forward. A term computed
        from them keeps its gathered values through autograd's saved tensors (the chunk's full buffer is dropped, never
        overwritten), and its gradient reaches the parameter's chunk through the same post-accumulate-grad hook as the
        forward's.
        """
        for chunk in self.manager.chunks:
            self.manager.reinstate(chunk)
        missing = {chunk.index for chunk in self.manager.chunks if chunk.state is ChunkState.SHARDED}
        self._gather_round(missing)
        for index in sorted(missing):
            self._gather(self.manager.chunks[index])  # only waits: the round above issued the gathers

    def finish_phase(self) -> None:
        """End of a forward (or backward) on this rank: serve the gathers other ranks still need (a collective)."""
        self._forward_depth = 0  # a forward that raised never left its modules; the strategy calls this every step
        if self.world_size == 1:
            return
        while self._gather_round(set()):
            pass

    # ---------------------------------------------------------------------------------------------- backward
    def _before_backward(self, module_id: int) -> None:
        self._queue_end_of_backward()
        needed = self._backward_chunks[module_id]
        position = self._trace("backward", module_id, needed)
        self._make_room(needed, position)
        # Chunks reduced already (their gradients were complete): nothing here needs their weights again.
        needed = frozenset(index for index in needed if not self.manager.chunks[index].reduced_this_backward)
        self._release_frozen(keep=needed)
        self._gather_and_hold_for_backward(needed, position)

    def _gather_and_hold_for_backward(self, needed: frozenset[int], position: int) -> None:
        """Gather ``needed`` (in a round) and hold each trainable chunk until its gradients are reduced."""
        self._gather_missing(needed, position)
        for index in sorted(needed):
            chunk = self.manager.chunks[index]
            self._gather(chunk)
            if chunk.state is ChunkState.GATHERED and not chunk.frozen and not chunk.reduced_this_backward:
                chunk.move(ChunkState.AWAITING_GRADIENTS)

    def _release_frozen(self, keep: frozenset[int]) -> None:
        """Release the gathered frozen chunks outside ``keep`` ([Note: frozen chunks in backward])."""
        for chunk in self.manager.chunks:
            if chunk.frozen and chunk.state is ChunkState.GATHERED and chunk.index not in keep:
                if not chunk.keep_gathered:
                    self.manager.release(chunk)

    def _expect_every_gradient(self) -> None:
        """Without ``prepare_backward``, a chunk waits for every trainable parameter it holds."""
        for chunk in self.manager.chunks:
            chunk.gradients_expected = sum(1 for parameter in chunk.parameters if parameter.requires_grad)

    def _queue_end_of_backward(self) -> None:
        if not self._backward_callback_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._backward_callback_queued = True

    def _queue_end_of_backward_from(self, loss: Tensor) -> None:
        """Queue the end of backward on the backward ``loss`` starts, not on one nested inside it.

        A callback runs when the backward it was queued on finishes. A reentrant activation checkpoint runs a
        backward of its own inside ours, and the first hook of ours to fire may be in there: queued from it, the end
        of backward (reductions forced, chunks released) would run while our backward still needs those chunks. A
        hook on the loss's node fires first, in our backward, and queues it there.
        """
        if loss.grad_fn is None:
            return
        handles: list[RemovableHandle] = []

        def queue(*_: Any) -> None:
            self._queue_end_of_backward()
            handles.pop().remove()

        handles.append(loss.grad_fn.register_prehook(queue))

    def prepare_backward(self, loss: Tensor) -> None:
        """Before ``loss.backward()``: count, per chunk, the parameters this backward will reach (see
        ``GeminiEngine.prepare_backward``)."""
        self._queue_end_of_backward_from(loss)
        reached = leaves_reached_from(loss)
        if reached is None:  # autograd_graph.py [Note: reentrant activation checkpoints hide their parameters]
            self._expect_every_gradient()
            return
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
        self.received.mark(self._flag_of[id(parameter)])
        chunk.gradients_arrived += 1
        self._queue_end_of_backward()
        self._reduce_in_order(force=False)

    def _reduce_in_order(self, force: bool) -> None:
        # See [Note: fixed reduction order]; on some routes only at agreed points ([Note: reductions launched at
        # agreed points]).
        if force or not self.reductions_wait_for_rounds:
            self._launch_reductions(None, force)

    def _complete_in_order(self) -> int:
        """How many chunks, in the fixed reduction order from the next one, have all their gradients here."""
        count = 0
        for index in range(self._next_to_reduce, -1, -1):
            chunk = self.manager.chunks[index]
            if not chunk.frozen and chunk.gradients_arrived < chunk.gradients_expected:
                break
            count += 1
        return count

    def _launch_reductions(self, limit: int | None, force: bool) -> None:
        """Reduce chunks in the fixed order: the complete ones (every one with ``force``), at most ``limit``."""
        while self._next_to_reduce >= 0 and (limit is None or limit > 0):
            chunk = self.manager.chunks[self._next_to_reduce]
            if limit is not None:
                limit -= 1  # a frozen chunk counts as complete in _complete_in_order too
            if chunk.frozen:  # nothing to reduce ([Note: frozen chunks in backward])
                self._next_to_reduce -= 1
                continue
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
        self._release_frozen(keep=frozenset())
        self.manager.forget_released()
        self._next_to_reduce = len(self.manager.chunks) - 1
        self._backward_callback_queued = False
        self._expect_every_gradient()
        received = self.received.on_any_rank(self.vote_group)
        self.manager.attach_master_gradients(lambda parameter: received[self._flag_of[id(parameter)]])
        self.tracer.finish()


def _parameters_its_forward_may_read(module: nn.Module) -> Iterator[nn.Parameter]:
    """The parameters gathered for ``module``'s forward: its own, and, when every child is a leaf module, those of its
    embedding children.

    [Note: weights read by the parent]
    A module's forward may read a child's weight without calling the child: Hugging Face's CLIP text embeddings read
    ``self.position_embedding.weight.shape[0]``, where an empty placeholder would give 0, and its vision embeddings
    interpolate ``self.position_embedding.weight``. So a module made of leaves (an embeddings module) holds its
    ``nn.Embedding`` children's chunks for its whole forward; their forwards run inside it anyway, so this costs
    only the time between the parent's start and theirs. Other children (projections, norms) are left to their own
    hooks: a flat model of leaf layers would otherwise gather every chunk at once. Not in backward either: there each
    child gathers its own chunks when its backward starts, and holds them until they are reduced.
    """
    yield from module.parameters(recurse=False)
    children = list(module.children())
    if children and all(next(child.children(), None) is None for child in children):
        for child in children:
            if isinstance(child, nn.Embedding):
                yield from child.parameters(recurse=False)


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


def _describe_round(requested: set[int], chunks: list[Chunk]) -> str:
    # An activity label, formatted only when a hang report is made (distributed/in_flight.py).
    if not requested:
        return "agreeing which chunks to gather (this rank asks for none)"
    indices = sorted(requested)
    asked = ", ".join(describe_chunk("", chunks[index]) for index in indices[:MAX_CHUNKS_NAMED])
    if len(indices) > MAX_CHUNKS_NAMED:
        asked += f", ... {len(indices)} chunks"
    return f"agreeing which chunks to gather (this rank asks for {asked})"
