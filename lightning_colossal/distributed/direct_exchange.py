"""All-gather and reduce-scatter built from point-to-point sends, the fast route on gloo.

[Note: direct exchanges on gloo]
Sharded engines need two exchanges: "each rank ends with every rank's rows" (an all-gather) and "each rank ends with
the sum of its own rows" (a reduce-scatter). On gloo over loopback TCP, with two ranks and the benchmark GPT's 104 MiB
of fp32 (``python -m benchmarks.gloo_collectives``, benchmarks/RESULTS.md): gloo's ``all_gather_into_tensor`` took
~116 ms, an all-reduce of the whole buffer ~73 ms, and each rank sending its half straight to the other ~32 ms.
A reduce-scatter built the same way measured about as fast as that all-reduce (~79 against ~85 ms on a noisier
day: it allocates its receive buffer and adds on one core), with half the bytes on the wire. gloo's collectives copy
through intermediate buffers and run on one worker thread; a send is one socket write of the caller's memory. So on
gloo both exchanges are done here, directly:

- all-gather: this rank sends its slot to every other rank and receives every other rank's slot straight into the
  output (no staging, no reduction);
- reduce-scatter: this rank sends slot ``r`` of its input to rank ``r`` and receives the other ranks' contributions
  to its own slot into a scratch buffer; ``wait()`` sums them **in rank order**, so a slot that several ranks hold
  in full (a replicated parameter in ZeRO's layout) gets the same bits on every rank.

Each rank sends (n−1)/n of the payload, the ring algorithms' figure; the scratch buffer of a reduce-scatter holds
(n−1) slots, which is the n ≤ 8 CPU case this is for (NCCL keeps its own collectives). A caller that reduces many
times (Gemini, once per chunk and step) passes its own pooled scratch and takes the sum where it starts, in the
first contribution (``sum_in_place``), so no reduction allocates: fresh receive and output buffers per chunk cost
Gemini's CPU ranks tens of MiB of peak memory (benchmarks/RESULTS.md). Every pair of ranks exchanges
exactly one message per direction per call, and every rank issues its calls on a group in the same order, so
messages match by order without tags. Sends and receives are posted at once and progress in gloo's transport while
the caller computes; ``is_completed()`` turns true only once ``wait()`` ran, because gloo marks point-to-point work
complete there, unless the exchange is *watched* ([Note: a thread that watches exchanges]). A receive waits at most the
group's timeout, like any gloo collective.

[Note: a thread that watches exchanges]
A caller that retires exchanges as they finish, without blocking (Gemini's gradient reductions, which must not be
waited for before the last gather round), needs ``is_completed()`` to turn true by itself. gloo's point-to-point
work never does that before ``wait()``, so a watched exchange is handed to one daemon thread per process
(``_Watcher``), which waits for the exchanges in the order they were started (the order their callers retire them)
and marks each one arrived. The caller's ``wait()`` then only waits for that mark, re-raises what the watcher's wait
raised (a timeout, a peer gone), and runs ``finish`` (the sum) on the caller's thread, so the arithmetic and its
order stay where they were. ``work.wait`` releases the GIL, so the watcher costs the caller nothing while it waits.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


class DirectExchange:
    """The sends and receives of one exchange; ``wait()`` waits for all of them, then runs ``finish`` once. With
    ``watched``, a thread waits for them as soon as they start, so ``is_completed()`` turns true by itself ([Note: a
    thread that watches exchanges])."""

    __slots__ = ("_works", "_finish", "_timeout", "_arrived", "_failure")

    def __init__(
        self,
        works: list[dist.Work],
        timeout: timedelta | None,
        finish: Callable[[], None] | None = None,
        watched: bool = False,
    ) -> None:
        self._works = works
        self._timeout = timeout
        self._finish = finish
        self._arrived: threading.Event | None = None
        self._failure: BaseException | None = None
        if watched and works:
            self._arrived = threading.Event()
            _watcher().watch(self)

    def _wait_for_works(self) -> None:
        works, self._works = self._works, []
        for work in works:
            if self._timeout is None:
                work.wait()
            else:
                work.wait(self._timeout)

    def _watch(self) -> None:
        """On the watcher's thread: wait for the works, keep what failed, mark the exchange arrived."""
        try:
            self._wait_for_works()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's wait() to raise there
            self._failure = error
        finally:
            assert self._arrived is not None
            self._arrived.set()

    def wait(self) -> bool:
        if self._arrived is None:
            self._wait_for_works()
        else:
            self._arrived.wait()
            failure, self._failure = self._failure, None
            if failure is not None:
                self._finish = None
                raise failure
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()
        return True

    def is_completed(self) -> bool:
        if self._arrived is not None:
            return self._arrived.is_set()
        return not self._works and self._finish is None


class _Watcher:
    """The daemon thread of [Note: a thread that watches exchanges]: waits for watched exchanges in start order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[DirectExchange] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="lightning_colossal exchange watcher", daemon=True)
        self.thread.start()

    def watch(self, exchange: DirectExchange) -> None:
        self._queue.put(exchange)

    def _run(self) -> None:
        while True:
            self._queue.get()._watch()


_WATCHER: _Watcher | None = None
_WATCHER_LOCK = threading.Lock()


def _watcher() -> _Watcher:
    """This process's watcher, started on first use (and again in a forked child, where the thread did not survive)."""
    global _WATCHER
    with _WATCHER_LOCK:
        if _WATCHER is None or not _WATCHER.thread.is_alive():
            _WATCHER = _Watcher()
        return _WATCHER


def group_timeout(group: ProcessGroup | None) -> timedelta | None:
    """The group's collective timeout as it is now (``None`` where torch does not say: gloo's own default then)."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _peers(rank: int, size: int) -> list[tuple[int, int]]:
    """(send to, receive from) for each step: step ``s`` sends to ``rank + s`` and receives from ``rank - s``."""
    return [((rank + step) % size, (rank - step) % size) for step in range(1, size)]


def all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None) -> DirectExchange:
    """Start filling the flat ``output`` (world size × ``input.numel()``, rank-major) with every rank's ``input``."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    source = input.reshape(-1)
    slots = output.view(size, source.numel())
    slots[rank].copy_(source)
    works = []
    for send_to, receive_from in _peers(rank, size):
        works.append(dist.isend(source, group_dst=send_to, group=group))
        works.append(dist.irecv(slots[receive_from], group_src=receive_from, group=group))
    return DirectExchange(works, group_timeout(group))


def _contributions(input: torch.Tensor, received: torch.Tensor, rank: int, size: int) -> list[torch.Tensor]:
    """Every rank's contribution to this rank's slot, in rank order: this rank's own slot of ``input``, the others'
    in ``received`` (one slot per other rank, in rank order with this rank's left out)."""
    slots = input.view(size, -1)
    others = received.view(size - 1, slots.shape[1])
    return [slots[rank] if source == rank else others[source - (source > rank)] for source in range(size)]


def sum_in_place(input: torch.Tensor, received: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Where a ``reduce_scatter`` given this ``input`` and ``received`` can leave its sum without an output buffer
    of its own: in the first contribution (rank 0's), which the sum starts from ([Note: direct exchanges on
    gloo]). Pass it as ``output``; the sum then overwrites that slot of ``input`` or ``received``."""
    return _contributions(input, received, dist.get_rank(group), dist.get_world_size(group))[0]


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    watched: bool = False,
    received: torch.Tensor | None = None,
) -> DirectExchange:
    """Start summing slot ``rank`` of the rank-major flat ``input`` over every rank into ``output`` (``watched``:
    [Note: a thread that watches exchanges]). ``received`` is the scratch for the other ranks' contributions
    ((world size − 1) slots; a fresh buffer when ``None``), and ``output`` may be ``sum_in_place``'s slot."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    slots = input.view(size, -1)
    if received is None:
        received = torch.empty((size - 1) * slots.shape[1], dtype=input.dtype, device=input.device)
    contributions = _contributions(input, received, rank, size)
    works = []
    for send_to, receive_from in _peers(rank, size):
        works.append(dist.isend(slots[send_to], group_dst=send_to, group=group))
        works.append(dist.irecv(contributions[receive_from], group_src=receive_from, group=group))

    def finish() -> None:
        # Summed in rank order on every rank (see the Note), starting from the first contribution where it lies when
        # the caller asked for the sum there.
        if output.data_ptr() != contributions[0].data_ptr():
            output.copy_(contributions[0])
        for contribution in contributions[1:]:
            output.add_(contribution)

    return DirectExchange(works, group_timeout(group), finish, watched)


def all_gather_pieces(
    own: list[torch.Tensor], pieces_of: Callable[[int], list[torch.Tensor]], group: ProcessGroup | None
) -> DirectExchange:
    """Start an all-gather without staging: this rank sends each tensor of ``own`` to every other rank, and receives
    rank ``r``'s tensors straight into ``pieces_of(r)`` (the same count and sizes as rank ``r``'s ``own``, in the same
    order). Sending from and receiving into the tensors where they live (rows of parameters) saves packing them into
    a rank-major buffer and unpacking it again. Empty tensors are left out on both sides."""
    return exchange_pieces(lambda rank: own, pieces_of, group)


def exchange_pieces(
    pieces_for: Callable[[int], list[torch.Tensor]],
    pieces_from: Callable[[int], list[torch.Tensor]],
    group: ProcessGroup | None,
) -> DirectExchange:
    """Start sending ``pieces_for(r)`` to every other rank ``r`` and receiving rank ``r``'s pieces for this rank into
    ``pieces_from(r)`` (rank ``r``'s ``pieces_for(this rank)``: same count, sizes and order). Empty tensors are left
    out on both sides."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    works = []
    for send_to, receive_from in _peers(rank, size):
        for piece in pieces_for(send_to):
            if piece.numel():
                works.append(dist.isend(piece, group_dst=send_to, group=group))
        for piece in pieces_from(receive_from):
            if piece.numel():
                works.append(dist.irecv(piece, group_src=receive_from, group=group))
    return DirectExchange(works, group_timeout(group))
