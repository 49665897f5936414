"""A LightningModule whose ``state_dict`` renames its parameters (litgpt's ``LLM`` drops a level: ``llm.transformer...``
for the parameter ``llm.model.transformer...``): checkpoints hold exactly the module's own keys under every strategy
that puts engine copies into them, so the module's own strict load reads them ([Note: a module's own state_dict
names] in strategies/checkpointing.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import lightning_colossal  # noqa: F401  (registers the strategy names in a fresh worker)
from tests.distributed.oracle import RegressionModel, RegressionModule, float_state, quiet_trainer
from tests.harness.rank_pool import current_world_size


class Renaming(nn.Module):
    """Holds the model one level down, and saves and loads it without that level."""

    def __init__(self) -> None:
        super().__init__()
        self.model = RegressionModel()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)


class RenamingModule(RegressionModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = Renaming()


def renamed_body(strategy: str, precision: str, path: str) -> dict[str, Any]:
    torch.manual_seed(7)
    module = RenamingModule()
    trainer = quiet_trainer(strategy=strategy, devices=current_world_size(), max_steps=2, precision=precision)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    expected_keys = sorted(module.state_dict())
    # A fresh module of the same class reads the checkpoint's weights with its own strict load, and resumes.
    resumed = RenamingModule()
    resumer = quiet_trainer(strategy=strategy, devices=current_world_size(), max_steps=3, precision=precision)
    resumer.fit(resumed, ckpt_path=path)
    return {"keys": expected_keys, "steps": resumer.global_step, "trained": float_state(module)}


@pytest.mark.parametrize(
    ("strategy", "precision"),
    [("colossal_gemini", "32-true"), ("colossal_zero2", "bf16-true")],
    ids=["gemini", "zero2-bf16"],
)
def test_checkpoints_hold_the_modules_own_keys_and_load_strictly(rank_pool_2, tmp_path, strategy, precision):
    path = str(tmp_path / "renamed.ckpt")
    results = rank_pool_2.run(renamed_body, strategy, precision, path)
    saved = torch.load(path, map_location="cpu", weights_only=False)["state_dict"]
    assert sorted(saved) == results[0]["keys"]  # exactly the module's keys: no parameter names beside them
    assert all(not key.startswith("model.model.") for key in saved)
    fresh = RenamingModule()
    fresh.model.load_state_dict({key.removeprefix("model."): value for key, value in saved.items()}, strict=True)
    assert results[0]["steps"] == 3
    # The weights trained, unrounded: fp32 masters under bf16-true.
    torch.testing.assert_close(
        float_state(fresh), results[0]["trained"], rtol=0, atol=0 if precision == "32-true" else 1e-2
    )
