"""CUDA-only check of HybridParallelStrategy (skipped without a GPU): a model built on the meta device is
initialised on the GPU from the CUDA random stream, window by window, exactly as the eager model built on the GPU
from the same seed, and both train identically under bf16-mixed. Each run is a fresh interpreter, so the process
group and CUDA context never leak into pytest."""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.fresh_interpreter import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning.pytorch import seed_everything
    from lightning_colossal import HybridParallelStrategy
    from tests.distributed.hybrid_bodies import MODEL_SEED, TinyGPTModule, full_weights
    from tests.distributed.oracle import quiet_trainer
    from tests.gpu.probes import OnDevice

    meta = sys.argv[1] == "meta"
    seed_everything(MODEL_SEED, verbose=False)
    # Small windows: several initialisation passes, each restarting the CUDA random stream.
    strategy = HybridParallelStrategy(init_window_bytes=4096)
    module = TinyGPTModule(meta=True) if meta else TinyGPTModule()
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=2, precision="bf16-mixed",
                            callbacks=[OnDevice()])
    trainer.fit(module)
    torch.save(full_weights(module, strategy), sys.argv[2])
    """
)


def test_meta_device_model_on_cuda_trains_like_the_eager_model(tmp_path):
    for build in ("eager", "meta"):
        run_script(tmp_path, SCRIPT, build, str(tmp_path / f"{build}.pt"))
    eager = torch.load(tmp_path / "eager.pt")
    meta = torch.load(tmp_path / "meta.pt")
    assert set(eager) == set(meta)
    for name, expected in eager.items():
        torch.testing.assert_close(
            meta[name], expected, atol=1e-6, rtol=1e-6, msg=lambda message, name=name: f"{name}: {message}"
        )
