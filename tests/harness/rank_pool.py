"""A persistent pool of gloo ranks for multi-process tests.

Spawning fresh processes per test costs about 6 s on 2 cores (interpreter, ``import torch``, rendezvous). The pool
starts ``world_size`` worker processes once, joins them into one gloo process group through a ``FileStore``, and
then runs module-level test bodies on every rank on request::

    # tests/distributed/my_feature_bodies.py (or the test module itself: the worker imports it by name)
    def sum_of_ranks(directory: str) -> float:
        tensor = torch.tensor([float(torch.distributed.get_rank())])
        torch.distributed.all_reduce(tensor)
        return tensor.item()

    # tests/distributed/test_my_feature.py
    def test_sum_of_ranks(rank_pool_2: RankPool, tmp_path: Path) -> None:
        assert rank_pool_2.run(my_feature_bodies.sum_of_ranks, str(tmp_path), timeout=60) == [1.0, 1.0]

Rules for bodies: module-level functions of an importable module; arguments and return values pickled (return plain
data, or tensors ``.detach().cpu()``; never ``nn.Module``s or live process groups); pass paths as ``str``. Inside a
body, ``torch.distributed.get_rank()`` (or :func:`current_rank`) gives the rank. A body that expects an exception
catches it itself (see the note on failures). What a body prints reaches the test's captured stderr, prefixed
``[rank N]``, when the run ends.

[Note: what leaks between tests]
Between runs each worker resets the default dtype (float32), grad mode (on), torch's thread count (1), ``os.environ``
(to its state after start-up), the working directory (a scratch directory shared by the pool's ranks, so relative
paths such as ``lightning_logs/`` never land in the repository), destroys every process group but the default one,
and collects garbage. Everything else persists for the life of the pool: imported modules and their module-level
state, random number generator states (seed in the body), ``torch.backends`` and deterministic-algorithm flags,
``warnings`` filters, logging handlers, and any ``DeviceMesh`` bookkeeping torch keeps internally.

[Note: what a worker looks like]
Each worker has ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set and
an initialised default process group. Lightning's ``LightningEnvironment`` takes ``LOCAL_RANK`` in ``os.environ`` as
"processes created externally", so a ``Trainer(accelerator="cpu", devices=world_size, strategy=...)`` built inside a
body launches nothing and reuses the existing group. Thread pools are pinned to one thread (``OMP_NUM_THREADS=1`` is
in the environment before the worker's interpreter starts), because four ranks on two cores each running a full
intra-op thread pool is oversubscribed by an order of magnitude.

[Note: failures restart the pool]
After any failure (a rank raised, died, or ran past its timeout) every worker is killed and the pool restarts
lazily on the next ``run``. A rank that raised may have left the others inside a collective, and even when all ranks
returned, their collective sequence numbers may disagree; reusing such a group can hang or silently pair the wrong
collectives in the next test. Killing costs a restart (a few seconds), so a test that expects an exception should
catch it inside the body (``with pytest.raises(...)`` on each rank) and return normally.

This module must not import ``torch`` at module level: a spawned worker imports it (to unpickle its entry point)
before it can pin its thread count. It also must not import ``lightning_colossal``, so it serves engine-level tests.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import faulthandler
import gc
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]

# Every thread-pool knob we know of, set before the worker's interpreter starts so that even a torch imported while
# unpickling the worker's entry point starts with one thread.
THREAD_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "VECLIB_MAXIMUM_THREADS": "1",
}

_OUTPUT_TAIL_LINES = 30


class RankFailure(RuntimeError):
    """One or more ranks raised, died, or hung while running a body.

    Attributes:
        function_name: ``module.qualname`` of the body (or ``"pool start-up"``).
        rank_reports: per failed or stuck rank, the text shown in the message (traceback, exit code, stack dump).
        finished_ranks: ranks that returned normally.
    """

    def __init__(self, message: str, function_name: str, rank_reports: dict[int, str], finished_ranks: list[int]):
        super().__init__(message)
        self.function_name = function_name
        self.rank_reports = rank_reports
        self.finished_ranks = finished_ranks


class RankTimeout(RankFailure):
    """The body ran past its timeout; the message holds the Python stack of every rank still running."""


def current_rank() -> int:
    """Rank of this worker in the pool's default process group (call inside a body)."""
    import torch.distributed

    return torch.distributed.get_rank()


def current_world_size() -> int:
    """World size of the pool's default process group (call inside a body)."""
    import torch.distributed

    return torch.distributed.get_world_size()


# ---------------------------------------------------------------------------------------------------------------------
# Worker side: runs in the spawned process.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _WorkerConfig:
    rank: int
    world_size: int
    store_path: str
    log_path: str
    stack_path: str
    working_directory: str
    master_port: int
    collective_timeout: float
    parent_pid: int


def _worker_main(config: _WorkerConfig, connection: Connection) -> None:
    """Entry point of a worker: set up the process, join the group, then serve requests until told to exit."""
    os.environ.update(THREAD_ENVIRONMENT)
    # Ctrl-C reaches the whole process group; the parent decides what happens to the workers (it kills them), so
    # four workers printing KeyboardInterrupt tracebacks would only be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _redirect_output(config.log_path)
    # Fatal signals (segfault, abort) print the Python stack into the rank's log, which the parent reports.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The parent sends SIGUSR1 to collect the stack of a hung rank. Keep the file object alive for the process.
    _install_stack_dump_handler(config)
    _exit_when_parent_dies(config.parent_pid)
    if str(REPOSITORY_ROOT) not in sys.path:
        # Bodies live in ``tests.<package>.<module>``; the repository root must be importable whatever the cwd.
        sys.path.insert(0, str(REPOSITORY_ROOT))
    os.environ.update(
        {
            "RANK": str(config.rank),
            "LOCAL_RANK": str(config.rank),
            "WORLD_SIZE": str(config.world_size),
            "NODE_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(config.master_port),
        }
    )
    # Gloo resolves the hostname to pick an interface, which fails in some containers; all ranks are local anyway.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        _initialise_torch(config)
    except BaseException:
        _send(connection, ("raised", traceback.format_exc()))
        return
    # Stray outputs of bodies (``lightning_logs/``, relative checkpoint paths) land in a scratch directory shared by
    # all ranks of the pool instead of in the repository.
    os.chdir(config.working_directory)
    baseline_environment = dict(os.environ)
    _collect_garbage()
    _send(connection, ("ready", os.getpid()))
    _serve(connection, config, baseline_environment)


def _initialise_torch(config: _WorkerConfig) -> None:
    import torch
    import torch.distributed

    torch.set_num_threads(1)
    store = torch.distributed.FileStore(config.store_path, config.world_size)
    torch.distributed.init_process_group(
        "gloo",
        store=store,
        rank=config.rank,
        world_size=config.world_size,
        timeout=timedelta(seconds=config.collective_timeout),
    )
    # Gloo may connect lazily; one barrier proves every pair of ranks can talk before the first test runs.
    torch.distributed.barrier()


def _serve(connection: Connection, config: _WorkerConfig, baseline_environment: dict[str, str]) -> None:
    while True:
        try:
            request = connection.recv_bytes()
        except (EOFError, OSError):
            return  # The parent went away: exit instead of lingering as an orphan.
        try:
            command, module_name, qualified_name, args, kwargs = pickle.loads(request)
        except BaseException:
            _send(connection, ("raised", "could not unpickle the request in the worker:\n" + traceback.format_exc()))
            continue
        if command == "exit":
            return
        try:
            function = _resolve_function(module_name, qualified_name)
            value = function(*args, **kwargs)
        except BaseException as error:
            # Drop this frame from the traceback: the report should start at the body.
            body_traceback = error.__traceback__.tb_next if error.__traceback__ else None
            _send(connection, ("raised", "".join(traceback.format_exception(type(error), error, body_traceback))))
            continue
        try:
            reply = pickle.dumps(("ok", value))
        except BaseException:
            reply = pickle.dumps(
                (
                    "raised",
                    "the body's return value could not be pickled (return plain data or tensors that are "
                    "detached and on CPU):\n" + traceback.format_exc(),
                )
            )
        _flush_output()
        connection.send_bytes(reply)
        # Cleanup runs after the reply so that it overlaps with the parent's work between tests.
        _reset_between_runs(config, baseline_environment)


def _resolve_function(module_name: str, qualified_name: str) -> Callable[..., Any]:
    target: Any = importlib.import_module(module_name)
    for attribute in qualified_name.split("."):
        target = getattr(target, attribute)
    return target


def _install_stack_dump_handler(config: _WorkerConfig) -> None:
    """Dump every thread's stack into the rank's stack file on SIGUSR1 (the parent's way to see a hung rank)."""
    # The file object must outlive this call: faulthandler keeps only its descriptor.
    stack_file = getattr(_install_stack_dump_handler, "stack_file", None)
    if stack_file is None:
        stack_file = open(config.stack_path, "a", encoding="utf-8")  # noqa: SIM115 (lives as long as the worker)
        _install_stack_dump_handler.stack_file = stack_file  # type: ignore[attr-defined]
    # register() skips installing the OS handler when faulthandler believes it is still installed; unregister first.
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)


def _reset_between_runs(config: _WorkerConfig, baseline_environment: dict[str, str]) -> None:
    """Undo the process-wide state a body commonly changes, so that tests stay independent of their order.

    The default process group is kept; subgroups are destroyed because each gloo group holds sockets to its peers and
    hundreds of tests creating meshes would otherwise run the worker out of file descriptors. Destroying is not
    enough: a group lives as long as anything refers to it, and each live gloo group keeps a transport thread that
    wakes every 10 ms. Left to accumulate (the project's group cache, torch's mesh-keyed caches, cycles the frozen
    collector never revisits), they were 81 threads per rank in the 4-rank pool by the end of the suite, about half
    a core per idle rank in system time: the suite ran 30 to 41 minutes on 2 cores instead of about 15.
    """
    import torch
    import torch.distributed

    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    torch.set_num_threads(1)
    # Lightning's environment teardown deletes WORLD_SIZE, and seed_everything adds PL_GLOBAL_SEED.
    for name in set(os.environ) - set(baseline_environment):
        del os.environ[name]
    os.environ.update(baseline_environment)
    os.chdir(config.working_directory)
    # Lightning's signal connector saves and restores Python-level SIGUSR1 handlers around fit(), which erases
    # faulthandler's C-level handler; without this a later hang would come back with no stack.
    _install_stack_dump_handler(config)
    _destroy_subgroups()
    _forget_meshes()
    global _runs_reset
    _runs_reset += 1
    _collect_garbage(everything=_runs_reset % FULL_COLLECTION_EVERY == 0)


# Every this many runs the collector also scans what earlier runs froze (see ``_collect_garbage``).
FULL_COLLECTION_EVERY = 20
#: Runs this worker has reset after.
_runs_reset = 0


def _forget_meshes() -> None:
    """Drop what still refers to the destroyed groups: the project's group cache, and torch's caches keyed by device
    meshes or DTensor specs (each mesh holds its groups). Best effort: a cache a newer torch moved is left alone."""
    # Only modules a body already imported can hold entries (importing them here would cost seconds per rank).
    group_cache = sys.modules.get("lightning_colossal.distributed.group_cache")
    if group_cache is not None:
        group_cache.forget_destroyed()
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    dtensor = sys.modules.get("torch.distributed.tensor._api")
    caches: list[Any] = []
    with contextlib.suppress(AttributeError):
        if collective_utils is not None:
            caches.append(collective_utils.MeshTopoInfo.build_from_mesh)
        if redistribute is not None:
            caches.append(redistribute._gen_transform_infos)
        if dtensor is not None:
            propagator = dtensor.DTensor._op_dispatcher.sharding_propagator
            caches.append(propagator.propagate_op_sharding.cache)
            caches.append(type(propagator)._propagate_tensor_meta_cached)
    for cache in caches:
        clear = getattr(cache, "cache_clear", None)
        if callable(clear):
            clear()


def _collect_garbage(everything: bool = False) -> None:
    """Free the cycles a body left behind (a Trainer and its module hold each other), cheaply.

    A full collection scans every live object: about 0.17 s with Lightning imported, per rank, per test. Freezing the
    survivors moves them out of the collector's view, so the next collection scans only what the next body created.
    The price: an object alive now and dropped later (a replaced cache entry) is collected only when ``everything``
    unfreezes them all first, which ``_reset_between_runs`` asks for every ``FULL_COLLECTION_EVERY`` runs.
    """
    if everything:
        gc.unfreeze()
    gc.collect()
    gc.freeze()


def _destroy_subgroups() -> None:
    import torch.distributed
    from torch.distributed import distributed_c10d

    world = torch.distributed.group.WORLD
    process_group_map = getattr(getattr(distributed_c10d, "_world", None), "pg_map", None)
    if process_group_map is None:
        return  # The private registry moved in a newer torch: skip, subgroups merely leak.
    for group in list(process_group_map):
        if group is not world:
            torch.distributed.destroy_process_group(group)


def _send(connection: Connection, message: tuple[Any, ...]) -> None:
    _flush_output()
    connection.send_bytes(pickle.dumps(message))


def _redirect_output(log_path: str) -> None:
    """Point file descriptors 1 and 2 at the rank's log, so that C++ output (gloo, faulthandler) lands there too."""
    log_descriptor = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_descriptor, 1)
    os.dup2(log_descriptor, 2)
    os.close(log_descriptor)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


def _exit_when_parent_dies(parent_pid: int) -> None:
    """Make sure a killed pytest never leaves workers behind.

    An idle worker sees the parent's death as EOF on its pipe. A busy one (stuck in a collective or a sleep) would not,
    so Linux's parent-death signal kills it; a watchdog thread covers platforms without ``prctl`` (only there, because
    the thread shows up in every stack dump).
    """
    pr_set_pdeathsig = 1
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        has_death_signal = libc.prctl(pr_set_pdeathsig, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        has_death_signal = False
    if os.getppid() != parent_pid:
        os._exit(1)  # The parent died before the death signal was armed.
    if has_death_signal:
        return

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent_pid:
                os._exit(1)

    threading.Thread(target=watch, name="rank_pool_parent_watchdog", daemon=True).start()


# ---------------------------------------------------------------------------------------------------------------------
# Parent side: runs in the pytest process.
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    connection: Connection
    log_path: Path
    stack_path: Path
    log_offset: int = 0


@dataclass
class _RunState:
    """Bookkeeping of one ``run``: what each rank returned, or why it failed, and which ranks are still running."""

    pending: set[int]
    values: dict[int, Any] = field(default_factory=dict)
    # Per failed or stuck rank: a one-line title and the details (traceback, stack dump, output tail).
    reports: dict[int, tuple[str, str]] = field(default_factory=dict)
    died: set[int] = field(default_factory=set)
    first_failure_at: float | None = None

    def record_failure(self, rank: int, title: str, details: str) -> None:
        self.pending.discard(rank)
        self.reports[rank] = (title, details)
        self.first_failure_at = self.first_failure_at or time.monotonic()


class RankPool:
    """A persistent set of ``world_size`` gloo ranks that run module-level functions on request.

    Args:
        world_size: number of worker processes (ranks).
        collective_timeout: timeout of every collective of the default process group, in seconds.
        failure_grace: after one rank raised or died, how long to wait for the others to finish (they may be stuck in
            a collective with the failed rank) before killing them and collecting their stacks.
        startup_timeout: how long start-up (interpreter, ``import torch``, rendezvous) may take.
    """

    def __init__(
        self,
        world_size: int,
        collective_timeout: float = 120.0,
        failure_grace: float = 3.0,
        startup_timeout: float = 120.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {world_size}.")
        self.world_size = world_size
        self.collective_timeout = collective_timeout
        self.failure_grace = failure_grace
        self.startup_timeout = startup_timeout
        self._context = multiprocessing.get_context("spawn")
        self._root_directory = Path(tempfile.mkdtemp(prefix=f"rank_pool_{world_size}_"))
        self._working_directory = self._root_directory / "workdir"
        self._working_directory.mkdir()
        self._workers: list[_Worker] = []
        self._generation = 0
        self._closed = False
        # If pytest exits without running fixture teardown, still stop the workers. Runs before multiprocessing's own
        # exit handler (atexit is last-in-first-out), which would otherwise join the workers forever.
        atexit.register(self.close)
        self._start()

    # -- public API ---------------------------------------------------------------------------------------------------

    def run(self, function: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
        """Call ``function(*args, **kwargs)`` on every rank and return the per-rank results, indexed by rank.

        ``function`` must be a module-level function of an importable module (the worker imports it by name); it
        reads its rank from ``torch.distributed.get_rank()`` or :func:`current_rank`. Arguments and return values
        are pickled: return plain data, or tensors detached and on CPU. Paths (e.g. ``str(tmp_path)``) can be passed
        as arguments, since all ranks share the file system. The keyword ``timeout`` belongs to ``run`` itself.

        Raises:
            RankFailure: a rank raised or died; the message holds every failed rank's traceback. The pool restarts.
            RankTimeout: the call ran past ``timeout`` seconds; the message holds every running rank's stack.
            TypeError: ``function`` is not importable by name, or the arguments cannot be pickled.
        """
        __tracebackhide__ = True  # pytest shows the test's line and the message, not the pool's internals.
        if self._closed:
            raise RuntimeError("This RankPool was closed; create a new one.")
        function_name = _importable_name(function)
        try:
            request = pickle.dumps(("run", function.__module__, function.__qualname__, args, kwargs))
        except Exception as error:
            raise TypeError(f"The arguments of {function_name} cannot be pickled for the workers: {error}") from error
        if not self._workers:
            self._start()
        try:
            return self._run_request(request, function_name, timeout)
        except BaseException:
            # Whatever happened (our RankFailure, a KeyboardInterrupt, pytest-timeout), the workers may be mid-body:
            # never leave them half-used. The next run starts a fresh set.
            self._stop_workers(kill=True)
            raise

    def restart(self) -> None:
        """Kill the workers and start a fresh set (e.g. after a test changed process state it cannot undo)."""
        self._stop_workers(kill=True)
        self._start()

    def close(self) -> None:
        """Tell the workers to exit, kill any that do not, and delete the pool's temporary files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self._stop_workers(kill=False)
        shutil.rmtree(self._root_directory, ignore_errors=True)

    @property
    def process_ids(self) -> list[int]:
        """Process ids of the current workers, indexed by rank (empty while the pool waits to restart)."""
        return [worker.process.pid or -1 for worker in self._workers]

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exception_info: object) -> None:
        self.close()

    # -- start and stop -----------------------------------------------------------------------------------------------

    def _start(self) -> None:
        self._generation += 1
        generation_directory = self._root_directory / f"generation_{self._generation}"
        generation_directory.mkdir()
        master_port = _free_port()
        workers = []
        with _temporary_environment(THREAD_ENVIRONMENT):
            for rank in range(self.world_size):
                config = _WorkerConfig(
                    rank=rank,
                    world_size=self.world_size,
                    store_path=str(generation_directory / "file_store"),
                    log_path=str(generation_directory / f"rank_{rank}.log"),
                    stack_path=str(generation_directory / f"rank_{rank}.stack"),
                    working_directory=str(self._working_directory),
                    master_port=master_port,
                    collective_timeout=self.collective_timeout,
                    parent_pid=os.getpid(),
                )
                parent_end, child_end = self._context.Pipe(duplex=True)
                process = self._context.Process(
                    target=_worker_main, args=(config, child_end), name=f"rank_pool_{self.world_size}_rank_{rank}"
                )
                process.start()
                child_end.close()  # Only the child holds its end, so the parent sees EOF when the child dies.
                workers.append(_Worker(rank, process, parent_end, Path(config.log_path), Path(config.stack_path)))
        self._workers = workers
        try:
            self._wait_until_ready()
        except BaseException:
            self._stop_workers(kill=True)
            raise

    def _wait_until_ready(self) -> None:
        state = _RunState(pending=set(range(self.world_size)))
        deadline = time.monotonic() + self.startup_timeout
        self._collect_replies(state, deadline)
        if state.pending or state.reports:
            for rank in sorted(state.pending):
                state.record_failure(rank, f"did not finish start-up within {self.startup_timeout:.0f} s", "")
            failed = sorted(state.reports)
            headline = f"pool start-up failed on ranks {failed}: {_summary(state, failed[0])}"
            raise self._failure("pool start-up", headline, state, RankFailure)
        self._relay_output()

    def _stop_workers(self, kill: bool) -> None:
        """Stop every worker: politely (``exit`` request, then join) or at once (SIGKILL)."""
        workers, self._workers = self._workers, []
        if not kill:
            for worker in workers:
                with contextlib.suppress(OSError):
                    worker.connection.send_bytes(pickle.dumps(("exit", "", "", (), {})))
            for worker in workers:
                worker.process.join(timeout=10.0)
        for worker in workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in workers:
            worker.process.join(timeout=10.0)
            worker.connection.close()
            with contextlib.suppress(ValueError):
                worker.process.close()  # Releases the sentinel descriptor; ValueError if it somehow still runs.
        self._relay_output(workers)
        if workers:
            shutil.rmtree(workers[0].log_path.parent, ignore_errors=True)

    # -- one run ------------------------------------------------------------------------------------------------------

    def _run_request(self, request: bytes, function_name: str, timeout: float) -> list[Any]:
        __tracebackhide__ = True
        state = _RunState(pending=set(range(self.world_size)))
        started_at = time.monotonic()
        for worker in self._workers:
            try:
                worker.connection.send_bytes(request)
            except OSError:
                self._record_death(worker, state)
        self._collect_replies(state, started_at + timeout)
        if not state.reports and not state.pending:
            self._relay_output()
            return [state.values[rank] for rank in range(self.world_size)]
        # Ranks still running are hung (a timeout, when nothing failed) or waiting for a failed peer in a collective.
        running = sorted(state.pending)
        stacks = self._dump_stacks(running)
        timed_out = not state.reports
        for rank in running:
            if timed_out:
                title = f"still running after {timeout:.1f} s"
            else:
                title = f"still running {self.failure_grace:.1f} s after the failure (waiting for it in a collective?)"
            state.pending.discard(rank)
            state.reports[rank] = (title, stacks.get(rank) or "<no stack dump received>")
        if timed_out:
            headline = f"{function_name} timed out after {timeout:.1f} s on ranks {running}"
            raise self._failure(function_name, headline, state, RankTimeout)
        failed = sorted(set(state.reports) - set(running))
        headline = f"{function_name} failed on ranks {failed}: {_summary(state, failed[0])}"
        raise self._failure(function_name, headline, state, RankFailure)

    def _collect_replies(self, state: _RunState, deadline: float) -> None:
        """Wait for a reply or the death of every pending rank, until ``deadline`` or the failure grace runs out."""
        workers_by_handle: dict[Any, _Worker] = {}
        for worker in self._workers:
            workers_by_handle[worker.connection] = worker
            workers_by_handle[worker.process.sentinel] = worker
        while state.pending:
            limit = deadline
            if state.first_failure_at is not None:
                limit = min(deadline, state.first_failure_at + self.failure_grace)
            remaining = limit - time.monotonic()
            if remaining <= 0:
                return
            handles = [handle for handle, worker in workers_by_handle.items() if worker.rank in state.pending]
            # Waiting on the process sentinels too means a worker that dies without replying is noticed at once.
            for handle in wait(handles, timeout=remaining):
                worker = workers_by_handle[handle]
                if worker.rank in state.pending:
                    self._receive(worker, state)

    def _receive(self, worker: _Worker, state: _RunState) -> None:
        try:
            has_message = worker.connection.poll()
            reply = pickle.loads(worker.connection.recv_bytes()) if has_message else None
        except (EOFError, OSError):
            reply = None
        if reply is None:
            self._record_death(worker, state)
            return
        status, payload = reply
        if status == "raised":
            state.record_failure(worker.rank, "raised", payload.rstrip())
        else:
            state.pending.discard(worker.rank)
            state.values[worker.rank] = payload

    def _record_death(self, worker: _Worker, state: _RunState) -> None:
        worker.process.join(timeout=2.0)
        state.died.add(worker.rank)
        # Its last output often says why (a faulthandler dump after a segfault, an OOM message).
        details = f"last lines of its output:\n{_without_worker_frames(_tail(worker.log_path, worker.log_offset))}"
        state.record_failure(worker.rank, f"died: {_describe_exit_code(worker.process.exitcode)}", details)

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask each running rank for its Python stack (faulthandler on SIGUSR1) and read what they wrote."""
        workers = [self._workers[rank] for rank in ranks if self._workers[rank].process.is_alive()]
        sizes = {worker.rank: _file_size(worker.stack_path) for worker in workers}
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker.process.pid or -1, signal.SIGUSR1)
        # faulthandler writes from the signal handler itself, even while the main thread is blocked in C++; a short
        # poll until every file stops growing is enough. The limit is generous because on two busy cores a signalled
        # process can wait seconds to be scheduled; it is only ever paid on a failure.
        deadline = time.monotonic() + 6.0
        previous: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.05)
            current = {worker.rank: _file_size(worker.stack_path) for worker in workers}
            if current == previous and all(current[rank] > sizes[rank] for rank in current):
                break
            previous = current
        stacks = {}
        for worker in workers:
            with open(worker.stack_path, encoding="utf-8", errors="replace") as stack_file:
                stack_file.seek(sizes[worker.rank])
                stacks[worker.rank] = _without_worker_frames(stack_file.read())
        return stacks

    def _failure(self, function_name: str, headline: str, state: _RunState, kind: type[RankFailure]) -> RankFailure:
        """Kill the workers and build one exception that shows every failed or stuck rank's report."""
        self._stop_workers(kill=True)
        finished = sorted(state.values)
        lines = [
            headline,
            f"Ranks that finished fine: {finished or 'none'} of {self.world_size}. The pool restarts on the next run.",
        ]
        # When every rank fails the same way (the common case) show the traceback once, not once per rank.
        first_rank_with_details: dict[str, int] = {}
        for rank, (title, details) in sorted(state.reports.items()):
            if details in first_rank_with_details:
                lines.append(
                    f"{'=' * 20} rank {rank}: {title}, same as rank {first_rank_with_details[details]} {'=' * 20}"
                )
                continue
            first_rank_with_details[details] = rank
            lines.append(f"{'=' * 20} rank {rank}: {title} {'=' * 20}")
            if details:
                lines.append(details)
        rank_reports = {rank: f"{title}\n{details}" for rank, (title, details) in state.reports.items()}
        return kind("\n".join(lines), function_name, rank_reports, finished)

    # -- output -------------------------------------------------------------------------------------------------------

    def _relay_output(self, workers: list[_Worker] | None = None) -> None:
        """Copy what the workers printed since the last relay to our stderr (captured by pytest), prefixed by rank."""
        for worker in self._workers if workers is None else workers:
            try:
                with open(worker.log_path, "rb") as log_file:
                    log_file.seek(worker.log_offset)
                    text = log_file.read()
            except OSError:
                continue
            worker.log_offset += len(text)
            for line in text.decode("utf-8", errors="replace").splitlines():
                sys.stderr.write(f"[rank {worker.rank}] {line}\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------------------------------------------------------
# Helpers.
# ---------------------------------------------------------------------------------------------------------------------


class RankPools:
    """Lazily started pools, one per world size, shared by a whole test session (see ``tests/conftest.py``)."""

    def __init__(self, **pool_options: Any) -> None:
        self._pool_options = pool_options
        self._pools: dict[int, RankPool] = {}

    def get(self, world_size: int) -> RankPool:
        """The pool of ``world_size`` ranks, started on first use."""
        if world_size not in self._pools:
            self._pools[world_size] = RankPool(world_size, **self._pool_options)
        return self._pools[world_size]

    def close(self) -> None:
        """Close every pool started so far."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _importable_name(function: Callable[..., Any]) -> str:
    module_name = getattr(function, "__module__", None)
    qualified_name = getattr(function, "__qualname__", None)
    if not module_name or not qualified_name or "<" in qualified_name or module_name == "__main__":
        raise TypeError(
            f"RankPool.run needs a module-level function that workers can import by name, got {function!r}. "
            "Move it to a module such as tests/distributed/<feature>_bodies.py and pass arguments through run()."
        )
    return f"{module_name}.{qualified_name}"


def _summary(state: _RunState, rank: int) -> str:
    """One line saying how ``rank`` failed, for the first line of the message (what ``pytest -ra`` prints)."""
    title, details = state.reports[rank]
    if title == "raised" and details.strip():
        return details.strip().splitlines()[-1]  # The exception line, e.g. "ValueError: message".
    return title


def _describe_exit_code(exit_code: int | None) -> str:
    if exit_code is None:
        return "the process is gone but its exit code is unknown"
    if exit_code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by signal {signal.Signals(-exit_code).name} (exit code {exit_code})"
    return f"exit code {exit_code}"


def _tail(path: Path, offset: int) -> str:
    """The last lines a worker wrote since ``offset``, indented."""
    try:
        with open(path, "rb") as log_file:
            log_file.seek(offset)
            lines = log_file.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    return "\n".join("    " + line for line in lines[-_OUTPUT_TAIL_LINES:]) or "    <no output>"


def _without_worker_frames(stack: str) -> str:
    """Drop the frames of the pool's own request loop and of multiprocessing from a faulthandler dump.

    They sit below the body in every dump and say nothing about the test.
    """
    noise = (f'File "{__file__}"', f"{os.sep}multiprocessing{os.sep}", 'File "<string>"')
    return "\n".join(line for line in stack.rstrip().splitlines() if not any(marker in line for marker in noise))


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _free_port() -> int:
    """A currently free TCP port for ``MASTER_PORT``; Lightning reads it though rendezvous goes through a FileStore."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def _temporary_environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables while spawning, so the children's interpreters start with them."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
