"""Checkpoints written in the background (``checkpoint/async_save.py``): what they hold, what waits for them, failures.

The writer is slowed or broken on purpose by wrapping DCP's ``FileSystemWriter.write_data`` in the rank processes:
it runs on the background thread, after the save was staged and planned, before any byte of the shards is written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from torch.distributed.checkpoint import FileSystemWriter

from lightning_colossal import ColossalDDPStrategy, ColossalFSDPStrategy, GeminiStrategy, ZeroStrategy
from lightning_colossal.checkpoint import async_save
from lightning_colossal.checkpoint.layout import leftovers_of_interrupted_save, locate_checkpoint, shards_root
from lightning_colossal.checkpoint.sharded import load_file_weights, read_sharded, remove_checkpoint, save_sharded
from lightning_colossal.checkpoint.writer_process import ProcessShardWriter
from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO2, StrategySpec, build_strategy, fit_epochs
from tests.distributed.oracle import float_state, new_module, quiet_trainer
from tests.fresh_interpreter import run_python


@contextmanager
def writer_patched(before_write: Callable[..., None], with_writer: bool = False) -> Iterator[None]:
    """Every DCP shard write of this process calls ``before_write()`` first (``before_write(writer)`` with
    ``with_writer``), on the thread that writes: DCP's own writer's and the one that hands the shards to the writer
    process (before it does)."""
    classes = (FileSystemWriter, ProcessShardWriter)
    own = {cls: cls.__dict__.get("write_data") for cls in classes}  # None: inherited, deleted again afterwards
    originals = {cls: cls.write_data for cls in classes}

    def patched(original: Callable[..., Any]) -> Callable[..., Any]:
        def write_data(self: FileSystemWriter, plan: Any, planner: Any) -> Any:
            before_write(*((self,) if with_writer else ()))
            return original(self, plan, planner)

        return write_data

    for cls, original in originals.items():
        cls.write_data = patched(original)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, defined in own.items():
            if defined is None:
                del cls.write_data
            else:
                cls.write_data = defined  # type: ignore[method-assign]


class Gate:
    """Holds writers until opened; counts the writers that reached it."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.reached = threading.Event()

    def __call__(self) -> None:
        self.reached.set()
        if not self.opened.wait(timeout=60):
            raise TimeoutError("the test never opened the gate")


class AtSteps(Callback):
    """Calls ``actions[step](trainer, module)`` after the optimizer step that made ``global_step == step``."""

    def __init__(self, actions: dict[int, Callable[[Any, Any], None]]) -> None:
        self.actions = actions

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        action = self.actions.get(trainer.global_step)
        if action is not None:
            action(trainer, pl_module)


# --------------------------------------------------------------------------------- the same checkpoint as a sync save
def sync_and_async_saves_body(spec: StrategySpec, directory: str) -> None:
    """Train one epoch; after step 3 save synchronously, then in the background, at the same point."""
    strategy = build_strategy(spec)

    def save_both(trainer: Any, module: Any) -> None:
        strategy.async_checkpoint = False
        trainer.save_checkpoint(f"{directory}/sync.ckpt")
        strategy.async_checkpoint = True
        assert strategy.saves_in_background()
        trainer.save_checkpoint(f"{directory}/async.ckpt")
        assert async_save.background_save_in_flight() is not None

    module = new_module(dropout=0.1, with_scheduler=True)
    trainer = quiet_trainer(
        strategy=strategy,
        devices=torch.distributed.get_world_size(),
        max_epochs=1,
        callbacks=[AtSteps({3: save_both})],
    )
    trainer.fit(module)  # five more steps change every live tensor while the background save is written


def resume_body(spec: StrategySpec, path: str) -> dict[str, torch.Tensor]:
    return fit_epochs(spec, epochs=2, ckpt_path=path, dropout=0.1)


def _assert_same_items(first: Any, second: Any, where: str) -> None:
    if isinstance(first, torch.Tensor):
        assert torch.equal(first, second), where
    elif isinstance(first, dict):
        assert first.keys() == second.keys(), where
        for key in first:
            _assert_same_items(first[key], second[key], f"{where}.{key}")
    elif isinstance(first, (list, tuple)):
        assert type(first) is type(second) and len(first) == len(second), where
        for index, (one, other) in enumerate(zip(first, second, strict=True)):
            _assert_same_items(one, other, f"{where}[{index}]")
    elif isinstance(first, numpy.ndarray):
        assert numpy.array_equal(first, second), where
    else:
        assert first == second, where


@pytest.mark.parametrize("spec", [DDP, ZERO2, GEMINI, FSDP], ids=["ddp", "zero2", "gemini", "fsdp"])
def test_a_background_save_resumes_bit_equal_to_a_synchronous_save(rank_pool_2, tmp_path, spec):
    rank_pool_2.run(sync_and_async_saves_body, spec, str(tmp_path))
    sync, background = tmp_path / "sync.ckpt", tmp_path / "async.ckpt"
    _assert_same_items(read_sharded(sync), read_sharded(background), "shards")
    _assert_same_items(
        load_file_weights(locate_checkpoint(sync)), load_file_weights(locate_checkpoint(background)), "file"
    )
    assert leftovers_of_interrupted_save(background) == []
    from_sync = rank_pool_2.run(resume_body, spec, str(sync))
    from_background = rank_pool_2.run(resume_body, spec, str(background))
    for rank in range(2):
        torch.testing.assert_close(from_background[rank], from_sync[rank], rtol=0, atol=0)


# --------------------------------------------------------------------------------- fit goes on; what waits for what
def workflow_body(directory: str) -> dict[str, Any]:
    """Under Lightning's AsyncCheckpointIO plugin: a save whose writer is held while training goes on, a save that
    must wait for it, and a load that must wait for a third one."""
    gate = Gate()
    facts: dict[str, Any] = {}
    first, second, third = (f"{directory}/{name}.ckpt" for name in ("first", "second", "third"))

    def save_first(trainer: Any, module: Any) -> None:
        trainer.save_checkpoint(first)
        facts["state_at_first_save"] = float_state(module)
        facts["first_returned_before_the_write"] = not gate.opened.is_set()

    def while_held(trainer: Any, module: Any) -> None:
        pending = async_save.background_save_in_flight()
        facts.setdefault("steps_while_held", 0)
        facts["steps_while_held"] += int(pending is not None and not pending.done() and not gate.opened.is_set())

    def save_second(trainer: Any, module: Any) -> None:
        while_held(trainer, module)
        facts["writer_reached"] = gate.reached.wait(timeout=30)
        threading.Timer(0.5, gate.opened.set).start()
        started = time.perf_counter()
        trainer.save_checkpoint(second)
        facts["second_waited_seconds"] = time.perf_counter() - started
        facts["first_committed_when_second_started"] = locate_checkpoint(first).has_shards

    def load_third(trainer: Any, module: Any) -> None:
        async_save.wait_for_background_save()  # the second save is written; hold the writer again for the third
        gate.opened.clear()
        trainer.save_checkpoint(third)
        threading.Timer(0.5, gate.opened.set).start()
        trainer.strategy.load_checkpoint(third)  # the same state back; without the wait the file does not exist yet
        facts["third_loaded"] = True

    module = new_module(with_scheduler=True)
    trainer = quiet_trainer(
        strategy=ColossalDDPStrategy(),
        devices=torch.distributed.get_world_size(),
        max_steps=8,
        plugins=[AsyncCheckpointIO()],
        callbacks=[AtSteps({2: save_first, 3: while_held, 4: while_held, 5: save_second, 7: load_third})],
    )
    with writer_patched(gate):
        trainer.fit(module)
    facts["final_state"] = float_state(module)
    facts["first_in_file"] = load_file_weights(locate_checkpoint(first))
    facts["in_flight_after_fit"] = async_save.background_save_in_flight() is not None
    return facts


@pytest.fixture(scope="module")
def workflow(rank_pool_2, tmp_path_factory):
    directory = tmp_path_factory.mktemp("async_workflow")
    return rank_pool_2.run(workflow_body, str(directory)), directory


def test_fit_goes_on_while_the_save_is_written(workflow):
    for facts in workflow[0]:
        assert facts["first_returned_before_the_write"]
        assert facts["writer_reached"], "the background writer never started"
        assert facts["steps_while_held"] == 3, "steps 3, 4 and 5 ran while the first save was still being written"


def test_the_checkpoint_holds_the_state_of_the_save_call(workflow):
    for facts in workflow[0]:
        torch.testing.assert_close(facts["first_in_file"], facts["state_at_first_save"], rtol=0, atol=0)
        moved = max(
            (facts["final_state"][name] - facts["state_at_first_save"][name]).abs().max().item()
            for name in facts["final_state"]
        )
        assert moved > 1e-4, "training went on after the save, so the live weights moved on"


def test_the_next_save_and_a_load_wait_for_the_save_in_flight(workflow):
    results, directory = workflow
    for facts in results:
        assert facts["second_waited_seconds"] > 0.3, "the second save returned before the first one was written"
        assert facts["first_committed_when_second_started"]
        assert facts["third_loaded"]
        assert not facts["in_flight_after_fit"], "the end of fit waits for the last save"
    assert sorted(path.name for path in directory.glob("*.ckpt")) == ["first.ckpt", "second.ckpt", "third.ckpt"]


class HoldTheSaveAtStep6(Callback):
    """Holds the writer of ModelCheckpoint's save after step 6 and records, while it is held, which of its earlier
    checkpoints exist (ModelCheckpoint has asked for step 4's removal by then)."""

    def __init__(self, gate: Gate, directory: str) -> None:
        self.gate, self.directory = gate, Path(directory)
        self.exist_while_held: list[str] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == 6:
            self.gate.reached.wait(timeout=30)
            self.exist_while_held = sorted(path.name for path in self.directory.iterdir())
            self.gate.opened.set()

    def hold(self, writer: FileSystemWriter) -> None:
        if "step=6.ckpt" in str(writer.path):
            self.gate()


def top_k_body(directory: str) -> dict[str, list[str]]:
    holder = HoldTheSaveAtStep6(Gate(), directory)
    module = new_module()
    trainer = quiet_trainer(
        strategy=ZeroStrategy(stage=2, async_checkpoint=True),
        devices=torch.distributed.get_world_size(),
        max_steps=7,
        callbacks=[holder, ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=1)],
        enable_checkpointing=True,
    )
    with writer_patched(holder.hold, with_writer=True):
        trainer.fit(module)
    return {"while_held": holder.exist_while_held, "after_fit": sorted(path.name for path in Path(directory).iterdir())}


def test_model_checkpoint_top_k_removes_a_checkpoint_only_after_the_next_one_committed(rank_pool_2, tmp_path):
    names = rank_pool_2.run(top_k_body, str(tmp_path))[0]
    step_4 = ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.shards"]
    assert set(step_4) <= set(names["while_held"]), (
        "step 4's checkpoint is the newest complete one until step 6's commits"
    )
    assert names["after_fit"] == ["epoch=0-step=6.ckpt", "epoch=0-step=6.ckpt.shards"]


# --------------------------------------------------------------------------------- removals wait for the commit
def removal_body(directory: str, fail: bool) -> dict[str, bool]:
    """Save ``older`` synchronously, then ``newer`` in the background with its writer held (or failing on rank 1),
    and ask for ``older`` to be removed meanwhile."""
    rank = torch.distributed.get_rank()
    older, newer = Path(directory, "older.ckpt"), Path(directory, "newer.ckpt")
    state = {"model": {"weight": torch.full((4, 3), float(rank))}}
    save_sharded(older, state, {"epoch": 0})
    gate = Gate()

    def held_or_failing() -> None:
        if fail and rank == 1:
            raise OSError("simulated disk failure")
        gate()

    facts = {}
    with writer_patched(held_or_failing):
        async_save.save_in_background(newer, state, {"epoch": 1}, None, timeout=timedelta(seconds=60))
        if rank == 0:
            async_save.remove_after_background_save(lambda: remove_checkpoint(older))
        facts["older_kept_while_in_flight"] = older.is_file() and shards_root(older).is_dir()
        gate.opened.set()
        try:
            async_save.wait_for_background_save()
            facts["raised"] = False
        except async_save.BackgroundSaveError as error:
            facts["raised"] = str(newer) in str(error) and "simulated disk failure" in str(error)
    torch.distributed.barrier()
    facts["older_exists"] = older.is_file() and shards_root(older).is_dir()
    facts["newer_exists"] = newer.is_file()
    return facts


@pytest.mark.parametrize("fail", [False, True], ids=["committed", "failed"])
def test_a_removal_waits_for_the_commit_and_a_failed_save_removes_nothing(rank_pool_2, tmp_path, fail):
    for facts in rank_pool_2.run(removal_body, str(tmp_path), fail):
        assert facts["older_kept_while_in_flight"]
        assert facts["raised"] is fail
        assert facts["older_exists"] is fail, "removed after the commit; kept when the save failed"
        assert facts["newer_exists"] is not fail


# --------------------------------------------------------------------------------- failures
def failing_save_body(directory: str, when: str, strategy_name: str = "ddp") -> dict[str, Any]:
    """Save ``last.ckpt`` after step 2; save it again after step 4 with rank 1's writer failing; then either save
    once more after step 6 (``when="next_save"``) or end the fit (``when="end_of_fit"``). ``strategy_name``
    ``"fsdp_kept_sharded"``: FSDP keeping its weights sharded, whose teardown takes a path of its own."""
    path = f"{directory}/last.ckpt"
    failing = threading.Event()
    facts: dict[str, Any] = {}

    def fail_on_rank_1() -> None:
        if failing.is_set() and torch.distributed.get_rank() == 1:
            raise OSError("simulated disk failure")

    def save(trainer: Any, module: Any) -> None:
        trainer.save_checkpoint(path)

    def save_first(trainer: Any, module: Any) -> None:
        save(trainer, module)
        facts["state_at_first_save"] = float_state(module)

    def save_failing(trainer: Any, module: Any) -> None:
        async_save.wait_for_background_save()  # the first save is written before the writer starts failing
        failing.set()
        save(trainer, module)

    def save_failing_then_fail(trainer: Any, module: Any) -> None:
        save_failing(trainer, module)
        raise RuntimeError("the run failed while a save was being written")

    actions = {
        "next_save": {2: save_first, 4: save_failing, 6: save},
        "end_of_fit": {2: save_first, 4: save_failing},
        "run_fails": {2: save_first, 4: save_failing_then_fail},
    }[when]
    module = new_module(with_scheduler=True)
    strategy: Any = (
        ColossalDDPStrategy(async_checkpoint=True)
        if strategy_name == "ddp"
        else ColossalFSDPStrategy(async_checkpoint=True, keep_weights_sharded=True)
    )
    trainer = quiet_trainer(
        strategy=strategy,
        devices=torch.distributed.get_world_size(),
        max_steps={"next_save": 8, "end_of_fit": 4, "run_fails": 6}[when],
        callbacks=[AtSteps(actions)],
    )
    with writer_patched(fail_on_rank_1):
        try:
            trainer.fit(module)
            facts["error"] = None
        except async_save.BackgroundSaveError as error:
            facts["error"] = str(error)
            facts["error_step"] = trainer.global_step
        except RuntimeError as error:
            # The run's own error is raised; the failed save is a note on it (teardown waited for the save).
            facts["error"] = "\n".join(getattr(error, "__notes__", []))
            facts["error_step"] = trainer.global_step
    torch.distributed.barrier()
    facts["in_file"] = load_file_weights(locate_checkpoint(path))
    facts["leftovers"] = [leftover.name for leftover in leftovers_of_interrupted_save(path)]
    facts["shard_directories"] = [entry.name for entry in shards_root(path).iterdir()]
    # The previous checkpoint resumes (max_steps already reached: loads and trains no further).
    resumed = quiet_trainer(strategy=ColossalDDPStrategy(), devices=torch.distributed.get_world_size(), max_steps=2)
    fresh = new_module(with_scheduler=True)
    resumed.fit(fresh, ckpt_path=path)
    facts["resumed"] = float_state(fresh)
    return facts


@pytest.mark.parametrize(
    ("when", "strategy_name"),
    [("next_save", "ddp"), ("end_of_fit", "ddp"), ("run_fails", "ddp"), ("run_fails", "fsdp_kept_sharded")],
)
def test_a_failed_background_save_is_raised_naming_the_path_and_keeps_the_previous_checkpoint(
    rank_pool_2, tmp_path, when, strategy_name
):
    for facts in rank_pool_2.run(failing_save_body, str(tmp_path), when, strategy_name):
        assert facts["error"] is not None, "the failure must be raised, not swallowed"
        assert str(tmp_path / "last.ckpt") in facts["error"] and "simulated disk failure" in facts["error"]
        assert facts["error_step"] == (6 if when == "next_save" else 4)
        if when == "run_fails":
            assert facts["error"].startswith("lightning_colossal: "), facts["error"]
        torch.testing.assert_close(facts["in_file"], facts["state_at_first_save"], rtol=0, atol=0)
        torch.testing.assert_close(facts["resumed"], facts["state_at_first_save"], rtol=0, atol=0)
        assert facts["leftovers"] == [] and len(facts["shard_directories"]) == 1


CRASH_SCRIPT = """
import os, signal, sys, threading
from datetime import timedelta
from pathlib import Path
import torch
from torch.distributed.checkpoint import FileSystemWriter
from lightning_colossal.checkpoint import async_save, writer_process
from lightning_colossal.checkpoint.sharded import save_sharded

path, route = Path(sys.argv[1]), sys.argv[2]
save_sharded(path, {"model": {"weight": torch.zeros(64, 64)}}, {"epoch": 0})
writing = threading.Event()

def stall():
    writing.set()
    threading.Event().wait()  # the process is killed here, mid-save

if route == "thread":
    writer_process.start = lambda: None  # no writer process: the background thread writes the shards

    def write_then_stall(self, plan, planner):
        stall()

    FileSystemWriter.write_data = write_then_stall
else:

    def hand_over_then_stall(self, job):
        self.wait_until_ready()
        self._jobs.send(writer_process.writer_child.to_message(job))
        assert self._receive()[0] == "done"  # the writer process wrote the shards; this process dies before the commit
        print(f"WRITER PROCESS {self.pid}", flush=True)
        stall()

    writer_process.WriterProcess.write = hand_over_then_stall
async_save.save_in_background(path, {"model": {"weight": torch.ones(64, 64)}}, {"epoch": 1}, None, timedelta(seconds=60))
writing.wait(60)
print(f"TRAINING PROCESS {os.getpid()}", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _gone(pid: int, timeout: float) -> bool:
    """Whether process ``pid`` has ended (and been reaped by whoever adopted it) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True  # ended; its adopter has not reaped it yet
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("route", ["thread", "process"])
def test_a_process_killed_during_a_background_save_keeps_the_previous_checkpoint(tmp_path, route):
    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    path = tmp_path / "last.ckpt"
    result = run_python([str(script), str(path), route], tmp_path, timeout=120)
    assert result.returncode == -9, result.stderr[-3000:]
    assert torch.equal(load_file_weights(locate_checkpoint(path))["weight"], torch.zeros(64, 64))
    assert torch.equal(read_sharded(path)["model"]["weight"], torch.zeros(64, 64))
    if route == "process":
        pids = dict(line.rsplit(" ", 1) for line in result.stdout.splitlines() if " PROCESS " in line)
        assert _gone(int(pids["WRITER PROCESS"]), timeout=30), "the writer process outlived the training process"
        training = pids["TRAINING PROCESS"]
        deadline = time.monotonic() + 30
        while any(name.startswith(f"torch_{training}_") for name in os.listdir("/dev/shm")):
            assert time.monotonic() < deadline, "the staged copies' shared memory outlived both processes"
            time.sleep(0.1)


FIRST_STEP_FAILURE_SCRIPT = """
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader

from lightning_colossal import ColossalDDPStrategy


class FailsAtFirstStep(LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_index):
        raise RuntimeError("the user's own first-step error")

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = Trainer(
    strategy=ColossalDDPStrategy(async_checkpoint=True), accelerator="cpu", devices=1, max_steps=2,
    logger=False, enable_progress_bar=False, enable_model_summary=False,
)
trainer.fit(FailsAtFirstStep(), DataLoader(torch.randn(8, 4), batch_size=2))
"""


def test_a_run_that_fails_at_its_first_step_shows_its_error_and_nothing_of_the_writer_process(tmp_path):
    """The writer process starts with the fit and imports torch meanwhile; a fit that fails at once closes the pipe
    before the process says it is ready, which must not add a BrokenPipeError traceback under the real error."""
    script = tmp_path / "first_step_failure.py"
    script.write_text(FIRST_STEP_FAILURE_SCRIPT)
    result = run_python([str(script)], tmp_path, timeout=120)
    assert result.returncode != 0
    assert "the user's own first-step error" in result.stderr
    assert "BrokenPipeError" not in result.stderr and "writer_child" not in result.stderr, result.stderr[-3000:]


# --------------------------------------------------------------------------------- staging and the argument
def test_staging_copies_every_tensor_once_and_keeps_the_rest():
    weight = torch.arange(6.0).view(2, 3)
    state = {"model": {"a": weight, "tied": weight, "view": weight.t()}, "groups": [{"lr": 0.1, "params": ["a"]}]}
    staged = async_save.stage(state)
    weight.add_(100.0)
    assert torch.equal(staged["model"]["a"], torch.arange(6.0).view(2, 3))
    assert staged["model"]["tied"] is staged["model"]["a"], "a tensor saved under two names is copied once"
    assert torch.equal(staged["model"]["view"], torch.arange(6.0).view(2, 3).t())
    assert staged["groups"] == state["groups"] and staged["groups"][0] is not state["groups"][0]


def test_every_strategy_takes_async_checkpoint():
    from lightning_colossal import ColossalFSDPStrategy, HybridParallelStrategy

    for strategy_class in (ColossalDDPStrategy, ZeroStrategy, GeminiStrategy, ColossalFSDPStrategy):
        strategy = strategy_class(async_checkpoint=True)
        assert strategy.async_checkpoint is True
        assert "async_checkpoint" in (strategy_class.__doc__ or "")
    assert HybridParallelStrategy(async_checkpoint=True).async_checkpoint is True


def test_lightning_cli_takes_async_checkpoint(tmp_path, monkeypatch):
    from lightning.pytorch.cli import LightningCLI
    from lightning.pytorch.demos.boring_classes import BoringModel

    monkeypatch.chdir(tmp_path)
    arguments = ["--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
    arguments += ["--trainer.strategy=lightning_colossal.GeminiStrategy", "--trainer.strategy.async_checkpoint=true"]
    cli = LightningCLI(BoringModel, run=False, args=arguments)
    assert isinstance(cli.trainer.strategy, GeminiStrategy) and cli.trainer.strategy.async_checkpoint is True
