"""CUDA-only checks of ZeroStrategy (skipped without a GPU): CPU offload with real device<->host copies (pinned
buffers, non-blocking transfers) and fp16 loss scaling on the GPU, against the CPU oracle; resume on the GPU.

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
    from lightning_colossal import ZeroStrategy
    from tests.distributed.oracle import new_module, quiet_trainer
    from tests.gpu.probes import OnDevice, check_against_oracle

    stage, offload, precision, path, phase = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3], sys.argv[4], sys.argv[5]
    module = new_module()
    strategy = ZeroStrategy(stage=stage, cpu_offload=offload)
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, precision=precision,
                            max_epochs=1 if phase == "save" else 2, gradient_clip_val=0.05,
                            callbacks=[OnDevice()])
    trainer.fit(module, ckpt_path=path if phase == "resume" else None)
    engine = trainer.strategy.engine
    if offload:
        assert engine.master_buffer.device.type == "cpu" and engine.master_buffer.is_pinned()
    if phase == "save":
        trainer.save_checkpoint(path)
        check_against_oracle(module, trainer.global_step, precision, clip_norm=0.05)
    print("step", trainer.global_step)
    """
)


def _run(tmp_path: Path, *arguments: str) -> str:
    return run_script(tmp_path, SCRIPT, *arguments)


@pytest.mark.parametrize(
    ("stage", "offload", "precision"),
    [(2, "1", "32-true"), (1, "1", "32-true"), (2, "0", "16-mixed"), (2, "1", "bf16-mixed")],
)
def test_cuda_zero_matches_oracle_and_resumes(tmp_path, stage, offload, precision):
    path = str(tmp_path / "zero.ckpt")
    assert "step 16" in _run(tmp_path, str(stage), offload, precision, path, "save")
    assert "step 32" in _run(tmp_path, str(stage), offload, precision, path, "resume")
