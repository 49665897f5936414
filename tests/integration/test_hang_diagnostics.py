"""A collective that times out: every rank says what it was waiting for (``distributed/in_flight.py``).

Each launch trains ``RegressionModule`` (without its ``self.log(sync_dist=True)``, so the hang lands in the
engine's own communication) on 2 CPU ranks through Lightning's popen launcher, with a 3 s collective timeout (set
once the processes have met, see ``ShortCollectiveTimeout``) and a 60 s heartbeat timeout, so the watchdog does not
fire first. At ``STUCK_STEP`` rank 1 sleeps in a callback; rank 0 enters the step's first collective alone and times
out. Rank 1 then wakes while rank 0 is still tearing down, enters the same collective and fails: the peer has closed
its connections, or goes. A launch takes 15-35 s on 2 busy cores, mostly interpreter start-up.
"""

from __future__ import annotations

import re
import textwrap
import time

import pytest

from tests.fresh_interpreter import launch_to_log

STUCK_STEP = 3
TIMEOUT_SECONDS = 3

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from datetime import timedelta
    import torch
    from torch import nn
    from lightning.pytorch.callbacks import Callback
    from lightning_colossal import GeminiStrategy, ZeroStrategy
    from lightning_colossal.distributed.group_cache import set_group_timeout
    from tests.distributed.oracle import RegressionModule, quiet_trainer

    TIMEOUT = timedelta(seconds=TIMEOUT_SECONDS)
    STRATEGIES = {
        "zero2": lambda: ZeroStrategy(stage=2, heartbeat_timeout=timedelta(seconds=60)),
        "gemini": lambda: GeminiStrategy(chunk_numel=1100, heartbeat_timeout=timedelta(seconds=60)),
    }

    class ShortCollectiveTimeout(Callback):
        # The strategy's timeout also bounds the rendezvous, where rank 0 waits for rank 1's interpreter to start
        # (more than 3 s on a loaded machine); so the processes meet under the default timeout, and the timeout of
        # the run's collectives is set here, after the process group and mesh exist and before the engine is built
        # (Gemini's reduction group takes strategy._timeout).
        def setup(self, trainer, module, stage):
            trainer.strategy._timeout = TIMEOUT
            set_group_timeout(torch.distributed.group.WORLD, TIMEOUT)
            mesh = trainer.strategy.device_mesh
            for name in mesh.mesh_dim_names:
                set_group_timeout(mesh.get_group(name), TIMEOUT)

    class Module(RegressionModule):
        def training_step(self, batch, batch_index):
            inputs, targets = batch
            return nn.functional.mse_loss(self.model(inputs), targets)

    class SleepOnRankOne(Callback):
        # Rank 1 sleeps until rank 0's collective has timed out (rank 0 says so through a file), then enters the
        # same collective while rank 0's process still exists (its teardown waits for the watchdog), so what rank 1
        # prints does not depend on how fast either process runs.
        def on_train_batch_start(self, trainer, module, batch, batch_index):
            if trainer.global_step == STUCK_STEP and trainer.global_rank == 1:
                print(f"SLEEPING pid={os.getpid()}", flush=True)
                deadline = time.monotonic() + 60
                while not os.path.exists("rank0-failed") and time.monotonic() < deadline:
                    time.sleep(0.05)

        def on_exception(self, trainer, module, exception):
            if trainer.global_rank == 0:
                open("rank0-failed", "w").close()

    if __name__ == "__main__":
        trainer = quiet_trainer(
            strategy=STRATEGIES[sys.argv[1]](), devices=2, max_steps=STUCK_STEP + 2,
            callbacks=[ShortCollectiveTimeout(), SleepOnRankOne()],
        )
        trainer.fit(Module(batch_size=16))
        print("UNREACHABLE: fit returned after a collective timed out", flush=True)
    """
)
for _name, _value in {
    "STUCK_STEP": STUCK_STEP,
    "TIMEOUT_SECONDS": TIMEOUT_SECONDS,
}.items():
    SCRIPT = SCRIPT.replace(_name, str(_value))


def _process_exists(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, IndexError):
        return False


def _launch(directory, name: str, timeout: float = 120) -> tuple[int, str]:
    """Run the script through the popen launcher; wait for rank 0's process, then for rank 1's (it outlives rank 0:
    the launcher does not stop its children when rank 0 itself fails)."""
    script = directory / "hang.py"
    script.write_text(SCRIPT)
    log = directory / f"{name}.log"
    returncode = launch_to_log([str(script), name], directory, log, timeout)
    sleeping = re.search(r"SLEEPING pid=(\d+)", log.read_text())
    if sleeping is not None:
        deadline = time.monotonic() + 30
        while _process_exists(int(sleeping.group(1))) and time.monotonic() < deadline:
            time.sleep(0.1)
    return returncode, log.read_text()


_LATE_PEER = (
    f"lightning_colossal watchdog: rank 1 (watched by rank 0) was at step {STUCK_STEP}, not inside a lightning_colossal"
    " collective (heartbeat"
)


def _notes(output: str) -> str:
    """The failure notes of both ranks (Lightning prefixes rank 1's stderr with ``[rank1]: ``, rank 0's with
    ``[rank0]: ``)."""
    return "\n".join(line for line in output.splitlines() if re.search(r"lightning_colossal( watchdog)?:", line))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "collective", "activity"),
    [
        # ZeRO-2's gradients go through the point-to-point reduce-scatter on gloo, whose waits must honour the
        # group's (shortened) timeout themselves (distributed/direct_exchange.py).
        ("zero2", "reduce_scatter", r"reducing gradient bucket 1 of 1"),
        (
            "gemini",
            "all_reduce",
            r"agreeing which chunks to gather \(this rank asks for chunk 0 \(model\.input\.weight, \.\.\. \d+"
            r" parameters\)",
        ),
    ],
)
def test_a_timed_out_collective_is_named_on_every_rank(tmp_path, name, collective, activity):
    returncode, output = _launch(tmp_path, name)
    notes = _notes(output)
    print(notes)
    assert returncode != 0 and "UNREACHABLE" not in output, output[-6000:]
    assert "Timed out" in output, output[-6000:]  # rank 0 failed by the collective timeout, not by the watchdog
    # Rank 0 timed out in the step's first collective: named with its group, tensor, activity and step.
    waiting = (
        rf"rank 0 was waiting in {collective} over ranks \[0, 1\] \(\[\d+\] float32, [\d.]+ (bytes|KiB)\) for [\d.]+ s"
    )
    assert re.search(rf"{waiting}, while {activity}\S*, at global step {STUCK_STEP}\.", notes), notes
    # ... and the rank it waited for, alive but late, by that rank's heartbeat.
    assert _LATE_PEER in notes, notes
    # Rank 1 woke into the same collective and found its peer gone: it says so too.
    waiting = (
        rf"rank 1 was waiting in {collective} over ranks \[0, 1\] \(\[\d+\] float32, [\d.]+ (bytes|KiB)\) for [\d.]+ s"
    )
    assert re.search(rf"{waiting}, while {activity}\S*, at global step {STUCK_STEP}\.", notes), notes
