"""The writer process of background saves (``checkpoint/writer_process.py``, ``writer_child.py``), in one process.

The saves of a real fit through it, and a training process killed while it writes, are in
tests/distributed/test_async_checkpoint.py.
"""

from __future__ import annotations

import os
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from lightning_colossal.checkpoint import async_save, writer_child, writer_process
from lightning_colossal.checkpoint.sharded import read_sharded, save_sharded

pytestmark = pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="shared memory files need /dev/shm (Linux)")


@pytest.fixture(scope="module", autouse=True)
def one_writer_process_for_the_module():
    """The tests share a writer process (each start imports torch, seconds); it ends with the module."""
    yield
    async_save.wait_for_background_save()
    writer_process.stop()


def a_state() -> dict:
    weight = torch.randn(33, 7)
    return {
        "model": {
            "weight": weight,
            "tied": weight,
            "transposed": torch.randn(5, 9).t(),
            "half": torch.randn(11).half(),
        },
        "optimizer_0": {
            "state": {"weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(33, 7), "flags": torch.arange(4)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["weight"]}],
        },
        "empty": torch.empty(0, 3),
    }


def our_shared_memory() -> list[str]:
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"torch_{os.getpid()}_"))


def assert_same(first, second, where="state"):
    if isinstance(first, torch.Tensor):
        assert isinstance(second, torch.Tensor) and first.dtype == second.dtype, where
        torch.testing.assert_close(first, second, rtol=0, atol=0, msg=where)
    elif isinstance(first, dict):
        assert first.keys() == second.keys(), where
        for key in first:
            assert_same(first[key], second[key], f"{where}.{key}")
    elif isinstance(first, (list, tuple)):
        assert len(first) == len(second), where
        for index, (one, other) in enumerate(zip(first, second, strict=True)):
            assert_same(one, other, f"{where}[{index}]")
    else:
        assert first == second, where


def test_a_background_save_through_the_writer_process_holds_what_a_synchronous_save_holds(tmp_path):
    state = a_state()
    save_sharded(tmp_path / "sync.ckpt", state, {"epoch": 1})
    assert writer_process.start() is not None
    save = async_save.save_in_background(tmp_path / "async.ckpt", state, {"epoch": 1}, None, timedelta(seconds=60))
    for tensor in (state["model"]["weight"], state["optimizer_0"]["state"]["weight"]["exp_avg"]):
        tensor.add_(1.0)  # training goes on: the save holds the values of the call
    async_save.wait_for_background_save()
    assert save.error is None
    assert_same(read_sharded(tmp_path / "async.ckpt"), read_sharded(tmp_path / "sync.ckpt"))
    kept = our_shared_memory()
    assert len(kept) == 7, "one buffer per staged tensor (the tied one once), kept for the next save"
    save_sharded(tmp_path / "sync.ckpt", state, {"epoch": 2})
    async_save.save_in_background(tmp_path / "async.ckpt", state, {"epoch": 2}, None, timedelta(seconds=60))
    async_save.wait_for_background_save()
    assert_same(read_sharded(tmp_path / "async.ckpt"), read_sharded(tmp_path / "sync.ckpt"))
    assert our_shared_memory() == kept, "the next save reuses the buffers"
    free = writer_process.shared_memory_free_bytes
    try:  # the buffers kept count as room: a full /dev/shm still takes a save that reuses them all
        writer_process.shared_memory_free_bytes = lambda: 0
        writer_process._service.warned.discard("room")
        assert writer_process.room_for(async_save.staged_bytes(state), ranks_per_node=8)
        with pytest.warns(UserWarning, match="more bytes of shared memory"):
            assert not writer_process.room_for(async_save.staged_bytes(state) + 4096, ranks_per_node=8)
    finally:
        writer_process.shared_memory_free_bytes = free
    async_save.finish_background_saves()  # the end of a fit frees them, here and in the writer process
    shards = sorted(path.name for path in (tmp_path / "async.ckpt.shards").iterdir())
    assert len(shards) == 1 and sorted(p.name for p in (tmp_path / "async.ckpt.shards" / shards[0]).iterdir()) == [
        ".metadata",
        "__0_0.distcp",
    ], "the writer process writes DCP's own files"
    deadline = time.monotonic() + 10
    while our_shared_memory():
        assert time.monotonic() < deadline, f"staged copies left in shared memory: {our_shared_memory()}"
        time.sleep(0.05)


def test_tensors_staged_elsewhere_are_copied_into_shared_memory_when_written(tmp_path):
    """Copies from an accelerator are staged in pinned memory, not shared memory; the writer copies those at write
    time. Staging into plain memory stands in for it here."""
    state = a_state()
    save_sharded(tmp_path / "sync.ckpt", state, {})
    process = writer_process.start()
    assert process is not None
    staging = writer_process.staging()
    staged = async_save.stage(state)  # plain host memory, as beside an accelerator
    save_sharded(
        tmp_path / "copied.ckpt",
        staged,
        {},
        storage_writer=lambda directory: writer_process.ProcessShardWriter(directory, process, staging),
    )
    assert_same(read_sharded(tmp_path / "copied.ckpt"), read_sharded(tmp_path / "sync.ckpt"))


def one_job(directory: Path, staging: writer_process.SharedStaging) -> tuple[writer_child.Job, torch.Tensor]:
    """A job of one tensor for ``directory``, planned by DCP's default planner, and that tensor (which must live
    until the job is written)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import _StoragePrefix

    weight = staging.host_buffer(6, torch.float32, torch.device("cpu"))
    weight.copy_(torch.arange(6.0))
    planner = DefaultSavePlanner()
    planner.set_up_planner({"weight": weight}, is_coordinator=True)
    items = planner.create_local_plan().items
    job = writer_child.Job(str(directory), _StoragePrefix("__0_"), items, [staging.shipped(weight) for _ in items])
    return job, weight


def test_a_job_travels_without_naming_the_package(tmp_path):
    """The writer process imports torch only: a message naming ``lightning_colossal`` would import the package (and
    Lightning) there when unpickled."""
    import pickle

    job, weight = one_job(tmp_path, writer_process.staging())
    message = writer_child.to_message(job)
    assert b"lightning_colossal" not in pickle.dumps(message)
    assert writer_child.from_message(message) == job


def test_a_failure_in_the_writer_process_is_raised_with_its_cause_and_the_process_serves_on(tmp_path):
    process = writer_process.start()
    assert process is not None
    staging = writer_process.staging()
    not_a_directory = tmp_path / "a_file"
    not_a_directory.write_text("where the shards' directory should be")
    job, weight = one_job(not_a_directory, staging)
    with pytest.raises(writer_process.WriterProcessFailed, match=r"NotADirectoryError: .*in the checkpoint writer"):
        process.write(job)
    assert process.alive()
    job, weight = one_job(tmp_path, staging)
    results = process.write(job)
    assert [result.storage_data.relative_path for result in results] == ["__0_0.distcp"]
    assert (tmp_path / "__0_0.distcp").stat().st_size > 6 * 4


def test_a_writer_process_that_dies_is_replaced_once_per_save_and_a_second_death_fails_the_save(tmp_path):
    path = tmp_path / "last.ckpt"
    save_sharded(path, {"model": {"weight": torch.zeros(8)}}, {"epoch": 0})

    def save(value: float) -> None:
        async_save.save_in_background(
            path, {"model": {"weight": torch.full((8,), value)}}, {"epoch": value}, None, timedelta(seconds=60)
        )
        async_save.wait_for_background_save()

    process = writer_process.start()
    assert process is not None
    process.wait_until_ready()
    os.kill(process.pid, signal.SIGKILL)  # between saves
    save(1.0)
    assert torch.equal(read_sharded(path)["model"]["weight"], torch.ones(8))
    assert writer_process.start().pid != process.pid

    served_by: list[int] = []
    kills: list[int] = []
    original_write = writer_process.WriterProcess.write

    def killed_while_writing(self, job):
        if len(kills) < deaths:
            kills.append(self.pid)
            os.kill(self.pid, signal.SIGKILL)
        served_by.append(self.pid)
        return original_write(self, job)

    writer_process.WriterProcess.write = killed_while_writing  # type: ignore[method-assign]
    try:
        deaths = 1
        save(2.0)  # written by the process started in place of the killed one
        assert torch.equal(read_sharded(path)["model"]["weight"], torch.full((8,), 2.0))
        assert len(set(served_by)) == 2 and served_by[-1] not in kills
        deaths, kills[:] = 2, []
        with pytest.raises(async_save.BackgroundSaveError, match=r"writer process .* ended with exit code -9") as error:
            save(3.0)
    finally:
        writer_process.WriterProcess.write = original_write  # type: ignore[method-assign]
    assert str(path) in str(error.value) and len(kills) == 2
    assert torch.equal(read_sharded(path)["model"]["weight"], torch.full((8,), 2.0)), "the previous checkpoint stays"
    save(4.0)  # and the next save is written again
    assert torch.equal(read_sharded(path)["model"]["weight"], torch.full((8,), 4.0))


def test_too_little_shared_memory_writes_on_the_thread_and_says_how_to_get_more(tmp_path, monkeypatch):
    monkeypatch.setattr(writer_process, "shared_memory_free_bytes", lambda: 1024)
    monkeypatch.setattr(writer_process._service, "warned", set())
    started = []
    monkeypatch.setattr(writer_process, "start", lambda: started.append(True))
    state = a_state()
    with pytest.warns(UserWarning, match=r"--shm-size"):
        async_save.save_in_background(tmp_path / "last.ckpt", state, {}, None, timedelta(seconds=60), ranks_per_node=2)
    async_save.wait_for_background_save()
    assert started == [], "no writer process was asked for"
    save_sharded(tmp_path / "sync.ckpt", state, {})
    assert_same(read_sharded(tmp_path / "last.ckpt"), read_sharded(tmp_path / "sync.ckpt"))


def test_the_room_needed_counts_every_rank_of_the_node(monkeypatch):
    # none kept from other tests
    monkeypatch.setattr(writer_process._service, "buffers", writer_process.SharedBuffers())
    monkeypatch.setattr(writer_process._service, "warned", {"room"})
    monkeypatch.setattr(writer_process, "shared_memory_free_bytes", lambda: 1000)
    assert writer_process.room_for(500, ranks_per_node=2)
    assert not writer_process.room_for(501, ranks_per_node=2)
    # weight (once, though saved under two names), transposed, half, step, exp_avg, flags, empty
    expected = 33 * 7 * 4 + 45 * 4 + 11 * 2 + 4 + 33 * 7 * 4 + 4 * 8 + 0
    assert async_save.staged_bytes(a_state()) == expected


def test_without_shared_memory_saves_are_written_on_the_thread_quietly(tmp_path, monkeypatch):
    """macOS and Windows have no /dev/shm: the thread writes, as it always did there, and nothing warns."""
    monkeypatch.setattr(writer_process, "shared_memory_free_bytes", lambda: None)
    monkeypatch.setattr(writer_process._service, "warned", set())
    monkeypatch.setattr(writer_process, "start", lambda: pytest.fail("no writer process is asked for"))
    state = a_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async_save.save_in_background(tmp_path / "last.ckpt", state, {}, None, timedelta(seconds=60))
        async_save.wait_for_background_save()
    assert not [warning for warning in caught if "writer process" in str(warning.message)]
    save_sharded(tmp_path / "sync.ckpt", state, {})
    assert_same(read_sharded(tmp_path / "last.ckpt"), read_sharded(tmp_path / "sync.ckpt"))


def test_a_writer_process_whose_training_process_ended_before_it_was_ready_exits_quietly():
    """A run that fails at its first step closes the pipes while the child still imports torch: the child's READY
    then meets a closed pipe, which must not print a BrokenPipeError traceback under the run's real error."""
    import subprocess
    import sys

    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    os.close(parent_reads)  # the training process is gone before the child says it is ready
    child = subprocess.Popen(
        [sys.executable, writer_child.__file__, str(child_reads), str(child_writes)],
        pass_fds=(child_reads, child_writes),
        stdin=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
    )
    os.close(child_reads), os.close(child_writes)
    try:
        _, errors = child.communicate(timeout=120)
    finally:
        os.close(parent_writes)
    assert child.returncode == 0
    assert b"Traceback" not in errors and b"BrokenPipeError" not in errors, errors.decode()
