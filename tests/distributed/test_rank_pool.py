"""Self-tests of the rank pool: results, environment, isolation between runs, and every failure path.

The failure tests restart the shared pool (a few seconds each), so there are few of them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import rank_pool_bodies
from tests.harness.rank_pool import REPOSITORY_ROOT, RankFailure, RankPool, RankTimeout


def test_all_reduce_on_two_ranks(rank_pool_2: RankPool) -> None:
    assert rank_pool_2.run(rank_pool_bodies.all_reduce_rank_plus_one) == [[3.0, 30.0]] * 2


def test_all_reduce_on_four_ranks(rank_pool_4: RankPool) -> None:
    assert rank_pool_4.run(rank_pool_bodies.all_reduce_rank_plus_one) == [[10.0, 100.0]] * 4


def test_arguments_reach_every_rank(rank_pool_2: RankPool, tmp_path: Path) -> None:
    results = rank_pool_2.run(rank_pool_bodies.return_rank_and_arguments, 1, "two", directory=str(tmp_path))
    assert results == [(rank, (1, "two"), {"directory": str(tmp_path)}) for rank in range(2)]


def test_workers_have_rank_environment_and_one_thread(rank_pool_2: RankPool) -> None:
    descriptions = rank_pool_2.run(rank_pool_bodies.describe_worker)
    assert len({description["process_id"] for description in descriptions} | {os.getpid()}) == 3
    for rank, description in enumerate(descriptions):
        assert description["rank"] == rank
        assert description["world_size"] == 2
        assert description["backend"] == "gloo"
        assert description["num_threads"] == 1
        assert description["repository_on_path"]
        environment = description["environment"]
        assert environment["LOCAL_RANK"] == environment["RANK"] == str(rank)
        assert environment["WORLD_SIZE"] == "2"
        assert environment["NODE_RANK"] == "0"
        assert environment["MASTER_ADDR"] == "127.0.0.1"
        assert environment["MASTER_PORT"] == descriptions[0]["environment"]["MASTER_PORT"]
        assert environment["OMP_NUM_THREADS"] == "1"


def test_one_rank_pool_runs_in_a_worker_process(rank_pool_1: RankPool) -> None:
    (description,) = rank_pool_1.run(rank_pool_bodies.describe_worker)
    assert description["process_id"] != os.getpid()
    assert (description["rank"], description["world_size"]) == (0, 1)
    assert rank_pool_1.run(rank_pool_bodies.all_reduce_rank_plus_one) == [[1.0, 10.0]]


def test_worker_output_is_relayed_with_rank_prefix(rank_pool_2: RankPool, capsys: pytest.CaptureFixture[str]) -> None:
    rank_pool_2.run(rank_pool_bodies.print_greeting)
    captured = capsys.readouterr().err
    for rank in range(2):
        assert f"[rank {rank}] greeting on stdout from rank {rank}" in captured
        assert f"[rank {rank}] greeting on stderr from rank {rank}" in captured


def test_process_state_is_reset_between_runs(rank_pool_2: RankPool) -> None:
    process_ids = rank_pool_2.process_ids
    rank_pool_2.run(rank_pool_bodies.change_process_state)
    for state in rank_pool_2.run(rank_pool_bodies.describe_process_state):
        assert state["default_dtype"] == torch.float32
        assert state["grad_enabled"]
        assert state["leaked_variable"] is None
        assert state["world_size_variable"] == "2"
        assert state["working_directory"] != "/"
        assert state["num_process_groups"] == 1  # The subgroup was destroyed; the default group kept.
    assert rank_pool_2.process_ids == process_ids  # Reset, not restarted.


def test_rejects_what_workers_cannot_receive(rank_pool_2: RankPool) -> None:
    process_ids = rank_pool_2.process_ids

    def local_body() -> None:
        pass

    with pytest.raises(TypeError, match="module-level function"):
        rank_pool_2.run(local_body)
    with pytest.raises(TypeError, match="module-level function"):
        rank_pool_2.run(lambda: None)
    with pytest.raises(TypeError, match="cannot be pickled"):
        rank_pool_2.run(rank_pool_bodies.return_rank_and_arguments, threading.Lock())
    assert rank_pool_2.process_ids == process_ids  # Rejected in the parent: the pool was not disturbed.


def test_exception_on_one_rank_reports_its_traceback_and_restarts_the_pool(
    rank_pool_2: RankPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Rank 0 will wait in a barrier for the failed rank 1 until the grace period ends; keep that wait short.
    monkeypatch.setattr(rank_pool_2, "failure_grace", 1.0)
    process_ids = rank_pool_2.process_ids
    started_at = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        rank_pool_2.run(rank_pool_bodies.raise_on_rank_one, timeout=60.0)
    elapsed = time.monotonic() - started_at
    message = str(failure.value)
    assert "failed on ranks [1]" in message
    assert 'in raise_on_rank_one\n    raise ValueError("rank one fails on purpose")' in message
    assert "ValueError: rank one fails on purpose" in message
    # Rank 0 is stuck in the barrier: the message shows where, from its stack dump.
    assert "rank 0: still running 1.0 s after the failure" in message
    assert "in raise_on_rank_one" in failure.value.rank_reports[0]
    assert failure.value.finished_ranks == []
    assert elapsed < 1.0 + 5.0
    assert rank_pool_2.run(rank_pool_bodies.all_reduce_rank_plus_one) == [[3.0, 30.0]] * 2
    assert set(rank_pool_2.process_ids).isdisjoint(process_ids)


def test_hang_times_out_with_the_stack_of_every_rank(rank_pool_2: RankPool) -> None:
    started_at = time.monotonic()
    with pytest.raises(RankTimeout) as failure:
        rank_pool_2.run(rank_pool_bodies.hang_on_rank_zero, timeout=2.0)
    elapsed = time.monotonic() - started_at
    assert 2.0 <= elapsed < 2.0 + 4.0
    assert "hang_on_rank_zero timed out after 2.0 s on ranks [0, 1]" in str(failure.value)
    for rank in range(2):
        assert "in hang_on_rank_zero" in failure.value.rank_reports[rank]
    assert rank_pool_2.run(rank_pool_bodies.all_reduce_rank_plus_one) == [[3.0, 30.0]] * 2


def test_worker_that_exits_is_reported_with_its_exit_code(rank_pool_2: RankPool) -> None:
    with pytest.raises(RankFailure) as failure:
        rank_pool_2.run(rank_pool_bodies.exit_on_rank_one, 3)
    message = str(failure.value)
    assert "rank 1: died: exit code 3" in message
    assert "rank one is about to exit" in message  # The tail of its output.
    assert failure.value.finished_ranks == [0]
    assert rank_pool_2.run(rank_pool_bodies.all_reduce_rank_plus_one) == [[3.0, 30.0]] * 2


def test_lightning_trainer_reuses_the_pool_process_group(rank_pool_2: RankPool, tmp_path: Path) -> None:
    results = rank_pool_2.run(rank_pool_bodies.fit_boring_model_with_ddp, str(tmp_path), timeout=120.0)
    for rank, result in enumerate(results):
        assert result["trainer_world_size"] == 2
        assert result["trainer_global_rank"] == rank
        assert result["global_step"] == 2
        assert result["same_process_group"]
    assert results[0]["weight_checksum"] == results[1]["weight_checksum"]


def test_workers_exit_when_their_parent_is_killed(tmp_path: Path) -> None:
    """A pytest killed by SIGKILL runs no cleanup; its workers must still go away, even mid-body."""
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(REPOSITORY_ROOT)!r})
        from tests.harness.rank_pool import RankPool
        pool = RankPool(1)
        print(pool.process_ids[0], flush=True)
        pool.run(time.sleep, 3600)
        """
    )
    # TMPDIR: the killed parent cannot delete its pool's temporary directory; keep it inside tmp_path.
    environment = {**os.environ, "TMPDIR": str(tmp_path)}
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=environment
    )
    try:
        worker_process_id = int(parent.stdout.readline()) if parent.stdout else -1
        assert _is_running(worker_process_id)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10.0
    while _is_running(worker_process_id) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_running(worker_process_id)


def test_close_stops_workers_and_removes_temporary_files() -> None:
    pool = RankPool(1)
    (process_id,) = pool.process_ids
    root_directory = pool._root_directory
    pool.close()
    assert not _is_running(process_id)
    assert not root_directory.exists()
    with pytest.raises(RuntimeError, match="closed"):
        pool.run(rank_pool_bodies.describe_worker)


def _is_running(process_id: int) -> bool:
    """Whether the process exists and is not a zombie (a container's init may never reap it)."""
    try:
        with open(f"/proc/{process_id}/stat") as stat_file:
            return stat_file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False
