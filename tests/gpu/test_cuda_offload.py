"""CUDA-only checks of the offload modes, where the GPU and host memory are two (skipped without a GPU).

- FSDP2 with CPU offload on a model built on the meta device: parameters materialised on the host, the clip norm of
  host shards over NCCL; it must train exactly like FSDP2 without offload from the same meta build (both initialise
  from the CUDA random stream, so the CPU oracle, which draws from the host's, is not the reference here).
- A resumed run is the uninterrupted run: ZeRO-2 offload under bf16-true (checkpoints hold the fp32 masters), Gemini
  with parameters and optimizer offloaded, and Gemini's automatic placement with a budget that splits the chunks
  between the GPU and the host under 16-mixed (overflow flags on two devices), and both with the optimizer state in
  the disk tier (pinned staging beside the GPU). The resume compares weights, not
  step counts: a resume that loads into copies of the host state instead of the state itself restarts silently.

Each run is a fresh interpreter, so the process group and CUDA context never leak into pytest.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.fresh_interpreter import run_script

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FSDP_META_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning.pytorch import seed_everything
    from lightning_colossal import ColossalFSDPStrategy
    from tests.distributed.oracle import RegressionModule, float_state, quiet_trainer

    offload = sys.argv[1] == "offload"
    seed_everything(5, verbose=False)
    strategy = ColossalFSDPStrategy(cpu_offload=offload)
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, max_steps=6, gradient_clip_val=0.05)
    with trainer.init_module(empty_init=True):
        module = RegressionModule()
    assert all(parameter.is_meta for parameter in module.parameters())
    trainer.fit(module)
    if not offload:
        # The weights a meta build materialises from this seed, trained for zero steps: the same run, stopped at once.
        seed_everything(5, verbose=False)
        initial_trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=ColossalFSDPStrategy(), max_steps=0)
        with initial_trainer.init_module(empty_init=True):
            initial = RegressionModule()
        initial_trainer.fit(initial)
        torch.save(float_state(initial), sys.argv[2].replace(".pt", "-initial.pt"))
    torch.save(float_state(module), sys.argv[2])
    print("losses", module.micro_batch_losses)
    """
)


def test_fsdp_offload_on_a_meta_model_trains_like_fsdp_without_offload(tmp_path):
    for mode in ("offload", "plain"):
        run_script(tmp_path, FSDP_META_SCRIPT, mode, str(tmp_path / f"{mode}.pt"))
    offloaded, plain = torch.load(tmp_path / "offload.pt"), torch.load(tmp_path / "plain.pt")
    initial = torch.load(tmp_path / "plain-initial.pt")
    # Both trained: equal weights that never moved would prove nothing (torch 2.11 once dropped every FSDP gradient).
    assert max((plain[name] - initial[name]).abs().max().item() for name in plain) > 1e-3
    for name, expected in plain.items():
        torch.testing.assert_close(offloaded[name], expected, rtol=1e-5, atol=1e-6, msg=name)


RESUME_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from lightning_colossal import AutoPlacement, GeminiStrategy, StaticPlacement, ZeroStrategy
    from tests.distributed.oracle import float_state, new_module, quiet_trainer

    case, phase, path, out = sys.argv[1:5]
    strategies = {
        "zero2-offload-bf16-true": (lambda: ZeroStrategy(stage=2, cpu_offload=True), "bf16-true"),
        "gemini-offload": (
            lambda: GeminiStrategy(
                placement=StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0), chunk_numel=1100
            ),
            "32-true",
        ),
        "gemini-auto-mixed-16": (
            # 48 MiB: room for cuBLAS's 32 MiB workspace and a few chunks, not for all of them.
            lambda: GeminiStrategy(placement=AutoPlacement(compute_memory_budget=48 * 2**20), chunk_numel=1100),
            "16-mixed",
        ),
        # The disk tier beside a GPU: pinned staging, optimizer state streamed from disk, masters on the host.
        "gemini-disk-bf16-true": (
            lambda: GeminiStrategy(
                placement=StaticPlacement(offload_optim_frac=1.0, disk_fraction=1.0),
                chunk_numel=1100,
                offload_dir=path + ".tier",
            ),
            "bf16-true",
        ),
        "zero2-disk-16-mixed": (
            lambda: ZeroStrategy(stage=2, cpu_offload=True, offload_dir=path + ".tier", disk_fraction=1.0),
            "16-mixed",
        ),
    }
    make, precision = strategies[case]
    strategy = make()
    module = new_module()
    trainer = quiet_trainer(accelerator="cuda", devices=1, strategy=strategy, precision=precision,
                            max_epochs=1 if phase == "save" else 2, gradient_clip_val=0.05)
    trainer.fit(module, ckpt_path=path if phase == "resume" else None)
    if phase == "save":
        trainer.save_checkpoint(path)
    if case == "gemini-offload":
        assert all(chunk.master.device.type == "cpu" for chunk in strategy.engine.manager.chunks)
    if case == "gemini-auto-mixed-16":
        masters = {chunk.master.device.type for chunk in strategy.engine.manager.chunks}
        print("master devices", masters)
    if "disk" in case:
        assert strategy.engine.disk_state is not None and strategy.engine.disk_state.bytes_read > 0
    state = float_state(module)
    assert all(torch.isfinite(tensor).all() for tensor in state.values())
    torch.save(state, out)
    print("step", trainer.global_step)
    """
)


@pytest.mark.parametrize(
    "case",
    [
        "zero2-offload-bf16-true",
        "gemini-offload",
        "gemini-auto-mixed-16",
        "gemini-disk-bf16-true",
        "zero2-disk-16-mixed",
    ],
)
def test_resumed_offload_run_is_the_uninterrupted_run(tmp_path, case):
    path = str(tmp_path / "run.ckpt")
    run_script(tmp_path, RESUME_SCRIPT, case, "straight", path, str(tmp_path / "straight.pt"))
    run_script(tmp_path, RESUME_SCRIPT, case, "save", path, str(tmp_path / "saved.pt"))
    resumed = run_script(tmp_path, RESUME_SCRIPT, case, "resume", path, str(tmp_path / "resumed.pt"))
    assert "step 32" in resumed, resumed[-500:]
    straight, saved = torch.load(tmp_path / "straight.pt"), torch.load(tmp_path / "resumed.pt")
    before = torch.load(tmp_path / "saved.pt")
    assert any(not torch.equal(before[name], straight[name]) for name in straight), "the second epoch changed nothing"
    for name, expected in straight.items():
        torch.testing.assert_close(saved[name], expected, rtol=1e-6, atol=1e-7, msg=name)
