"""Callbacks the GPU scripts share."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback


class OnDevice(Callback):
    """Fails the run unless the module's parameters are on the GPU when training ends.

    Checked in ``on_train_end``, before the strategy's teardown: Lightning's teardown moves the module to the CPU, so a
    check after ``fit`` would see the CPU whatever the strategy did. Parameters that are empty placeholders (Gemini's,
    between gathers) are skipped.
    """

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        placed = {parameter.device.type for parameter in pl_module.parameters() if parameter.numel() > 1}
        assert placed == {"cuda"}, placed


def check_against_oracle(
    module: Any, steps: int, precision: str, clip_norm: float | None = None, weights: bool = True
) -> None:
    """Compare a module trained on one GPU with single-process PyTorch on the same batches, by precision:

    - ``32-true``: the CPU oracle's weights, within 1e-4 (fp32 on both; kernels differ in rounding only).
    - ``bf16-true``/``bf16-mixed``: the oracle trained on the GPU under bf16 autocast (the same kernels), weights
      within 5e-3. Against the fp32 oracle they differ by up to 0.26 after 16 steps (seen on an H100): AdamW divides
      each update by the gradient's own size, so bf16 rounding in small gradients turns into whole learning-rate-sized
      steps in other directions. Per-step losses are compared too (rtol 2e-2).
    - ``16-mixed``: per-step losses against the GPU oracle under fp16 autocast (rtol 2e-2); weights are not compared,
      because the loss scaler skips the steps that overflow and the oracle does not know which.

    ``weights=False`` compares the losses only, for engines whose mixed precision is not autocast's (FSDP2 casts
    every parameter, LayerNorm's too, to bf16).
    """
    import torch

    from tests.distributed.oracle import float_state, oracle_train

    state = float_state(module)
    losses = torch.tensor(module.micro_batch_losses[-steps:])
    if precision == "32-true":
        oracle = oracle_train(world_size=1, steps=steps, clip_norm=clip_norm)
        tolerance = 1e-4
    else:
        dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
        oracle = oracle_train(world_size=1, steps=steps, clip_norm=clip_norm, autocast_dtype=dtype, device="cuda")
        torch.testing.assert_close(losses, torch.tensor(oracle.step_losses[-len(losses) :]), rtol=2e-2, atol=1e-4)
        tolerance = None if precision == "16-mixed" or not weights else 5e-3
    worst = max((state[name].cpu() - oracle.parameters[name]).abs().max().item() for name in state)
    print("worst", worst)
    if tolerance is not None:
        assert worst < tolerance, worst
