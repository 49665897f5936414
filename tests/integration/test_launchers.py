"""Real launches: the README's demo command through Lightning's popen launcher, and the fork (notebook) launcher.

These start fresh interpreters, so they are the slow tests of the suite (~20-40 s each on 2 cores); everything
else multi-process runs in the rank pool.
"""

from __future__ import annotations

import csv
import textwrap

import pytest

from lightning_colossal.checkpoint import is_sharded_checkpoint
from lightning_colossal.checkpoint.sharded import shard_directory
from tests.fresh_interpreter import run_python

pytestmark = pytest.mark.slow


def test_demo_cli_trains_on_two_cpu_processes_and_checkpoints(tmp_path):
    result = run_python(
        [
            "-m",
            "lightning_colossal.demo",
            "fit",
            "--trainer.max_steps=22",
            "--trainer.val_check_interval=11",
            "--trainer.limit_val_batches=2",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            f"--trainer.default_root_dir={tmp_path}",
            "--model.num_layers=1",
            "--model.embed_dim=32",
            "--model.num_heads=2",
            "--model.block_size=32",
            "--data.batch_size=4",
            "--data.max_bytes=200000",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "Starting with 2 processes" in result.stdout + result.stderr, "the popen launcher did not start 2 ranks"
    checkpoints = list(tmp_path.rglob("last.ckpt"))
    assert len(checkpoints) == 1 and is_sharded_checkpoint(checkpoints[0])
    assert len(list(shard_directory(checkpoints[0]).glob("*.distcp"))) == 2
    # The demo's own last.ckpt opens with the demo's class, as users load a trained model.
    from lightning_colossal.demo.module import GPTLightningModule

    trained = GPTLightningModule.load_from_checkpoint(checkpoints[0])
    assert trained.hparams.embed_dim == 32 and trained.model is not None
    assert trained.model.token_embedding.weight.shape[1] == 32
    metrics_files = list(tmp_path.rglob("metrics.csv"))
    assert metrics_files, "no CSV metrics were logged"
    with open(metrics_files[0]) as handle:
        rows = list(csv.DictReader(handle))
    columns = set(rows[0])
    assert {"train/loss", "val/loss", "train/tokens_per_sec"} <= columns, columns
    losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    assert len(losses) >= 3 and all(loss == loss for loss in losses)


NOTEBOOK_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    import lightning_colossal  # registers the names
    from lightning.pytorch import Trainer
    from tests.distributed.oracle import float_state, new_module, quiet_trainer

    if __name__ == "__main__":
        module = new_module()
        before = float_state(module)
        strategy = sys.argv[1]
        if strategy == "spawn":
            strategy = lightning_colossal.ColossalDDPStrategy(start_method="spawn")
        trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=3)
        from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher

        assert isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)
        trainer.fit(module)
        after = float_state(module)
        changed = max((after[name] - before[name]).abs().max().item() for name in before)
        print(f"weights returned to the parent changed by {changed:.3e}")
        assert changed > 1e-4, "the trained weights did not come back from the forked ranks"
    """
)


@pytest.mark.parametrize(
    "strategy",
    ["colossal_ddp_notebook", "spawn", "colossal_zero2_notebook", "colossal_fsdp_notebook", "colossal_gemini_notebook"],
    ids=["fork", "spawn", "zero2-fork", "fsdp-fork", "gemini-fork"],
)
def test_multiprocessing_launchers_return_trained_weights(tmp_path, strategy):
    script = tmp_path / "notebook_run.py"
    script.write_text(NOTEBOOK_SCRIPT)
    result = run_python([str(script), strategy], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert "weights returned to the parent changed by" in result.stdout


FORK_AFTER_THREADED_WORK_SCRIPT = textwrap.dedent(
    """
    import torch
    import lightning_colossal  # registers the names
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from tests.distributed.oracle import new_module, quiet_trainer

    if __name__ == "__main__":
        # A notebook that did real work first: OpenMP's thread pool is running in this process when the ranks fork.
        torch.set_num_threads(2)
        torch.randn(2_000_000).exp_().sum()
        module = new_module()
        checkpoint = ModelCheckpoint(dirpath="checkpoints", save_last=True)
        trainer = quiet_trainer(
            strategy="colossal_ddp_notebook", devices=2, max_steps=3, callbacks=[checkpoint],
            enable_checkpointing=True, logger=CSVLogger("logs"), log_every_n_steps=1,
        )
        trainer.fit(module)
        print("last", trainer.checkpoint_callback.last_model_path)
        print("log_dir", trainer.logger.log_dir)
    """
)


def test_fork_after_threaded_work_does_not_hang_and_names_what_the_ranks_wrote(tmp_path):
    script = tmp_path / "notebook_after_work.py"
    script.write_text(FORK_AFTER_THREADED_WORK_SCRIPT)
    # OMP_NUM_THREADS=2 makes Lightning leave the ranks' thread count alone: without the launcher's guard each
    # forked rank would run 2 OpenMP threads after the parent's pool was started, and wait forever.
    environment = {"OMP_NUM_THREADS": "2"}
    result = run_python([str(script)], tmp_path, timeout=180, environment=environment)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert "the forked ranks run one thread each" in output
    printed = dict(line.split(" ", 1) for line in result.stdout.splitlines() if line.startswith(("last ", "log_dir ")))
    # The notebook's Trainer names the checkpoint and the log version the ranks wrote (relative to its directory).
    assert (tmp_path / printed["last"]).is_file(), printed
    assert (tmp_path / printed["log_dir"] / "metrics.csv").is_file(), printed
