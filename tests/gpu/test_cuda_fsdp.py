"""CUDA-only checks of ColossalFSDPStrategy (skipped without a GPU): FSDP2 over NCCL at one rank, fp32 and
bf16-mixed, against the oracle (tests/gpu/probes.py says which, by precision); a checkpoint saved from GPU shards resumes on the GPU.

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
    from lightning_colossal import ColossalFSDPStrategy
    from tests.distributed.oracle import new_module, quiet_trainer
    from tests.gpu.probes import OnDevice, check_against_oracle

    precision, path, phase = sys.argv[1], sys.argv[2], sys.argv[3]
    module = new_module()
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=ColossalFSDPStrategy(), precision=precision,
                            max_epochs=1 if phase == "save" else 2, gradient_clip_val=0.05,
                            callbacks=[OnDevice()])
    trainer.fit(module, ckpt_path=path if phase == "resume" else None)
    assert trainer.strategy.process_group_backend == "nccl", trainer.strategy.process_group_backend
    if phase == "save":
        trainer.save_checkpoint(path)
        check_against_oracle(module, trainer.global_step, precision, clip_norm=0.05, weights=precision == "32-true")
    print("step", trainer.global_step)
    """
)


def _run(tmp_path: Path, *arguments: str) -> str:
    return run_script(tmp_path, SCRIPT, *arguments)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_cuda_fsdp_matches_oracle_and_resumes(tmp_path, precision):
    path = str(tmp_path / "fsdp.ckpt")
    assert "step 16" in _run(tmp_path, precision, path, "save")
    assert "step 32" in _run(tmp_path, precision, path, "resume")
