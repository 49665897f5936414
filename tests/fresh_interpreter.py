"""Running Python in a fresh interpreter, for tests that must not share the pytest process's state.

Launcher and CUDA tests start their own processes (Lightning's launchers, a CUDA context, a process group) that
would leak into the pytest process or the rank pool. ``LOCAL_RANK`` is removed from the child's environment: set,
it would tell Lightning that the processes already exist and nothing should be launched.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPOSITORY_ROOT = Path(__file__).resolve().parents[1]


def run_python(
    arguments: list[str], directory: Path, timeout: float = 300, environment: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``python *arguments`` in ``directory`` with the repository importable (and ``environment`` added);
    output is captured as text."""
    child_environment = {
        **os.environ,
        "PYTHONPATH": str(REPOSITORY_ROOT),
        "PYTHONUNBUFFERED": "1",
        **(environment or {}),
    }
    child_environment.pop("LOCAL_RANK", None)
    return subprocess.run(
        [sys.executable, *arguments],
        cwd=directory,
        env=child_environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_script(directory: Path, source: str, *arguments: str, timeout: float = 600) -> str:
    """Write ``source`` to a script in ``directory``, run it with ``arguments``, assert success, return stdout."""
    script = directory / "fresh_interpreter_script.py"
    script.write_text(source)
    result = run_python([str(script), *arguments], directory, timeout=timeout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result.stdout


def launch_to_log(arguments: list[str], directory: Path, log: Path, timeout: float) -> int:
    """Run ``python *arguments`` in ``directory`` (repository importable), output to ``log``; return the exit code of
    that process alone.

    A file, not a pipe: ranks the process started may outlive it (frozen, or not yet reaped), keep their copy of the
    output open, and waiting for a pipe's end (as ``subprocess.run`` does) would wait for them too.
    """
    environment = {**os.environ, "PYTHONPATH": str(REPOSITORY_ROOT), "PYTHONUNBUFFERED": "1"}
    environment.pop("LOCAL_RANK", None)
    with open(log, "w") as output_file:
        process = subprocess.Popen(
            [sys.executable, *arguments], cwd=directory, env=environment, stdout=output_file, stderr=subprocess.STDOUT
        )
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
