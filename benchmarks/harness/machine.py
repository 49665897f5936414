"""What the machine is and how busy it is: CPU model, core count, versions, and system-wide CPU time.

[Note: measuring other processes' load]
``/proc/stat`` counts CPU time of the whole (virtual) machine. Over a window, the busy time of the machine
minus the CPU time of our own rank processes is what everything else used; divided by the window's wall time it
is the average number of cores other work took from us. Steal time (the hypervisor running someone else on our
virtual cores) counts as busy: it slows our ranks just the same. Linux only; elsewhere the load reads as unknown.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CpuTimes", "cpu_description", "git_revision", "quiet_load", "read_cpu_times", "software_versions"]

_PROC_STAT = Path("/proc/stat")
_PROC_CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuTimes:
    """System-wide CPU seconds since boot: busy (user, nice, system, irq, softirq, steal) and steal alone."""

    busy_seconds: float
    steal_seconds: float


def read_cpu_times() -> CpuTimes | None:
    """The machine's CPU seconds from ``/proc/stat``, or ``None`` where it cannot be read."""
    try:
        first_line = _PROC_STAT.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    fields = first_line.split()
    if not fields or fields[0] != "cpu" or len(fields) < 9:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(value) for value in fields[1:9])
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return CpuTimes(busy_seconds=busy / ticks_per_second, steal_seconds=steal / ticks_per_second)


def quiet_load(sample_seconds: float = 1.0) -> float | None:
    """Cores busy with other work, averaged over ``sample_seconds`` while this process sleeps."""
    before = read_cpu_times()
    own_before = time.process_time()
    start = time.perf_counter()
    time.sleep(sample_seconds)
    after = read_cpu_times()
    wall = time.perf_counter() - start
    if before is None or after is None:
        return None
    own = time.process_time() - own_before
    return max(0.0, after.busy_seconds - before.busy_seconds - own) / wall


def cpu_description() -> str:
    """CPU model name and number of logical cores, from ``/proc/cpuinfo`` where present."""
    model = platform.processor() or platform.machine()
    model_found = False
    cores = 0
    try:
        for line in _PROC_CPUINFO.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model_found:
                model, model_found = value.strip(), True
            if key.strip() == "processor":
                cores += 1
    except OSError:
        pass
    cores = cores or os.cpu_count() or 0
    return f"{model}, {cores} cores"


def software_versions() -> dict[str, str]:
    """Versions of Python, torch, Lightning and lightning_colossal."""
    import lightning
    import torch

    import lightning_colossal

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lightning": lightning.__version__,
        "lightning_colossal": lightning_colossal.__version__,
    }


def git_revision(directory: Path) -> str:
    """Short commit of the checkout at ``directory``, with ``+dirty`` when it has local changes; ``unknown``."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=directory, capture_output=True, text=True, check=True
        ).stdout.strip()
        changes = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if changes else "")
