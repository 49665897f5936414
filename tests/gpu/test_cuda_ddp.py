"""CUDA-only checks of colossal_ddp (skipped without a GPU): NCCL, real fp16 autocast with the loss scaler, and a
checkpoint written from GPU tensors that resumes on the GPU and consolidates on the CPU.

Each test runs a fresh interpreter so the process group and CUDA context never leak into the pytest process.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from tests.fresh_interpreter import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    import lightning_colossal
    from lightning_colossal import ColossalDDPStrategy
    from tests.distributed.oracle import new_module, quiet_trainer
    from tests.gpu.probes import check_against_oracle

    precision, path, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    module = new_module()
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=ColossalDDPStrategy(), precision=precision,
                            max_epochs=1 if phase == "save" else 2)
    trainer.fit(module, ckpt_path=path if phase == "resume" else None)
    assert trainer.strategy.process_group_backend == "nccl", trainer.strategy.process_group_backend
    assert trainer.strategy.root_device.type == "cuda"
    if phase == "save":
        trainer.save_checkpoint(path)
        scaler = trainer.precision_plugin.loss_scaler
        print("scale", None if scaler is None else scaler.scale)
        check_against_oracle(module, trainer.global_step, precision)
    print("step", trainer.global_step)
    """
)


def _run(tmp_path: Path, *arguments: str) -> str:
    return run_script(tmp_path, SCRIPT, *arguments)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_cuda_training_matches_oracle_and_resumes(tmp_path, precision):
    path = str(tmp_path / "cuda.ckpt")
    saved = _run(tmp_path, precision, path, "save")
    assert "step 16" in saved
    resumed = _run(tmp_path, precision, path, "resume")
    assert "step 32" in resumed
    from lightning_colossal.checkpoint import consolidate

    weights = torch.load(consolidate(path, tmp_path / "w.pt", weights_only=True), weights_only=True)
    assert all(tensor.device.type == "cpu" for tensor in weights.values())
