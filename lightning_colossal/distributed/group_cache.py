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
group someone destroyed is dropped at the next look-up (or at once by ``forget_destroyed``) and made again when
asked for. Dropping matters: a destroyed gloo group keeps its transport thread, which wakes every 10 ms, until
nothing refers to it (the test suite's rank pools idled at half a core per rank with 81 such threads each).

[Note: let gloo's workers finish before the interpreter exits]
A process can abort after a run that succeeded: "terminate called without an active exception", exit code 134
(seen in about 1 of 27 runs of the demo on 2 CPU ranks). Two core dumps show the same thread: gloo's worker
(``pt_gloo_runloop``) dropping a finished broadcast's work object, whose tensors hold Python objects, so it needs the
GIL. The main thread had meanwhile gone on into the interpreter's finalisation, where a thread that takes the GIL is
ended with ``pthread_exit``, and that unwinding through torch's C++ frames calls ``std::terminate``.

``destroy_process_group`` does not prevent it: it only unregisters the groups, and their worker threads live as long
as any object refers to the group (device meshes, DTensors, the strategy). So an ``atexit`` handler, which runs
while the interpreter is still whole, first lets the workers finish: it sleeps in short steps, which releases the
GIL to a worker waiting for it, until every ``pt_gloo_runloop`` thread has been seen asleep three times in a row
(at most a second; Linux only, elsewhere a fixed 50 ms). Then, only when the process's last run ended cleanly, it
destroys the groups (after a failure a group may still have work waiting on a dead peer).
"""

from __future__ import annotations

import atexit
import os
import time
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
    forget_destroyed()
    if key not in _cached:
        _cached[key] = create()
    return _cached[key]


def forget_destroyed() -> None:
    """Drop every cached group and mesh someone destroyed (they would be made again on their next use anyway).

    A destroyed gloo group still runs its transport thread, which wakes every 10 ms, for as long as anything refers
    to it; the cache should not be what keeps it. ``reuse_or_create`` calls this before each look-up; a caller that
    destroys groups between runs (the test suite's rank pool) may call it at once.
    """
    for key in [key for key, cached in _cached.items() if not _all_alive(cached)]:
        del _cached[key]


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
    """At interpreter exit, let gloo's workers finish and, if the last run ended cleanly, destroy every process group
    (see the Note above).

    Call when a run starts (it counts as not ended cleanly until ``run_ended`` says so); registers the handler once.
    """
    global _destroy_registered, _last_run_ended_cleanly
    _last_run_ended_cleanly = False
    if not _destroy_registered:
        atexit.register(_leave_the_groups_quiet)
        _destroy_registered = True


def run_ended(cleanly: bool) -> None:
    """Record how the current run ended: the groups are destroyed at exit only after a clean end."""
    global _last_run_ended_cleanly
    _last_run_ended_cleanly = cleanly


def _leave_the_groups_quiet() -> None:
    wait_for_idle_gloo_workers()
    if _last_run_ended_cleanly and dist.is_available() and dist.is_initialized():
        _cached.clear()
        dist.destroy_process_group()


_GLOO_WORKER_THREAD = "pt_gloo_runloop"
_TASKS = "/proc/self/task"


def wait_for_idle_gloo_workers(timeout: float = 1.0, poll: float = 0.01, quiet_polls: int = 3) -> bool:
    """Sleep (releasing the GIL) until every gloo worker thread of this process has been seen asleep ``quiet_polls``
    times in a row, or ``timeout`` seconds passed; whether they went quiet. Without ``/proc``: one 50 ms sleep."""
    if not os.path.isdir(_TASKS):
        time.sleep(0.05)
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while time.monotonic() < deadline:
        time.sleep(poll)
        quiet = 0 if _a_gloo_worker_is_running() else quiet + 1
        if quiet >= quiet_polls:
            return True
    return False


def _a_gloo_worker_is_running() -> bool:
    for task in os.listdir(_TASKS):
        try:
            with open(f"{_TASKS}/{task}/comm") as handle:
                if handle.read().strip() != _GLOO_WORKER_THREAD:
                    continue
            with open(f"{_TASKS}/{task}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
        if state == "R":
            return True
    return False
