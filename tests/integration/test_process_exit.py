"""How a process that ran a strategy leaves: the exit handler destroys its process groups after a clean run only.

The handler also lets gloo's worker threads finish before the interpreter finalises (group_cache.py [Note: let
gloo's workers finish before the interpreter exits]); that race is rare (about one demo run in 27) and could not be
provoked on demand, so it is not tested here. These tests check the rest of the handler in a fresh interpreter: the
groups are destroyed at exit after a clean run, and left alone after a failed one (whose work may wait on a dead
peer).
"""

from __future__ import annotations

import textwrap

import pytest

from tests.fresh_interpreter import run_python

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent(
    """
    import atexit
    import sys

    import torch
    import torch.distributed as dist

    # Registered first, so it runs last: it sees what the library's handler left.
    atexit.register(lambda: print("process group alive at exit:", dist.is_initialized(), flush=True))

    import lightning.pytorch as pl
    import lightning_colossal  # noqa: F401

    torch.set_num_threads(1)


    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_index):
            if sys.argv[1] == "failing" and self.global_step == 1:
                raise ValueError("planted failure")
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)


    trainer = pl.Trainer(
        strategy=sys.argv[2], accelerator="cpu", devices=1, max_steps=3, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    try:
        trainer.fit(Model())
    except ValueError as error:
        print("fit raised:", error, flush=True)
    """
)


# One strategy: the handler is registered and told how the run ended by the base strategy every mode shares
# (strategies/processes.py, strategies/failures.py). Gemini, because its teardown does the most after a failure.
@pytest.mark.parametrize("strategy", ["colossal_gemini"])
def test_the_process_groups_are_destroyed_at_exit_after_a_clean_run_only(tmp_path, strategy):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    outputs = {}
    for how in ("clean", "failing"):
        result = run_python([str(script), how, strategy], tmp_path, timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
        outputs[how] = result.stdout
    assert "process group alive at exit: False" in outputs["clean"], outputs["clean"][-2000:]
    assert "fit raised: planted failure" in outputs["failing"], outputs["failing"][-2000:]
    assert "process group alive at exit: True" in outputs["failing"], outputs["failing"][-2000:]
