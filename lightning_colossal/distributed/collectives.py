"""Every collective call of lightning_colossal goes through this module.

Keeping collectives in one place lets tests intercept them, keeps backend quirks (gloo vs NCCL) in one file, and
makes the layering rule checkable: engines and strategies call these functions, never ``torch.distributed``
collectives directly (see ``tests/unit/test_layering.py``).

Every function is a no-op (or the identity) when no process group is initialised, so single-process code paths
(unit tests, the consolidate command, ``devices=1`` runs) need no special cases.

Every call into torch.distributed here runs inside ``in_flight.Collective`` (asynchronous ones return an
``in_flight.RecordedWork``), so a collective that times out or fails says which one it was ([Note: the collective in
flight] in ``in_flight.py``).

[Note: exchanges per backend]
Sharded engines need two exchanges: "each rank ends with the sum of its own rows" (a reduce-scatter) and "each rank
ends with every rank's rows" (an all-gather). On NCCL they are NCCL's own collectives. On gloo its own reduce-scatter
and all-gather are slower than even an all-reduce of twice the bytes, so both are built from point-to-point sends
(``direct_exchange.py``, [Note: direct exchanges on gloo]): the all-gather measured about twice as fast as the
all-reduce it replaces, the reduce-scatter about as fast with half the bytes on the wire.
The engines' ``communication`` setting can still force the all-reduce route (``"all_reduce"``): of the rank-major
buffer, keeping this rank's slot (a reduce-scatter), or of a zeroed full buffer into which each rank wrote only its
own rows (an all-gather: the rows partition the tensor, so the sum is the gathered tensor). ``use_scatter_gather``
turns the setting into that choice. Both routes give the same values; which buffer layout an engine reduces is its
own (``zero/stages.py``, ``gemini/manager.py``).

[Note: small collectives on the group's device]
A process group accepts tensors of some device types only: NCCL's those of the GPU, gloo's the host's (and, for a
few collectives, the GPU's). The engines' small collectives (overflow and non-finite flags, gradient norms, random
states, "who got a gradient" votes) start where their data lives, which is the host whenever optimizer state is
offloaded, and on NCCL such a call fails with "No backend type associated with device type cpu". One rule covers
them all: ``all_reduce`` and ``broadcast_tensor`` copy a tensor the group cannot take to the group's device, run
there, and copy the result back in place (``device.to_host`` waits for it). A second backend beside NCCL
(``"cpu:gloo,cuda:nccl"``) was the alternative; it was not chosen because it needs a gloo group beside every NCCL
group the engines and DeviceMesh create, including groups users hand over, and a few scalars per step cost less to
move than a second set of communicators. The bulk exchanges (reduce-scatter, all-gather, all-to-all, point-to-point)
are never moved: a tensor the group cannot take there is a placement bug, and they raise an error that says so
instead of copying a whole chunk across the bus.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from lightning_colossal.distributed import device, direct_exchange
from lightning_colossal.distributed.group_cache import reuse_or_create, set_group_timeout
from lightning_colossal.distributed.in_flight import Collective, RecordedWork

T = TypeVar("T")

_REDUCE_OPS: dict[str, ReduceOp.RedOpType] = {
    "sum": ReduceOp.SUM,
    "max": ReduceOp.MAX,
    "min": ReduceOp.MIN,
    "product": ReduceOp.PRODUCT,
}
_MEAN_NAMES = ("mean", "avg")
# torch 2.13 renamed the flat collectives and warns on the old names; older torch has only those. Looked up per call,
# so a test that wraps torch.distributed's functions sees them.
_ALL_GATHER_NAMES = ("all_gather_single", "all_gather_into_tensor")
_REDUCE_SCATTER_NAMES = ("reduce_scatter_single", "reduce_scatter_tensor")


def _newest(names: tuple[str, ...]) -> Any:
    return next(getattr(dist, name) for name in names if hasattr(dist, name))


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: ProcessGroup | None = None) -> int:
    """Size of ``group`` (the default group when ``None``); 1 without a process group."""
    return dist.get_world_size(group) if is_initialized() else 1


def rank(group: ProcessGroup | None = None) -> int:
    """Rank of this process in ``group``; 0 without a process group."""
    return dist.get_rank(group) if is_initialized() else 0


def _device_ids_for_barrier(group: ProcessGroup | None) -> list[int] | None:
    # NCCL's barrier needs the device of this rank, or it guesses one and can hang on a wrong GPU.
    if dist.get_backend(group) == "nccl" and device.device_count("cuda") > 0:
        return [device.current_device("cuda").index or 0]
    return None


# Device types a backend's groups take, for backends whose groups do not say (or say more than they do, as the
# "fake" test backend, which accepts everything): set by the fake-GPU tier to make "fake" behave like NCCL.
_BACKEND_DEVICE_TYPES: dict[str, tuple[str, ...]] = {"nccl": ("cuda",)}


#: Groups made by ``host_group_like`` (by id): they take host tensors whatever their backend's name says (the fake-GPU
#: tier makes them with its own backend).
_HOST_GROUP_IDS: set[int] = set()


def group_device_types(group: ProcessGroup | None = None) -> tuple[str, ...]:
    """The device types whose tensors ``group``'s collectives take, the one to move small tensors to first."""
    if group is not None and id(group) in _HOST_GROUP_IDS:
        return ("cpu",)
    name = backend(group)
    if name in _BACKEND_DEVICE_TYPES:
        return _BACKEND_DEVICE_TYPES[name]
    declared = getattr(group if group is not None else dist.group.WORLD, "_device_types", None)
    if declared:
        # Prefer the host for groups that take both (gloo): its collectives are complete there.
        return tuple(sorted({entry.type for entry in declared}, key=lambda kind: kind != "cpu"))
    return ("cpu",)


@contextmanager
def declared_backend_devices(name: str, device_types: tuple[str, ...]) -> Iterator[None]:
    """Inside: groups of backend ``name`` take only ``device_types`` (the fake-GPU tier makes "fake" act as NCCL)."""
    previous = _BACKEND_DEVICE_TYPES.get(name)
    _BACKEND_DEVICE_TYPES[name] = device_types
    try:
        yield
    finally:
        if previous is None:
            del _BACKEND_DEVICE_TYPES[name]
        else:
            _BACKEND_DEVICE_TYPES[name] = previous


def _on_group_device(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """``tensor`` itself when ``group`` takes it, else a copy on the group's device ([Note: small collectives on the
    group's device])."""
    if torch.compiler.is_compiling():
        # A compiled forward's collectives take activations, already on the compute device; and dynamo cannot read a
        # process group's attributes.
        return tensor
    types = group_device_types(group)
    if tensor.device.type in types:
        return tensor
    return tensor.to(device.current_device(types[0]))


def _back_in_place(tensor: torch.Tensor, moved: torch.Tensor) -> None:
    if moved is not tensor:
        device.copy_into(tensor, moved)


def require_group_device(tensor: torch.Tensor, group: ProcessGroup | None, collective: str) -> None:
    """Raise unless ``group`` takes ``tensor`` where it is (the bulk exchanges, [Note: small collectives on the
    group's device])."""
    if not is_initialized() or torch.compiler.is_compiling():  # dynamo cannot read a process group's attributes
        return
    types = group_device_types(group)
    if tensor.device.type not in types:
        raise RuntimeError(
            f"{collective} of a {tensor.device.type} tensor ({tuple(tensor.shape)}, {tensor.dtype}) on a"
            f" {backend(group)} process group, which takes {', '.join(types)} tensors only. This is a placement bug"
            " in lightning_colossal (a buffer left on the wrong device); please report it with the strategy and its"
            " offload settings."
        )


def barrier(group: ProcessGroup | None = None) -> None:
    """Block until every rank of ``group`` arrives."""
    if not is_initialized():
        return
    device_ids = _device_ids_for_barrier(group)
    with Collective("barrier", group):
        if device_ids is None:
            dist.barrier(group=group)
        else:
            dist.barrier(group=group, device_ids=device_ids)


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: ProcessGroup | None = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place and return it.

    Args:
        tensor: the tensor to reduce; integer tensors are allowed for sum/max/min.
        op: ``"sum"``, ``"mean"``/``"avg"``, ``"max"``, ``"min"`` or ``"product"``.
        group: the process group; the default group when ``None``.
    """
    name = op.lower()
    if name not in _REDUCE_OPS and name not in _MEAN_NAMES:
        raise ValueError(f"reduce op {op!r} is not supported: use one of sum, mean, max, min, product.")
    if not is_initialized():
        return tensor
    moved = _on_group_device(tensor, group)
    # Older gloo had no AVG; SUM then divide works on every backend and keeps integer inputs meaningful.
    with Collective("all_reduce", group, moved):
        dist.all_reduce(moved, op=ReduceOp.SUM if name in _MEAN_NAMES else _REDUCE_OPS[name], group=group)
    _back_in_place(tensor, moved)
    if name not in _MEAN_NAMES:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.div_(world_size(group))
    return tensor.double().div_(world_size(group))


def any_rank_true(
    flag: bool | torch.Tensor, group: ProcessGroup | None = None, device: torch.device | None = None
) -> bool:
    """Return ``True`` if ``flag`` is true on any rank of ``group`` (one scalar MAX all-reduce)."""
    if isinstance(flag, torch.Tensor):
        value = flag.detach().reshape(-1)[:1].to(dtype=torch.float32)
        if device is not None:
            value = value.to(device)
    else:
        value = torch.tensor([1.0 if flag else 0.0], device=device)
    all_reduce(value, op="max", group=group)
    return bool(value.item() > 0)


def broadcast_object(obj: T, source_rank: int = 0, group: ProcessGroup | None = None) -> T:
    """Broadcast a picklable object from ``source_rank`` (a rank *within* ``group``) to every rank of ``group``."""
    if not is_initialized():
        return obj
    container: list[Any] = [obj]
    with Collective("broadcast_object_list", group, peer=source_rank):
        dist.broadcast_object_list(container, group_src=source_rank, group=group)
    return container[0]


def gather_objects(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """Every rank's picklable ``obj``, in group-rank order, on every rank of ``group``."""
    if not is_initialized():
        return [obj]
    gathered: list[Any] = [None] * world_size(group)
    with Collective("all_gather_object", group):
        dist.all_gather_object(gathered, obj, group=group)
    return gathered


def all_gather_tensor(
    tensor: torch.Tensor, group: ProcessGroup | None = None, sync_grads: bool = False
) -> torch.Tensor:
    """Stack ``tensor`` from every rank of ``group`` into a new leading dimension.

    Every rank must pass a tensor of the same shape. With ``sync_grads=True`` the gather is differentiable: the
    backward pass sends each rank the gradient of its own slice (summed over ranks).
    """
    if not is_initialized():
        return tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    if sync_grads:
        from torch.distributed.nn.functional import all_gather as differentiable_all_gather

        with Collective("all_gather", group, tensor):  # the forward's gather; its backward is not recorded
            gathered = differentiable_all_gather(tensor, group=group if group is not None else dist.group.WORLD)
        return torch.stack(gathered)
    gathered = [torch.empty_like(tensor) for _ in range(world_size(group))]
    with Collective("all_gather", group, tensor):
        dist.all_gather(gathered, tensor, group=group)
    return torch.stack(gathered)


def backend(group: ProcessGroup | None = None) -> str:
    """The backend of ``group`` (``"gloo"``, ``"nccl"``, ...); ``"none"`` without a process group."""
    return str(dist.get_backend(group)) if is_initialized() else "none"


def use_scatter_gather(communication: str, group: ProcessGroup | None = None) -> bool:
    """The engines' ``communication`` setting (``"auto"``, ``"all_reduce"`` or ``"scatter_gather"``) as a decision:
    whether to reduce-scatter and all-gather on ``group`` instead of all-reducing ([Note: exchanges per backend])."""
    return communication != "all_reduce"


# [Note: the native route on gloo]
# On GPUs the engines' bulk exchanges are NCCL's own reduce-scatter and all-gather; on gloo they are point-to-point
# sends, so CPU runs would never execute the code GPUs run. gloo has both collectives too (slower, same values), and
# inside ``native_route()``, or with LIGHTNING_COLOSSAL_COLLECTIVES=native in the environment, every engine takes
# them on gloo as it does on NCCL: ZeRO-2's and Gemini's reduce-scatter and all-gather, FSDP2's own collectives.
# The test suite runs the engines' oracle comparisons both ways.
_native_route_forced = False
NATIVE_ROUTE_VARIABLE = "LIGHTNING_COLOSSAL_COLLECTIVES"


@contextmanager
def native_route() -> Iterator[None]:
    """Inside: gloo groups use their own reduce-scatter and all-gather, as NCCL groups do ([Note: the native route on
    gloo])."""
    global _native_route_forced
    previous, _native_route_forced = _native_route_forced, True
    try:
        yield
    finally:
        _native_route_forced = previous


def _native_route_asked() -> bool:
    if _native_route_forced:
        return True
    value = os.environ.get(NATIVE_ROUTE_VARIABLE, "")
    if value not in ("", "native", "direct"):
        raise ValueError(f"{NATIVE_ROUTE_VARIABLE}={value!r}: use 'native' or 'direct' (the default on gloo).")
    return value == "native"


def sends_directly(group: ProcessGroup | None) -> bool:
    """Whether this module builds ``group``'s reduce-scatters and all-gathers from point-to-point sends (whose
    handles report completion only once waited for: [Note: direct exchanges on gloo]); never on the native route
    ([Note: the native route on gloo])."""
    return backend(group) == "gloo" and not _native_route_asked()


def reduce_own_slot_async(
    slots: torch.Tensor,
    group: ProcessGroup | None,
    scatter: bool,
    output: torch.Tensor | None = None,
    reports_completion: bool = False,
    scratch: torch.Tensor | None = None,
) -> tuple[RecordedWork | None, torch.Tensor]:
    """Start summing the rank-major flat ``slots`` (one equal slot per rank of ``group``) over the ranks; returns the
    handle to ``wait()`` on (``None`` when nothing was sent) and the tensor that then holds this rank's slot of the sum.

    With ``scatter`` a reduce-scatter writes the slot into ``output`` (a fresh tensor when ``None``); otherwise
    ``slots`` is all-reduced in place and the result is a view of this rank's slot in it ([Note: exchanges per
    backend]). ``reports_completion``: the handle's ``is_completed()`` turns true without a ``wait()`` on every
    backend (``direct_exchange.py`` [Note: a thread that watches exchanges]).

    ``scratch`` ((world size − 1) slots, ``output`` ``None``): on gloo's point-to-point route the other ranks'
    contributions arrive in it and the sum is left in it or in ``slots`` (the result is a view of one of them), so a
    caller that pools both allocates nothing per reduction; other routes ignore it.
    """
    slot_numel = slots.numel() // world_size(group)
    if scatter:
        direct = is_initialized() and world_size(group) > 1 and sends_directly(group)
        if output is None and scratch is not None and direct:
            output = direct_exchange.sum_in_place(slots, scratch, group)
        elif output is None:
            output = torch.empty(slot_numel, dtype=slots.dtype, device=slots.device)
        return reduce_scatter_async(output, slots, group, reports_completion, scratch if direct else None), output
    own = slots.view(world_size(group), slot_numel)[rank(group)]
    return all_reduce_async(slots, group), own


def all_reduce_async(
    tensor: torch.Tensor, group: ProcessGroup | None = None, then: Callable[[], None] | None = None
) -> RecordedWork | None:
    """Start a SUM all-reduce of ``tensor`` in place; returns the handle to ``wait()`` on (``None`` when alone:
    already done). ``then`` runs once ``tensor`` holds the sum: in the handle's first ``wait()``, or here when there is
    nothing to wait for."""
    if not is_initialized() or world_size(group) == 1:
        if then is not None:
            then()
        return None
    require_group_device(tensor, group, "an asynchronous all-reduce")
    with Collective("all_reduce", group, tensor):  # launching can fail too (a peer already gone)
        work = dist.all_reduce(tensor, op=ReduceOp.SUM, group=group, async_op=True)
    return RecordedWork(work, "all_reduce", group, tensor, then)


def reduce_scatter_async(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None = None,
    reports_completion: bool = False,
    scratch: torch.Tensor | None = None,
) -> RecordedWork | None:
    """Start a SUM reduce-scatter: rank r receives the sum of every rank's r-th equal slice of ``input``
    (``reports_completion``, ``scratch``: see ``reduce_own_slot_async``)."""
    if not is_initialized() or world_size(group) == 1:
        output.copy_(input)
        return None
    require_group_device(input, group, "a reduce-scatter")
    with Collective("reduce_scatter", group, input):
        if sends_directly(group):
            work = direct_exchange.reduce_scatter(output, input, group, watched=reports_completion, received=scratch)
        else:
            work = _newest(_REDUCE_SCATTER_NAMES)(output, input, op=ReduceOp.SUM, group=group, async_op=True)
    return RecordedWork(work, "reduce_scatter", group, input)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None = None) -> None:
    """Concatenate every rank's ``input`` (same size on all ranks) into ``output``, in rank order."""
    work = all_gather_into_async(output, input, group)
    if work is not None:
        work.wait()


def all_gather_into_async(
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None = None,
    then: Callable[[], None] | None = None,
) -> RecordedWork | None:
    """Start ``all_gather_into``; returns the handle to ``wait()`` on (``None`` when alone: already done). ``then``
    runs once ``output`` is complete: in the handle's first ``wait()``, or here when there is nothing to wait for."""
    if not is_initialized() or world_size(group) == 1:
        output.copy_(input)
        if then is not None:
            then()
        return None
    require_group_device(input, group, "an all-gather")
    with Collective("all_gather", group, input):
        if sends_directly(group):
            work = direct_exchange.all_gather(output, input, group)
        else:
            work = _newest(_ALL_GATHER_NAMES)(output, input, group=group, async_op=True)
    return RecordedWork(work, "all_gather", group, input, then)


def all_gather_pieces_async(
    own: list[torch.Tensor], pieces_of: Callable[[int], list[torch.Tensor]], group: ProcessGroup | None = None
) -> RecordedWork | None:
    """Start giving every rank each rank's ``own`` tensors in place (``pieces_of(r)``: where rank ``r``'s go, shaped
    like its ``own``), with point-to-point sends and no staging buffer; only where ``sends_directly(group)``.
    Returns the handle to ``wait()`` on (``None`` when alone: nothing to receive)."""
    if not is_initialized() or world_size(group) == 1:
        return None
    if not sends_directly(group):
        raise ValueError(f"all_gather_pieces_async sends point-to-point on gloo only; this group is {backend(group)}.")
    record = next((piece for piece in own if piece.numel()), own[0] if own else torch.empty(0))
    with Collective("all_gather", group, record):
        work = direct_exchange.all_gather_pieces(own, pieces_of, group)
    return RecordedWork(work, "all_gather", group, record)


def reduce_scatter_pieces_async(
    pieces_for: Callable[[int], list[torch.Tensor]],
    pieces_from: Callable[[int], list[torch.Tensor]],
    group: ProcessGroup | None = None,
) -> RecordedWork | None:
    """Start sending each other rank ``r`` its pieces (``pieces_for(r)``, rows of this rank's gradients where they
    live) and receiving theirs for this rank into ``pieces_from(r)``: a reduce-scatter without staging, whose sum the
    caller adds up in rank order; only where ``sends_directly(group)``. ``None`` when alone."""
    if not is_initialized() or world_size(group) == 1:
        return None
    if not sends_directly(group):
        raise ValueError(
            f"reduce_scatter_pieces_async sends point-to-point on gloo only; this group is {backend(group)}."
        )
    pieces = pieces_for((rank(group) + 1) % world_size(group))
    record = next((piece for piece in pieces if piece.numel()), pieces[0] if pieces else torch.empty(0))
    with Collective("reduce_scatter", group, record):
        work = direct_exchange.exchange_pieces(pieces_for, pieces_from, group)
    return RecordedWork(work, "reduce_scatter", group, record)


def broadcast_tensor(tensor: torch.Tensor, source_rank: int = 0, group: ProcessGroup | None = None) -> None:
    """Overwrite ``tensor`` on every rank of ``group`` with the one of ``source_rank`` (a rank within the group)."""
    if not is_initialized() or world_size(group) == 1:
        return
    moved = _on_group_device(tensor, group)
    with Collective("broadcast", group, moved, peer=source_rank):
        dist.broadcast(moved, group_src=source_rank, group=group)
    _back_in_place(tensor, moved)


def broadcast_tensors(tensors: list[torch.Tensor], source_rank: int = 0, group: ProcessGroup | None = None) -> None:
    """``broadcast_tensor`` of each of ``tensors``, as one collective per dtype (flattened), for many small tensors.
    Every rank must pass tensors of the same shapes and dtypes in the same order."""
    if not tensors or not is_initialized() or world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    with torch.no_grad():
        for dtype in sorted(by_dtype, key=str):  # the same order on every rank
            same_dtype = by_dtype[dtype]
            flat = torch.cat([tensor.reshape(-1) for tensor in same_dtype])
            broadcast_tensor(flat, source_rank=source_rank, group=group)
            offset = 0
            for tensor in same_dtype:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()


def new_group_like(group: ProcessGroup | None, timeout: timedelta) -> ProcessGroup | None:
    """A second process group over the same ranks (a collective: every rank of the world must call it).

    Collectives on different groups are matched independently, so an engine can run two streams of collectives
    whose interleaving differs between ranks (Gemini: gathers and gradient reductions). Made once per process and
    reused by later engines ([Note: one set of process groups per process] in ``group_cache.py``).
    """
    if not is_initialized():
        return None
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    group_backend = backend(group)
    with Collective("new_group", group):  # every rank must reach it: a rank missing here hangs the others
        second = reuse_or_create(
            ("second_group", ranks, group_backend),
            lambda: dist.new_group(ranks=list(ranks), timeout=timeout, backend=group_backend),
        )
    set_group_timeout(second, timeout)
    return second


def host_group_like(group: ProcessGroup | None, timeout: timedelta) -> ProcessGroup | None:
    """A group over the ranks of ``group`` whose collectives take host tensors: ``group`` itself when it does (gloo),
    else a gloo group beside it, made once per process (a collective: every rank of the world must call it).

    [Note: votes on the host]
    An engine's votes (which chunks a gather round serves, which parameters got a gradient on any rank) are a few
    flags made on the host and read on the host. On an NCCL group they went to the device and back: a copy, the
    collective, a copy back and a wait for the device's whole queue, once per gather round (hundreds per step under
    Gemini at several GPUs) and once per backward, each stalling the host while the GPU still had work queued. On a
    gloo group beside it they never touch the device: a host all-reduce over the same ranks, the GPU's queue keeps
    running. The votes order nothing on the device (the gathers and reductions they decide run on the device groups),
    so two communicators are not a matching problem here ([Note: two groups] in ``gemini/manager.py``).
    """
    if not is_initialized():
        return None
    if "cpu" in group_device_types(group):
        return group
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    with Collective("new_group", group):  # every rank must reach it: a rank missing here hangs the others
        host = reuse_or_create(
            ("host_group", ranks), lambda: dist.new_group(ranks=list(ranks), timeout=timeout, backend="gloo")
        )
    set_group_timeout(host, timeout)
    _HOST_GROUP_IDS.add(id(host))
    return host


def gather_along(tensor: torch.Tensor, dim: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order (equal shapes on every rank)."""
    size = world_size(group)
    if size == 1:
        return tensor
    moved = tensor.movedim(dim, 0).contiguous()
    output = torch.empty((size * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device)
    all_gather_into(output, moved, group)
    return output.movedim(0, dim)


def reduce_scatter_along(tensor: torch.Tensor, dim: int, group: ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``tensor`` over ranks and keep this rank's equal slice along ``dim`` (``dim`` must divide evenly)."""
    size = world_size(group)
    if size == 1:
        return tensor
    if tensor.shape[dim] % size != 0:
        raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split into {size} equal slices.")
    moved = tensor.movedim(dim, 0).contiguous()
    # Slicing dim 0 of a contiguous tensor into equal pieces makes rank-major slots of the flat buffer.
    work, own = reduce_own_slot_async(moved.view(-1), group, scatter=True)
    if work is not None:
        work.wait()
    return own.view(moved.shape[0] // size, *moved.shape[1:]).movedim(0, dim)


def all_to_all_along(
    tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None = None
) -> torch.Tensor:
    """Split ``tensor`` into equal pieces along ``scatter_dim``, send piece r to rank r, concatenate the received
    pieces along ``gather_dim`` in rank order (Ulysses' head/sequence exchange)."""
    size = world_size(group)
    if size == 1:
        return tensor
    if tensor.shape[scatter_dim] % size != 0:
        raise ValueError(
            f"dimension {scatter_dim} of size {tensor.shape[scatter_dim]} does not split into {size} equal pieces."
        )
    pieces = [piece.contiguous() for piece in tensor.chunk(size, dim=scatter_dim)]
    send = torch.cat([piece.reshape(-1) for piece in pieces])
    receive = torch.empty_like(send)
    require_group_device(send, group, "an all-to-all")
    with Collective("all_to_all_single", group, send):
        dist.all_to_all_single(receive, send, group=group)
    received = [piece.view(pieces[0].shape) for piece in receive.chunk(size)]
    return torch.cat(received, dim=gather_dim)


def all_to_all_rows(
    tensor: torch.Tensor, output_rows: list[int], input_rows: list[int], group: ProcessGroup | None = None
) -> torch.Tensor:
    """Send ``input_rows[r]`` consecutive rows of ``tensor`` (dim 0) to rank r and receive ``output_rows[r]`` rows from
    each rank r, in rank order (expert parallelism's token dispatch; counts differ per rank and may be zero). Every
    rank of ``group`` must call it, with or without rows to send."""
    if world_size(group) == 1:
        return tensor
    send = tensor.contiguous()
    receive = send.new_empty((sum(output_rows), *send.shape[1:]))
    require_group_device(send, group, "an all-to-all")
    with Collective("all_to_all_single", group, send):
        dist.all_to_all_single(receive, send, output_rows, input_rows, group=group)
    return receive


def sum_within_group(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce (SUM) in place within ``group``, skipping the call for a group of one; returns ``tensor``."""
    if group is None or world_size(group) == 1:
        return tensor
    require_group_device(tensor, group, "a sum within a group")
    with Collective("all_reduce", group, tensor):
        dist.all_reduce(tensor, op=ReduceOp.SUM, group=group)
    return tensor


def new_group_containing(rank_lists: list[list[int]], timeout: timedelta) -> ProcessGroup | None:
    """Create one group per list of ranks (a collective: every rank calls it with the same lists, in the same order)
    and return the one this rank belongs to (``None`` if none).

    The groups are made once per process and reused by later calls with the same lists ([Note: one set of process
    groups per process] in ``group_cache.py``).
    """
    if not is_initialized():
        return None
    sorted_lists = tuple(tuple(sorted(ranks)) for ranks in rank_lists)
    group_backend = backend()

    def create() -> dict[tuple[int, ...], ProcessGroup]:
        return {
            ranks: dist.new_group(ranks=list(ranks), timeout=timeout, backend=group_backend) for ranks in sorted_lists
        }

    with Collective("new_group"):  # every rank must reach it: a rank missing here hangs the others
        groups = reuse_or_create(("groups_containing", sorted_lists, group_backend), create)
    own = dist.get_rank()
    mine = next((group for ranks, group in groups.items() if own in ranks), None)
    set_group_timeout(mine, timeout)
    return mine


_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)


def send_tensor(tensor: torch.Tensor, destination: int, group: ProcessGroup) -> None:
    """Send ``tensor`` (any shape, one of a few dtypes) to ``destination``, a rank within ``group``."""
    header = torch.zeros(10, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    with Collective("send", group, tensor, peer=destination):
        dist.send(header, group_dst=destination, group=group)
        dist.send(tensor.contiguous(), group_dst=destination, group=group)


def receive_tensor(source: int, group: ProcessGroup, device: torch.device) -> torch.Tensor:
    """Receive a tensor sent with ``send_tensor`` from ``source``, a rank within ``group``."""
    header = torch.zeros(10, dtype=torch.int64, device=device)
    with Collective("recv", group, peer=source):  # the shape is not known until the header arrives
        dist.recv(header, group_src=source, group=group)
    dimensions, dtype = int(header[0]), _DTYPES[int(header[1])]
    tensor = torch.empty(tuple(header[2 : 2 + dimensions].tolist()), dtype=dtype, device=device)
    with Collective("recv", group, tensor, peer=source):
        dist.recv(tensor, group_src=source, group=group)
    return tensor
