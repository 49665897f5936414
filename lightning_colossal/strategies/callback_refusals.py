"""Lightning callbacks an engine strategy cannot serve, refused at setup with the fix instead of failing mid-run.

Weight-averaging callbacks need whole parameters on every rank (below); ``BaseFinetuning`` callbacks add parameters to
an optimizer an engine took over at setup (``refuse_finetuning_callbacks``).

[Note: weight averaging and sharded parameters]
``WeightAveraging`` / ``EMAWeightAveraging`` and ``StochasticWeightAveraging`` deep-copy the LightningModule before
the strategy shards it, then after steps (or epochs) average ``pl_module.parameters()`` into that copy and copy the
average back for validation and at the end of training. Under Gemini a parameter is an empty placeholder between
uses (its values live in chunk shards), under FSDP it is a DTensor shard, and under hybrid tensor or pipeline
parallelism it is this rank's piece or absent: the averaging then fails deep inside torch with a shape or DTensor
error (measured: "The size of tensor a (8) must match the size of tensor b (0)" under colossal_gemini; "mixed
torch.Tensor and DTensor" under colossal_fsdp). The strategy refuses at setup instead, naming the strategies whose
ranks hold every parameter whole (colossal_ddp, ZeRO-1/2, hybrid with only data parallelism), where these callbacks
train exactly as under Lightning's own DDP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch.callbacks as lightning_callbacks


def _averaging_callback_types() -> tuple[type, ...]:
    # WeightAveraging (and its EMAWeightAveraging) arrived in Lightning 2.6; the project supports 2.5 too.
    names = ("WeightAveraging", "StochasticWeightAveraging")
    return tuple(getattr(lightning_callbacks, name) for name in names if hasattr(lightning_callbacks, name))


def refuse_averaging_callbacks(callbacks: Iterable[Any], strategy_name: str, pieces: str) -> None:
    """Raise when ``callbacks`` hold a weight-averaging callback and the strategy's ranks hold ``pieces`` of the
    parameters rather than whole ones (see the Note above)."""
    types = _averaging_callback_types()
    for callback in callbacks:
        if isinstance(callback, types):
            raise ValueError(
                f"{type(callback).__name__} keeps a whole copy of the model and averages the whole parameters into it,"
                f" but under {strategy_name} each rank holds {pieces}. Train with a strategy that keeps every parameter"
                " whole on every rank: `colossal_zero2` (optimizer state and gradients still sharded), `colossal_zero1`"
                " or `colossal_ddp`; or remove the callback."
            )


def refuse_finetuning_callbacks(callbacks: Iterable[Any], strategy_name: str) -> None:
    """Raise when ``callbacks`` hold a ``BaseFinetuning`` callback (``BackboneFinetuning``): it adds parameters to the
    optimizer mid-run, which an engine that took the optimizer over at setup cannot take (its masters, shards and
    gradient buckets are laid out once). It failed with a ``KeyError`` inside the callback."""
    for callback in callbacks:
        if isinstance(callback, lightning_callbacks.BaseFinetuning):
            raise ValueError(
                f"{type(callback).__name__} adds parameters to the optimizer during training, but under"
                f" {strategy_name} the engine took over the optimizer's parameters at setup and cannot take more."
                " Put the backbone in the optimizer from the start, in its own param group with a lower learning rate"
                " (a frozen stage is a learning rate of 0 for that group, set by an LR scheduler or a callback that"
                " edits `param_groups[i]['lr']`), or remove the callback."
            )
