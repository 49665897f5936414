"""Fabric loops launched for real: a dead rank stopped by the watchdog (popen), and a notebook launch (fork) that
hands rank 0's result back. Each launch costs an interpreter start-up per rank, so both are in the slow tier."""

from __future__ import annotations

import re
import textwrap
import time

import pytest

from tests.fresh_interpreter import launch_to_log, run_script

HEARTBEAT_TIMEOUT_SECONDS = 5

DEAD_RANK_SCRIPT = textwrap.dedent(
    """
    import os, signal, time
    from datetime import timedelta
    import torch
    import lightning as L
    from torch import nn
    from lightning_colossal.fabric import FabricZeroStrategy
    from tests.distributed.oracle import RegressionModel, build_optimizer, make_dataset

    torch.set_num_threads(1)
    strategy = FabricZeroStrategy(stage=2, heartbeat_timeout=timedelta(seconds=HEARTBEAT))
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = RegressionModel()
    model, optimizer = fabric.setup(model, build_optimizer(model, 0.02))
    inputs, targets = make_dataset().tensors
    for step in range(6):
        if step == 3 and fabric.global_rank == 1:
            print(f"FAILING pid={os.getpid()} at={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss = nn.functional.mse_loss(model(inputs[:8]), targets[:8])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    print("UNREACHABLE: the loop ended after a rank died", flush=True)
    """
).replace("HEARTBEAT", str(HEARTBEAT_TIMEOUT_SECONDS))


@pytest.mark.slow
def test_a_dead_rank_stops_the_fabric_loop_within_seconds_naming_it(tmp_path):
    script = tmp_path / "dead_rank.py"
    script.write_text(DEAD_RANK_SCRIPT)
    log = tmp_path / "dead_rank.log"
    returncode = launch_to_log([str(script)], tmp_path, log, timeout=120)
    ended = time.time()
    output = log.read_text()
    failing = re.search(r"FAILING pid=(\d+) at=([\d.]+)", output)
    assert failing is not None, output[-4000:]
    assert returncode != 0 and "UNREACHABLE" not in output, output[-4000:]
    # Named by the watchdog (the optimizer steps taken stand in for the Trainer's global step) or by the launcher.
    named = r"rank 1 stopped responding \(its process \(pid \d+|rank 1 \(pid \d+\) was killed by SIGKILL"
    assert re.search(named, output), output[-4000:]
    assert ended - float(failing.group(2)) < HEARTBEAT_TIMEOUT_SECONDS + 10, output[-4000:]


NOTEBOOK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import lightning as L
    from torch import nn
    import lightning_colossal
    from tests.distributed.oracle import MODEL_SEED, RegressionModel, build_optimizer, make_dataset
    from lightning.pytorch import seed_everything

    def train(fabric):
        seed_everything(MODEL_SEED, verbose=False)
        model = RegressionModel()
        model, optimizer = fabric.setup(model, build_optimizer(model, 0.02))
        inputs, targets = make_dataset().tensors
        share = 8 // fabric.world_size
        mine = slice(fabric.global_rank * share, (fabric.global_rank + 1) * share)
        for _ in range(3):
            fabric.backward(nn.functional.mse_loss(model(inputs[:8][mine]), targets[:8][mine]))
            optimizer.step()
            optimizer.zero_grad()
        return {name: value.detach().cpu() for name, value in fabric.strategy.get_module_state_dict(model).items()}

    if __name__ == "__main__":
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=sys.argv[1])
        trained = fabric.launch(train)  # fork: rank 0's return value comes back to this process
        seed_everything(MODEL_SEED, verbose=False)
        model = RegressionModel()
        optimizer = build_optimizer(model, 0.02)
        inputs, targets = make_dataset().tensors
        for _ in range(3):
            nn.functional.mse_loss(model(inputs[:8]), targets[:8]).backward()
            optimizer.step()
            optimizer.zero_grad()
        torch.testing.assert_close(trained, model.state_dict(), rtol=1e-5, atol=1e-6)
        print("NOTEBOOK-OK")
    """
)


@pytest.mark.slow
def test_the_notebook_launch_returns_rank_zeros_trained_weights(tmp_path):
    output = run_script(tmp_path, NOTEBOOK_SCRIPT, "colossal_gemini_notebook", timeout=180)
    assert "NOTEBOOK-OK" in output
