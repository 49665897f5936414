"""The record of the collective in flight (``distributed/in_flight.py``): set and cleared around a collective,
frozen onto the exception of one that fails, activity labels nested and formatted only when reported, readable from
another thread; and the watchdog's heartbeat carrying it. The real timeouts are in
``tests/integration/test_hang_diagnostics.py``."""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from torch.distributed import HashStore

from lightning_colossal.distributed import in_flight
from lightning_colossal.distributed.in_flight import Activity, Collective, CollectiveRecord, RecordedWork
from lightning_colossal.distributed.watchdog import HeartbeatWatchdog
from lightning_colossal.gemini.hooks import _describe_round
from lightning_colossal.gemini.manager import describe_chunk
from lightning_colossal.strategies.failures import _where_it_failed


@pytest.fixture(autouse=True)
def nothing_in_flight():
    assert in_flight.current() is None and in_flight._this_thread.records.labels == []
    yield
    assert in_flight.current() is None and in_flight._this_thread.records.labels == []


def test_a_collective_is_recorded_while_it_runs_and_cleared_after():
    tensor = torch.zeros(4, 3, dtype=torch.float16)
    with Activity("reducing chunk {}", 5), Collective("all_reduce", None, tensor):
        record = in_flight.current()
    assert record is not None
    assert (record.name, record.shape, record.dtype, record.nbytes) == ("all_reduce", (4, 3), "float16", 24)
    assert record.activities == ("reducing chunk 5",) and record.seconds >= 0
    assert record.ranks is None  # no process group in this process


def test_a_collective_inside_another_puts_the_outer_one_back():
    with Collective("send", peer=1):
        with Collective("recv", peer=1):
            assert in_flight.current().name == "recv"
        assert in_flight.current().name == "send"


def test_a_failing_collective_leaves_its_record_on_the_exception():
    with pytest.raises(RuntimeError) as caught:
        with Activity("gathering chunk {}", 3), Collective("all_reduce", None, torch.zeros(10)):
            time.sleep(0.05)
            raise RuntimeError("Timed out waiting 3000ms for recv operation to complete")
    record = in_flight.record_of(caught.value)
    assert record is not None and record.name == "all_reduce" and record.shape == (10,)
    assert record.activities == ("gathering chunk 3",), "the labels are frozen before they are popped"
    assert record.seconds >= 0.05


def test_the_innermost_failing_collective_is_kept():
    # A waiting wrapper inside a blocking one (reduce_scatter_along waits on a handle): the inner one is the answer.
    with pytest.raises(RuntimeError) as caught:
        with Collective("outer"), Collective("inner"):
            raise RuntimeError("boom")
    assert in_flight.record_of(caught.value).name == "inner"


def test_the_original_failure_wins_over_one_raised_while_handling_it():
    with pytest.raises(RuntimeError) as caught:
        try:
            with Collective("all_reduce"):
                raise RuntimeError("timed out")
        except RuntimeError:
            with Collective("broadcast"):  # clean-up that communicates and fails again
                raise RuntimeError("Connection closed by peer") from None
    assert caught.value.__cause__ is None and caught.value.__context__ is not None
    assert in_flight.record_of(caught.value).name == "all_reduce"


def test_an_error_outside_our_collectives_has_no_record():
    assert in_flight.record_of(RuntimeError("Timed out")) is None


def test_activities_nest_and_are_formatted_only_when_reported():
    calls = []

    def describe(name):
        calls.append(name)
        return f"gathering {name}"

    with Activity("pipeline stage {}, micro-batch {}", 1, 3), Activity(describe, "chunk 2"):
        assert calls == []  # entering formats nothing
        with Collective("recv", peer=0):
            record = in_flight.current()
        assert in_flight._this_thread.records.labels[-1][0] is describe
    assert calls == ["chunk 2"]
    assert record.activities == ("pipeline stage 1, micro-batch 3", "gathering chunk 2")
    assert "while pipeline stage 1, micro-batch 3 > gathering chunk 2" in record.describe()


def test_a_label_that_fails_to_format_does_not_hide_the_report():
    def broken():
        raise RuntimeError("Set changed size during iteration")

    with Activity(broken), Collective("all_reduce"):
        record = in_flight.current()
    assert record.activities[0].startswith("<unavailable: RuntimeError(")


class _FakeWork:
    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.seen: CollectiveRecord | None = None

    def wait(self) -> bool:
        self.seen = in_flight.current()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return False


def test_an_asynchronous_collective_is_recorded_while_waited_for_with_its_launch_labels():
    work = _FakeWork()
    with Activity("reducing gradient bucket {} of {}", 2, 7):
        handle = RecordedWork(work, "reduce_scatter", None, torch.zeros(8))
    assert in_flight.current() is None, "a launched handle is not waited for yet"
    with Activity("end of backward"):
        assert handle.wait() is True
    assert work.seen.name == "reduce_scatter" and work.seen.activities == ("reducing gradient bucket 2 of 7",)
    assert handle.is_completed() is False


def test_a_failing_wait_leaves_the_launch_labels_on_the_exception():
    with Activity("reducing chunk {}", 5):
        handle = RecordedWork(_FakeWork(RuntimeError("timed out")), "all_reduce", None, torch.zeros(2))
    with pytest.raises(RuntimeError) as caught:
        handle.wait()
    assert in_flight.record_of(caught.value).activities == ("reducing chunk 5",)


def test_another_thread_reads_whole_records_while_the_main_thread_communicates():
    stop = threading.Event()
    seen: list[CollectiveRecord | None] = []
    errors: list[BaseException] = []

    def read() -> None:
        try:
            while not stop.is_set():
                seen.append(in_flight.current())
        except BaseException as error:  # any failure of the reader fails the test
            errors.append(error)

    reader = threading.Thread(target=read)
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, so the reader lands mid-update too
    reader.start()
    tensor = torch.zeros(3)
    try:
        for index in range(2_000):
            with Activity("reducing chunk {}", index), Collective("all_reduce", None, tensor):
                time.sleep(0)  # a real collective releases the GIL while it waits: let the reader in
            with Collective("broadcast", None, tensor, peer=0):
                pass
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(switch_interval)
    assert errors == []
    records = [record for record in seen if record is not None]
    assert records, "the reader never saw a collective (too few switches to test anything)"
    for record in records:
        assert (record.name, record.shape) in {("all_reduce", (3,)), ("broadcast", (3,))}
        if record.name == "broadcast":
            assert record.peer == 0
        # labels are copied whole: at most the one label, never a torn one
        assert all(label.startswith("reducing chunk ") for label in record.activities)


def test_record_texts():
    record = CollectiveRecord("all_reduce", (0, 1), (1170,), "float32", 4680, 3.04, ("gathering chunk 0 (a.weight)",))
    assert record.describe() == (
        "all_reduce over ranks [0, 1] ([1170] float32, 4.6 KiB) for 3.0 s, while gathering chunk 0 (a.weight)"
    )
    assert record.compact() == "all_reduce over [0, 1] for 3.0 s while gathering chunk 0 (a.weight)"
    assert len(CollectiveRecord("barrier", (0, 1), None, None, 0, 1.0, ("x" * 1000,)).compact()) == 240
    scalar = CollectiveRecord("all_reduce", (0, 1), (), "float32", 4, 0.1, ())
    assert scalar.describe() == "all_reduce over ranks [0, 1] (scalar float32, 4 bytes) for 0.1 s"
    receive = CollectiveRecord("recv", (2, 3), None, None, 0, 0.5, (), peer=0)
    assert receive.describe() == "recv from rank 2 over ranks [2, 3] for 0.5 s"
    assert in_flight.waiting_sentence(1, None) == f"rank 1 was {in_flight.OUTSIDE}"
    assert in_flight.waiting_sentence(0, receive).startswith("rank 0 was waiting in recv from rank 2")


def test_failure_notes_name_the_collective_or_say_there_was_none():
    with pytest.raises(RuntimeError) as caught:
        with Activity("reducing gradient bucket {} of {}", 1, 1), Collective("all_reduce", None, torch.zeros(2)):
            raise RuntimeError("Timed out waiting 3000ms")
    note = _where_it_failed(caught.value, rank=0, step=3, lost_peer=True)
    assert note.startswith("lightning_colossal: rank 0 was waiting in all_reduce over ranks ? ([2] float32, 8 bytes)")
    assert note.endswith(", while reducing gradient bucket 1 of 1, at global step 3.")
    outside = _where_it_failed(RuntimeError("Timed out"), rank=1, step=3, lost_peer=True)
    assert outside == f"lightning_colossal: raised on rank 1 at global step 3, {in_flight.OUTSIDE}."
    plain = _where_it_failed(ValueError("a bug in training_step"), rank=1, step=3, lost_peer=False)
    assert plain == "lightning_colossal: raised on rank 1 at global step 3."


def test_chunk_labels_name_the_first_parameter_and_the_count():
    members = tuple(SimpleNamespace(name=name) for name in ("blocks.2.attn.qkv.weight", "blocks.2.attn.qkv.bias"))
    chunk = SimpleNamespace(index=3, spec=SimpleNamespace(members=members))
    assert describe_chunk("gathering", chunk) == "gathering chunk 3 (blocks.2.attn.qkv.weight, ... 2 parameters)"
    assert describe_chunk("", chunk) == "chunk 3 (blocks.2.attn.qkv.weight, ... 2 parameters)"
    single = SimpleNamespace(index=0, spec=SimpleNamespace(members=members[:1]))
    assert (
        describe_chunk("reducing the gradients of", single)
        == "reducing the gradients of chunk 0 (blocks.2.attn.qkv.weight)"
    )
    chunks = [SimpleNamespace(index=index, spec=SimpleNamespace(members=members)) for index in range(5)]
    assert _describe_round(set(), chunks) == "agreeing which chunks to gather (this rank asks for none)"
    assert _describe_round({4, 0, 1, 2}, chunks) == (
        "agreeing which chunks to gather (this rank asks for chunk 0 (blocks.2.attn.qkv.weight, ... 2 parameters),"
        " chunk 1 (blocks.2.attn.qkv.weight, ... 2 parameters), chunk 2 (blocks.2.attn.qkv.weight, ... 2 parameters),"
        " ... 4 chunks)"
    )


# ---------------------------------------------------------------------------------------------- the watchdog
def _watchdog(store: HashStore, reports: list[str]) -> HeartbeatWatchdog:
    return HeartbeatWatchdog(
        store,
        rank=0,
        world_size=2,
        timeout=timedelta(seconds=60),
        current_step=lambda: 4,
        prefix="unit",
        interval=0.05,
        on_failure=reports.append,
    )


def _first_report(reports: list[str]) -> str:
    deadline = time.monotonic() + 5
    while not reports and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reports
    return reports[0]


def test_the_heartbeat_carries_the_collective_this_rank_is_in():
    store = HashStore()
    watchdog = _watchdog(store, [])
    with Activity("gathering chunk {}", 3), Collective("all_reduce"):
        watchdog._beat()
    counter, step, host, pid, collective = store.get("unit/rank0").decode().split(" ", 4)
    assert collective.startswith("all_reduce over ? for ") and collective.endswith(" s while gathering chunk 3")
    watchdog._beat()
    assert store.get("unit/rank0").decode().split(" ", 4)[4] == ""


def test_a_peer_report_says_what_the_stopped_rank_was_doing_and_what_this_rank_is_waiting_in():
    store, reports = HashStore(), []
    dead_pid = 2**22 + 12345
    store.set("unit/rank1", f"7 5 {os.uname().nodename} {dead_pid} all_reduce over [0, 1] while gathering chunk 3")
    watchdog = _watchdog(store, reports)
    with Collective("broadcast", None, torch.zeros(2), peer=1):
        watchdog.start()
        report = _first_report(reports)
    watchdog.stop()
    assert "rank 1 stopped responding (its process (pid" in report
    assert "it was at step 5, in all_reduce over [0, 1] while gathering chunk 3), seen by rank 0 at step 4" in report
    assert "; rank 0 was waiting in broadcast from rank 1 over ranks ? ([2] float32, 8 bytes) for " in report


def test_the_watched_peer_status_says_where_a_live_peer_is():
    store = HashStore()
    watchdog = _watchdog(store, [])
    assert watchdog.peer_status() is None  # nothing heard yet
    watchdog._judge_peer(f"3 5 {os.uname().nodename} {os.getpid()} all_reduce over [0, 1] for 1.0 s", time.monotonic())
    status = watchdog.peer_status()
    assert status.startswith("rank 1 (watched by rank 0) was at step 5, in all_reduce over [0, 1] for 1.0 s (heartbeat")
    watchdog._judge_peer(f"4 6 {os.uname().nodename} {os.getpid()} ", time.monotonic())
    assert watchdog.peer_status().startswith(
        f"rank 1 (watched by rank 0) was at step 6, {in_flight.NOT_IN_A_COLLECTIVE} (heartbeat"
    )
    watchdog._judge_peer("stopped", time.monotonic())
    assert watchdog.peer_status() == "rank 1 (watched by rank 0) had finished its run"


def test_an_old_style_heartbeat_without_a_collective_is_still_read():
    store, reports = HashStore(), []
    store.set("unit/rank1", f"7 5 {os.uname().nodename} {2**22 + 12345}")
    watchdog = _watchdog(store, reports).start()
    report = _first_report(reports)
    watchdog.stop()
    assert "(its process (pid" in report and "it was at step 5), seen by rank 0" in report
    assert f"rank 0 was {in_flight.OUTSIDE}" in report


def test_a_collective_on_another_thread_leaves_the_training_threads_record_alone():
    # A background checkpoint save's collectives run on their own thread: they must neither show as the training
    # thread's collective nor, on their way out, put back a record the training thread has left since.
    entered, main_left = threading.Event(), threading.Event()
    seen_on_the_thread: list[str | None] = []

    def background() -> None:
        with Activity("saving a checkpoint"), Collective("barrier"):
            entered.set()
            main_left.wait(5)
            record = in_flight.current()
            seen_on_the_thread.append(None if record is None else record.name)

    with Activity("reducing bucket {}", 2), Collective("all_reduce", None, torch.zeros(2)):
        thread = threading.Thread(target=background)
        thread.start()
        assert entered.wait(5)
        record = in_flight.current()
        assert record.name == "all_reduce" and record.activities == ("reducing bucket 2",)
    main_left.set()
    thread.join(5)
    # The training thread left its collective while the background one was still in its own: nothing in flight.
    assert in_flight.current() is None
    assert seen_on_the_thread == [None], "current() reports the training (main) thread's collective"
