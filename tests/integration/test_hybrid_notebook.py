"""``colossal_hybrid`` from a notebook (the fork launcher): the parent's module gets the trained *whole* weights.

The ranks hold tensor-parallel shards; the launcher must send back each parameter gathered over the tp ranks (and
merged over pipeline stages), under the unsplit model's names and shapes. Runs in a fresh interpreter, as
``test_launchers.py`` does, since forking the pytest process would copy its state into the ranks.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.fresh_interpreter import run_script

pytestmark = pytest.mark.slow

NOTEBOOK_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch
    from lightning.pytorch import Callback

    from lightning_colossal import HybridParallelStrategy
    from tests.distributed import hybrid_bodies as bodies
    from tests.distributed.oracle import quiet_trainer


    class SaveGatheredWeights(Callback):
        # What the ranks hold at the end of fit, gathered whole (a collective), written by rank 0.
        def __init__(self, path):
            self.path = path

        def on_fit_end(self, trainer, pl_module):
            weights = trainer.strategy.full_model_state_dict()
            if trainer.global_rank == 0:
                torch.save(weights, self.path)


    if __name__ == "__main__":
        for kind in sys.argv[1:]:
            module = bodies.TinyGPTModule(kind=kind)
            module.configure_model()  # a notebook builds its model in the parent process
            before = {name: value.clone() for name, value in module.state_dict().items()}
            path = f"ranks_{kind}.pt"
            strategy = HybridParallelStrategy(tp_size=2, start_method="fork")
            trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=2, callbacks=[SaveGatheredWeights(path)])
            trainer.fit(module)
            ranks = torch.load(path)
            after = module.state_dict()
            assert set(ranks) == set(after), sorted(set(ranks) ^ set(after))
            for name, value in after.items():
                torch.testing.assert_close(value, ranks[name], atol=0, rtol=0)
            changed = max((after[name] - before[name]).abs().max().item() for name in before)
            assert changed > 1e-4, f"{kind}: the trained weights did not come back from the forked ranks"
            print(f"{kind}: the parent holds the ranks' whole trained weights (changed by {changed:.3e})")
    """
)


def test_fork_launch_with_tensor_parallelism_returns_whole_trained_weights(tmp_path):
    pytest.importorskip("transformers")
    output = run_script(tmp_path, NOTEBOOK_SCRIPT, "gpt", "llama", timeout=300)
    assert "gpt: the parent holds" in output and "llama: the parent holds" in output
