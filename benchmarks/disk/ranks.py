"""The body of one disk-study rank: ``python -m benchmarks.disk.ranks --spec spec.json``.

``benchmarks.disk`` starts one of these per rank (``benchmarks.harness.launch.launch_ranks``: ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``, ``OMP_NUM_THREADS=1``). The spec's ``task`` says what it does:

- ``bandwidth``: sequential writes then reads through the disk tier's own file (``lightning_colossal.disk.files``:
  ``TierFile``, ``O_DIRECT``, ``BLOCK_BYTES`` per call, aligned buffers), every rank at once when there are several
  (a gloo barrier starts them together), in transfers of each given size; also reads and writes at the same time on
  two threads, as the streamed optimizer step issues them;
- ``speed``: trains the demo GPT under the spec's strategy and times every step, the optimizer step inside it
  (``precision_plugin.optimizer_stepper``, what the strategy calls to step) and, with the disk tier, where the
  optimizer step's time goes (``StepProfile``).

Each rank writes ``rank<RANK>.json``; a rank that raised writes the error there before failing.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader

from benchmarks.capacity.ranks import strategy_arguments
from benchmarks.harness.machine import read_cpu_times
from benchmarks.harness.workload import BenchmarkModule, build_strategy, parameter_count, train_on_cpu
from lightning_colossal.demo.data import RandomTokenDataset
from lightning_colossal.demo.model import GPTConfig
from lightning_colossal.disk import optimizer_state
from lightning_colossal.disk.files import BLOCK_BYTES, TierDirectory, TierFile, aligned_buffer

MIB = 2**20


# ---------------------------------------------------------------------------------------------------------------
# Host memory of this process
# ---------------------------------------------------------------------------------------------------------------


def host_memory() -> dict[str, int]:
    """This process's resident set now and at its peak (``/proc/self/status``: VmRSS, VmHWM), in bytes."""
    figures = {"rss_bytes": 0, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                figures["rss_bytes" if key == "VmRSS" else "peak_rss_bytes"] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return figures


def disk_traffic_bytes() -> dict[str, int]:
    """Bytes read and written so far by every block device of the machine (``/proc/diskstats``, 512-byte sectors;
    whole disks only: loop, RAM and device-mapper devices and partitions are left out). Over a window, less the tier's
    own bytes, it is what other processes made the disk do meanwhile."""
    totals = {"read_bytes": 0, "written_bytes": 0}
    try:
        lines = Path("/proc/diskstats").read_text().splitlines()
    except OSError:
        return totals
    for line in lines:
        fields = line.split()
        if len(fields) < 10:
            continue
        name = fields[2]
        if name.startswith(("loop", "ram", "zram", "dm-", "sr")) or not Path(f"/sys/block/{name}").exists():
            continue
        totals["read_bytes"] += int(fields[5]) * 512
        totals["written_bytes"] += int(fields[9]) * 512
    return totals


def reset_peak_rss() -> None:
    """Start this process's peak RSS (VmHWM) afresh from its RSS now (Linux: ``/proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# Bandwidth
# ---------------------------------------------------------------------------------------------------------------


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sequential(tier: TierFile, buffer: torch.Tensor, total: int, transfer: int, writing: bool) -> float:
    """Seconds to move ``total`` bytes at offset 0.. in calls of ``transfer`` bytes (each split by the tier into
    ``BLOCK_BYTES`` pieces); a write ends with ``fsync`` (what ``lightning_colossal.disk.bandwidth`` does)."""
    start = time.perf_counter()
    _move(tier, buffer, total, transfer, writing)
    if writing:
        os.fsync(tier._buffered)
    return time.perf_counter() - start


def _move(tier: TierFile, buffer: torch.Tensor, total: int, transfer: int, writing: bool) -> None:
    """``total`` bytes at offset 0.. through ``buffer``, in synchronous calls of ``transfer`` bytes."""
    for offset in range(0, total, transfer):
        piece = buffer[: min(transfer, total - offset)]
        if writing:
            tier.write_now(offset, piece)
        else:
            tier.read_now(offset, piece)


def _duplex(
    read_tier: TierFile, write_tier: TierFile, buffers: tuple[torch.Tensor, torch.Tensor], total: int, transfer: int
) -> dict[str, float]:
    """Read ``total`` bytes from one file while writing ``total`` to another on a second thread (the streamed step's
    pattern: the next record read while the previous one is written); seconds of each and of both."""
    times: dict[str, float] = {}

    def run(name: str, tier: TierFile, buffer: torch.Tensor, writing: bool) -> None:
        start = time.perf_counter()
        _move(tier, buffer, total, transfer, writing)
        times[name] = time.perf_counter() - start

    start = time.perf_counter()
    threads = [
        threading.Thread(target=run, args=("read_seconds", read_tier, buffers[0], False)),
        threading.Thread(target=run, args=("write_seconds", write_tier, buffers[1], True)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    times["both_seconds"] = time.perf_counter() - start
    return times


def measure_case(
    tiers: tuple[TierFile, TierFile | None],
    buffers: tuple[torch.Tensor, torch.Tensor],
    total: int,
    transfer: int,
    rounds: int,
    barrier: Callable[[], None],
) -> list[dict[str, Any]]:
    """``rounds`` passes of: write ``total`` bytes, read them back, and (with a second file) read and write at once;
    every rank starts each pass together with the others (``barrier``) and times its own bytes."""
    tier, second = tiers
    source, sink = buffers
    passes = []
    for _ in range(rounds):
        barrier()
        write = _sequential(tier, source, total, transfer, writing=True)
        barrier()
        read = _sequential(tier, sink, total, transfer, writing=False)
        figures: dict[str, Any] = {"write_seconds": write, "read_seconds": read}
        if second is not None:
            barrier()
            figures["duplex"] = _duplex(tier, second, (sink, source), total, transfer)
        passes.append(figures)
    barrier()
    return passes


def _tier_files(directory: TierDirectory, total: int, count: int) -> tuple[list[TierFile], torch.Tensor, torch.Tensor]:
    """``count`` tier files of ``total`` bytes each, written through once (reads never meet unwritten extents), and
    two aligned buffers of that size (random bytes to write, room to read into)."""
    source = aligned_buffer(total)
    source.random_(0, 255)
    sink = aligned_buffer(total)
    files = []
    for index in range(count):
        tier = TierFile(directory, f"bandwidth{index}.bin")
        tier.reserve(total)
        tier.allocate()
        _sequential(tier, source, total, BLOCK_BYTES, writing=True)
        files.append(tier)
    return files, source, sink


def bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    """Every (total, transfer) case of the spec, ``rounds`` passes each (``measure_case``)."""
    directory = TierDirectory(spec["offload_dir"], rank=int(os.environ["RANK"]))
    cases = []
    try:
        (tier, second), source, sink = _tier_files(directory, max(spec["totals_bytes"]), 2)
        for total in spec["totals_bytes"]:
            for transfer in spec["transfers_bytes"]:
                rounds = measure_case((tier, second), (source, sink), total, transfer, spec["rounds"], _barrier)
                cases.append({"total_bytes": total, "transfer_bytes": transfer, "rounds": rounds})
        direct = tier.direct_io
        tier.close()
        second.close()
    finally:
        directory.close()
    return {"direct_io": direct, "block_bytes": BLOCK_BYTES, "cases": cases}


def launch_bandwidth(trainer: Trainer, spec: dict[str, Any]) -> dict[str, Any] | None:
    """Inside a speed launch with the disk tier: this disk's bandwidth with both ranks at once now, in calls of the
    tier's record size (the I/O bound of this launch's steps; the disk's speed drifts over minutes on a shared
    machine). ``None`` without the disk tier."""
    state = getattr(getattr(trainer.strategy, "engine", None), "disk_state", None)
    if state is None:
        return None
    total, transfer = spec["bound_total_bytes"], max(state.slot_bytes, 4096)
    transfer = -(-transfer // 4096) * 4096
    directory = TierDirectory(spec["offload_dir"], rank=trainer.global_rank)
    try:
        (tier,), source, sink = _tier_files(directory, total, 1)
        passes = measure_case(
            (tier, None), (source, sink), total, transfer, spec["bound_rounds"], trainer.strategy.barrier
        )
        tier.close()
    finally:
        directory.close()
    return {"total_bytes": total, "transfer_bytes": transfer, "rounds": passes}


# ---------------------------------------------------------------------------------------------------------------
# Speed: step timing and the streamed optimizer step's profile
# ---------------------------------------------------------------------------------------------------------------


class StepProfile:
    """Where the disk tier's optimizer step spends its time, by wrapping (in this rank process only) the calls the
    step makes (``lightning_colossal/disk/optimizer_state.py``, ``_step``):

    - ``arithmetic``: ``DiskOptimizerState._step_only``, the optimizer's own step of one record (or of the resident
      masters);
    - ``bind``: binding a record's state as views of its staging buffer, copying fresh state in after the first step,
      putting placeholders back (``_bind``, ``_copy_in``, ``_unbind``);
    - ``read_wait`` / ``write_wait``: the main thread blocked in ``Future.result()`` on a read (the record it is about
      to step) or on a write (a staging buffer to reuse); a step's last writes and the next step's first reads run
      during the forward and backward between them, and count in the figures of the step after;
    - ``local``: the whole rank-local stream (``DiskOptimizerState._step``); the rest of ``step`` is the one small
      all-reduce in which the ranks agree that every disk worked (it also waits for the slower rank);
    - on the I/O threads, ``read_io`` / ``write_io``: the seconds every read and write call took, and ``io_busy``: the
      union of those intervals (how long this rank's disk requests were in flight).
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()

    def reset(self) -> dict[str, float]:
        """This step's figures (with ``io_busy`` from the intervals); starts the next step's."""
        with self._lock:
            figures = dict(self.seconds)
            figures["io_busy"] = _union_seconds(self.intervals)
            self.seconds = {}
            self.intervals = []
        return figures

    def add(self, key: str, seconds: float) -> None:
        with self._lock:
            self.seconds[key] = self.seconds.get(key, 0.0) + seconds

    def timed(self, key: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.add(key, time.perf_counter() - start)

        return wrapper

    def install(self) -> None:
        """Wrap the disk tier's calls (class attributes: every instance in this process)."""
        state_class = optimizer_state.DiskOptimizerState
        state_class._step_only = self.timed("arithmetic", state_class._step_only)  # type: ignore[method-assign]
        for name in ("_bind", "_copy_in", "_unbind"):
            setattr(state_class, name, self.timed("bind", getattr(state_class, name)))
        state_class._step = self.timed("local", state_class._step)  # type: ignore[method-assign]
        tier_class = optimizer_state.TierFile
        original_transfer = tier_class._transfer
        profile = self

        def transfer(tier: TierFile, offset: int, buffer: torch.Tensor, writing: bool) -> None:
            start = time.perf_counter()
            try:
                original_transfer(tier, offset, buffer, writing)
            finally:
                end = time.perf_counter()
                profile.add("write_io" if writing else "read_io", end - start)
                with profile._lock:
                    profile.intervals.append((start, end))

        tier_class._transfer = transfer  # type: ignore[method-assign]
        # A step's first reads start at the end of the step before (``read_after``); waiting for them is a read wait.
        for method, kind in (("read", "read"), ("write", "write"), ("read_after", "read")):
            original = getattr(tier_class, method)

            def submit(tier: TierFile, *args: Any, _original: Any = original, _kind: str = kind) -> Future[None]:
                future = _original(tier, *args)
                future._disk_kind = _kind  # type: ignore[attr-defined]
                return future

            setattr(tier_class, method, submit)
        original_result = Future.result

        def result(future: Future[Any], timeout: float | None = None) -> Any:
            kind = getattr(future, "_disk_kind", None)
            if kind is None:
                return original_result(future, timeout)
            start = time.perf_counter()
            try:
                return original_result(future, timeout)
            finally:
                profile.add(f"{kind}_wait", time.perf_counter() - start)

        Future.result = result  # type: ignore[method-assign]


def _union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end]`` intervals."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None and current_start is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None and current_start is not None:
        total += current_end - current_start
    return total


class SpeedProbe(Callback):
    """Per step: the whole step (``on_train_batch_start`` to ``on_train_batch_end``: forward, backward, gradient
    reduction, optimizer step, refreshing the shards), the optimizer step alone (the strategy's
    ``precision_plugin.optimizer_stepper``, wrapped: the engine's ``step_optimizer``, which streams the disk tier),
    the disk tier's bytes and the step's profile; and the CPU-time window of the measured steps (the load rule)."""

    def __init__(self, spec: dict[str, Any], profile: StepProfile) -> None:
        self.spec = spec
        self.warmup = spec["warmup"]
        self.bandwidth: dict[str, Any] = {}
        self.host_memory: dict[str, int] = {}
        self.profile = profile
        self.steps: list[dict[str, Any]] = []
        self.losses: list[float] = []
        self.window: dict[str, float] = {}
        self._start = 0.0
        self._optimizer_seconds = 0.0
        self._bytes = (0, 0)
        self._peak_rss_before = 0
        self._disk_start: dict[str, int] = {}
        self._tier_start = (0, 0)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        plugin = trainer.strategy.precision_plugin
        stepper = plugin.optimizer_stepper

        def timed_stepper(optimizer: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return stepper(optimizer, **kwargs)
            finally:
                self._optimizer_seconds += time.perf_counter() - start

        plugin.optimizer_stepper = timed_stepper

    def _disk_bytes(self, trainer: Trainer) -> tuple[int, int]:
        state = getattr(getattr(trainer.strategy, "engine", None), "disk_state", None)
        return (0, 0) if state is None else (state.bytes_read, state.bytes_written)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if len(self.steps) == self.warmup:
            # The disk's bandwidth right before the measured steps (and right after them, in on_train_end), with the
            # model in memory as the steps have it. The passes' buffers are not training's: the peak RSS so far is
            # kept and the peak restarted after them.
            self._peak_rss_before = host_memory()["peak_rss_bytes"]
            self.bandwidth["before"] = launch_bandwidth(trainer, self.spec)
            reset_peak_rss()
            cpu_times = read_cpu_times()
            self.window = {
                "wall_start": time.perf_counter(),
                "process_cpu_start": time.process_time(),
                "busy_start": cpu_times.busy_seconds if cpu_times else float("nan"),
            }
            self._disk_start = disk_traffic_bytes()
            self._tier_start = self._disk_bytes(trainer)
        self._bytes = self._disk_bytes(trainer)
        self._optimizer_seconds = 0.0
        self.profile.reset()
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        wall = time.perf_counter() - self._start
        read, written = self._disk_bytes(trainer)
        self.steps.append(
            {
                "step_seconds": wall,
                "optimizer_step_seconds": self._optimizer_seconds,
                "bytes_read": read - self._bytes[0],
                "bytes_written": written - self._bytes[1],
                "profile": self.profile.reset(),
                "rss_bytes": host_memory()["rss_bytes"],
            }
        )
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.window:
            return
        cpu_times = read_cpu_times()
        disk = disk_traffic_bytes()
        tier = self._disk_bytes(trainer)
        self.host_memory = host_memory()
        self.host_memory["peak_rss_bytes"] = max(self.host_memory["peak_rss_bytes"], self._peak_rss_before)
        # After the window's clocks and the peak RSS are read: the bandwidth passes are not part of training.
        self.window = {
            "wall_seconds": time.perf_counter() - self.window["wall_start"],
            "process_cpu_seconds": time.process_time() - self.window["process_cpu_start"],
            "system_busy_seconds": (cpu_times.busy_seconds if cpu_times else float("nan")) - self.window["busy_start"],
            # The machine's disk traffic in the window and this rank's own tier bytes in it.
            "device_read_bytes": disk["read_bytes"] - self._disk_start.get("read_bytes", 0),
            "device_written_bytes": disk["written_bytes"] - self._disk_start.get("written_bytes", 0),
            "tier_read_bytes": tier[0] - self._tier_start[0],
            "tier_written_bytes": tier[1] - self._tier_start[1],
        }
        self.bandwidth["after"] = launch_bandwidth(trainer, self.spec)


def _plain(value: Any) -> Any:
    """A report (named tuples, dataclasses) as JSON numbers."""
    if hasattr(value, "_asdict"):
        return {key: _plain(item) for key, item in value._asdict().items()}
    if hasattr(value, "__dataclass_fields__"):
        return {key: _plain(getattr(value, key)) for key in value.__dataclass_fields__}
    return value if isinstance(value, (int, float, bool, str)) or value is None else repr(value)


def engine_report(trainer: Trainer) -> dict[str, Any]:
    """The engine's memory report (Gemini or ZeRO), as plain numbers."""
    engine = getattr(trainer.strategy, "engine", None)
    if engine is None or not hasattr(engine, "memory_report"):
        return {}
    figures = _plain(engine.memory_report())
    state = getattr(engine, "disk_state", None)
    if state is not None:
        figures["disk_records"] = len(state.records)
        figures["disk_record_bytes"] = state.slot_bytes
        figures["disk_direct_io"] = state.file.direct_io
    return figures


def _keep_io_within_the_step() -> None:
    """An experiment, not a setting: every step waits for its last writes and reads nothing ahead, as the tier did
    before its I/O ran on into the forward and backward (before git fb3343f), to compare the two in one invocation."""
    state_class = optimizer_state.DiskOptimizerState
    step = state_class._step

    def step_then_wait(state: optimizer_state.DiskOptimizerState, **kwargs: Any) -> Any:
        output = step(state, **kwargs)
        state._settle()
        return output

    state_class._read_ahead = lambda state: None  # type: ignore[method-assign]
    state_class._step = step_then_wait  # type: ignore[method-assign]


def speed(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the spec's GPT for warm-up + measured steps under its strategy, with the probe timing."""
    if spec.get("io_within_step"):
        _keep_io_within_the_step()
    profile = StepProfile()
    profile.install()
    if spec.get("staging_slots"):
        # An experiment, not a setting: more staging buffers let reads run further ahead of the step and writes
        # further behind it (the tier's own constant is 3).
        optimizer_state.STAGING_SLOTS = spec["staging_slots"]
    model_config = GPTConfig(**spec["model_config"])
    torch.manual_seed(spec["seed"])
    steps = spec["warmup"] + spec["steps"]
    batch, world_size = spec["batch_size_per_rank"], spec["world_size"]
    dataset = RandomTokenDataset(
        vocab_size=model_config.vocab_size,
        block_size=spec["sequence_length"],
        num_samples=batch * world_size * steps,
        seed=spec["seed"],
    )
    loader = DataLoader(dataset, batch_size=batch, shuffle=False, drop_last=True)
    probe = SpeedProbe(spec, profile)
    trainer = train_on_cpu(
        build_strategy(spec["strategy"], strategy_arguments(spec)),
        world_size,
        steps,
        BenchmarkModule(model_config, spec["learning_rate"]),
        loader,
        [probe],
    )
    return {
        "parameter_count": parameter_count(model_config),
        "steps": probe.steps,
        "losses": probe.losses,
        "window": probe.window,
        "bandwidth": probe.bandwidth,
        "engine": engine_report(trainer),
        "host_memory": probe.host_memory or host_memory(),
    }


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="spec JSON written by benchmarks.disk")
    spec_path = parser.parse_args(argv).spec
    spec = json.loads(spec_path.read_text())
    result: dict[str, Any] = {"rank": int(os.environ["RANK"]), "error": None}
    try:
        if spec["task"] == "bandwidth":
            if int(os.environ["WORLD_SIZE"]) > 1:
                dist.init_process_group("gloo")
            result.update(bandwidth(spec))
            if dist.is_initialized():
                dist.destroy_process_group()
        else:
            result.update(speed(spec))
    except Exception as exception:  # noqa: BLE001 (recorded for the orchestrator, then re-raised)
        result["error"] = f"{type(exception).__name__}: {exception}"
        traceback.print_exc()
    result_path = spec_path.parent / f"rank{os.environ['RANK']}.json"
    temporary_path = result_path.with_suffix(".json.partial")
    temporary_path.write_text(json.dumps(result))
    temporary_path.rename(result_path)
    if result["error"] is not None:
        raise SystemExit(3)


if __name__ == "__main__":
    main()
