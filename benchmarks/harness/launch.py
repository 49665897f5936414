"""Launching benchmark ranks and judging the machine's quiet, shared by every study under ``benchmarks/``.

``launch_ranks`` starts ``python -m <module>`` as N ranks joined through the environment (one thread each), waits for
all and stops all on the first failure; ``wait_for_quiet`` and ``window_other_load`` say how much other work shared the
cores (see the Note in ``benchmarks/harness/machine.py``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness.machine import quiet_load

REPOSITORY_ROOT = Path(__file__).resolve().parents[2]
_LOG_TAIL_CHARACTERS = 4000


class RunFailed(RuntimeError):
    """A rank exited with an error, or the run ran past its timeout."""


# ---------------------------------------------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on this host now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    environment = dict(os.environ)
    environment.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        # One thread per rank: the ranks share the cores, and more threads per rank only contend.
        OMP_NUM_THREADS="1",
        # Fewer glibc arenas keep RSS closer to what the tensors use.
        MALLOC_ARENA_MAX="2",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPOSITORY_ROOT), os.environ.get("PYTHONPATH")])),
    )
    return environment


def _kill(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Kill every rank we started and whatever it started (each rank leads its own process group)."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for process in processes:
        process.wait()


def _log_tails(log_paths: Sequence[Path]) -> str:
    tails = []
    for rank, path in enumerate(log_paths):
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        tails.append(
            f"--- rank {rank} log (last {_LOG_TAIL_CHARACTERS} characters) ---\n{text[-_LOG_TAIL_CHARACTERS:]}"
        )
    return "\n".join(tails)


def launch_ranks(module: str, arguments: Sequence[str], world_size: int, directory: Path, timeout: float) -> int:
    """Run ``python -m module *arguments`` as ``world_size`` ranks joined through the environment; wait for all.

    Each rank logs to ``directory/rank<R>.log``. Returns the ``MASTER_PORT`` the ranks used.

    Raises:
        RunFailed: a rank failed or the ranks passed ``timeout`` seconds; the message holds every rank's log tail.
    """
    log_paths = [directory / f"rank{rank}.log" for rank in range(world_size)]
    port = free_port()
    deadline = time.perf_counter() + timeout
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for rank, log_path in enumerate(log_paths):
            with open(log_path, "wb") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, "-m", module, *arguments],
                        cwd=REPOSITORY_ROOT,
                        env=_rank_environment(rank, world_size, port),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        while any(process.poll() is None for process in processes):
            # One failed rank leaves the others waiting in a collective: stop them all at once.
            if any(process.returncode not in (None, 0) for process in processes):
                break
            if time.perf_counter() > deadline:
                _kill(processes)
                raise RunFailed(f"{module} passed its {timeout:.0f} s timeout.\n{_log_tails(log_paths)}")
            time.sleep(0.1)
    finally:
        _kill(processes)
    return_codes = [process.returncode for process in processes]
    if any(code != 0 for code in return_codes):
        raise RunFailed(f"{module} failed, return codes {return_codes}.\n{_log_tails(log_paths)}")
    return port


def window_other_load(ranks: Sequence[dict[str, Any]]) -> float | None:
    """Cores other processes used during the measured steps: the machine's busy time over rank 0's window less
    every rank's own CPU time, per second of the window (see the Note in ``benchmarks/harness/machine.py``)."""
    window = ranks[0]["window"]
    busy = window["system_busy_seconds"]
    if busy != busy:  # NaN: /proc/stat was unreadable
        return None
    own = sum(rank["window"]["process_cpu_seconds"] for rank in ranks)
    return max(0.0, busy - own) / window["wall_seconds"]


def wait_for_quiet(max_load: float, patience: float) -> float | None:
    """Sample other processes' load until it is at most ``max_load`` or ``patience`` seconds passed."""
    start = time.perf_counter()
    # Several seconds: the other work on these machines comes in bursts that a one-second sample misses.
    load = quiet_load(sample_seconds=3.0)
    if load is None or load <= max_load:
        return load
    print(f"    waiting for a quiet machine: other load {load:.2f} cores > {max_load}", flush=True)
    while load is not None and load > max_load and time.perf_counter() - start < patience:
        time.sleep(2.0)
        load = quiet_load(sample_seconds=3.0)
    load_text = "unknown" if load is None else f"{load:.2f}"
    print(f"    waited {time.perf_counter() - start:.0f} s; other load now {load_text} cores", flush=True)
    return load
