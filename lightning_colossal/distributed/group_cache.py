"""Process groups and device meshes made once per process and reused by every later run in it.

[Note: one set of process groups per process]
Every ``Trainer.fit`` / ``validate`` / ``test`` / ``predict`` sets the strategy up anew, and one process often runs
several: fit then test, a notebook cell run again, a hyper-parameter sweep, the test suite's rank pool. Creating a
process group is a collective that opens connections (gloo: sockets, measured at 12 file descriptors per fit on 2
ranks; NCCL: a communicator with device buffers of its own), and torch frees a group only when someone destroys it.
Destroying them at teardown is not an option: a module may keep DTensors over the mesh after a run (FSDP's
``keep_weights_sharded``, hybrid's split model) and use them in the next. So each group and mesh is made once per
process, keyed by what defines it (ranks and backend, or the mesh's device type, shape and axis names, plus a
purpose tag where a second group over the same ranks is wanted), and every later run reuses it. The cache belongs
to one default process group: when that is destroyed and a new one initialised, the cache starts empty; a cached
group someone destroyed is made again.

[Note: destroy the groups before the interpreter exits]
A process that leaves its groups alive can abort after a run that succeeded: gloo's worker thread drops the last
collective's work object (which holds references to Python tensors) a moment after the main thread's ``wait()``
returns. When that moment falls inside the interpreter's finalisation, the thread's attempt to take the GIL ends it
with ``pthread_exit``, whose forced unwinding through torch's C++ frames calls ``std::terminate``: "terminate called
without an active exception", exit code 134 (seen once in 27 runs of the demo on 2 CPU ranks, in Lightning's last
broadcast). Destroying every group from an ``atexit`` handler joins those threads while the interpreter is whole.
Only when the last run in the process ended cleanly: after a failure a worker thread may be blocked in a collective
with a dead peer, and joining it would hold the exit until the collective timeout.
"""

from __future__ import annotations

import atexit
from collections.abc import Callable, Hashable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

T = TypeVar("T")

_cached: dict[Hashable, Any] = {}
_cached_for_world: Any = None
_destroy_registered = False
_last_run_ended_cleanly = False


def reuse_or_create(key: Hashable, create: Callable[[], T]) -> T:
    """The object cached under ``key`` for the current default process group, made by ``create()`` the first time.

    ``create`` may be a collective (every rank calls this with the same keys in the same order, as for the group
    creation it wraps).
    """
    global _cached_for_world
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is not _cached_for_world:
        _cached.clear()
        _cached_for_world = world
    if key not in _cached or not _all_alive(_cached[key]):
        _cached[key] = create()
    return _cached[key]


def _all_alive(cached: Any) -> bool:
    """Whether every group this rank holds in ``cached`` (a group, a mesh or a dict of groups) is still registered.

    Someone may have destroyed them (the test suite's rank pool destroys every subgroup between tests); torch then
    refuses them in every collective. Every rank that destroyed them finds them gone, so all ranks re-create together.
    """
    try:
        if isinstance(cached, DeviceMesh):
            # A mesh resolves its groups by name: a destroyed one raises here already.
            groups = [cached.get_group(dimension) for dimension in range(cached.ndim)]
        elif isinstance(cached, dict):
            groups = list(cached.values())
        else:
            groups = [cached]
        for group in groups:
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.get_backend(group)  # raises for a group no longer in torch's registry
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


def set_group_timeout(group: Any, timeout: timedelta) -> None:
    """Give a live ``group`` the collective ``timeout`` (a reused group keeps the one it was made with otherwise).

    torch sets a live group's timeout only through a private function, so a torch without it keeps the old timeout.
    """
    set_timeout = getattr(torch.distributed.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is not None and group is not None and group.size() > 1:
        set_timeout(timeout, group)


def destroy_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits, if the last run ended cleanly (see the Note above).

    Call when a run starts (it counts as not ended cleanly until ``run_ended`` says so); registers the handler once.
    """
    global _destroy_registered, _last_run_ended_cleanly
    _last_run_ended_cleanly = False
    if not _destroy_registered:
        atexit.register(_destroy_groups_if_clean)
        _destroy_registered = True


def run_ended(cleanly: bool) -> None:
    """Record how the current run ended: the groups are destroyed at exit only after a clean end."""
    global _last_run_ended_cleanly
    _last_run_ended_cleanly = cleanly


def _destroy_groups_if_clean() -> None:
    if _last_run_ended_cleanly and dist.is_available() and dist.is_initialized():
        _cached.clear()
        dist.destroy_process_group()
