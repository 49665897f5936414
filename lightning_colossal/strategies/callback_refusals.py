"""Lightning callbacks an engine strategy cannot serve, refused at setup with the fix instead of failing mid-run.

``StochasticWeightAveraging`` needs whole parameters on every rank (below); ``BaseFinetuning`` callbacks add
parameters to an optimizer an engine took over at setup (``refuse_finetuning_callbacks``).

[Note: weight averaging and sharded parameters]
``StochasticWeightAveraging`` deep-copies the LightningModule before the strategy shards it, averages
``pl_module.parameters()`` into that copy at each epoch, swaps the LR scheduler and runs an extra epoch for BatchNorm.
Under Gemini a parameter is an empty placeholder between uses (its values live in chunk shards), under FSDP it is a
DTensor shard, and under hybrid tensor or pipeline parallelism it is this rank's piece or absent: the averaging then
fails deep inside torch with a shape or DTensor error (measured: "The size of tensor a (8) must match the size of
tensor b (0)" under colossal_gemini; "mixed torch.Tensor and DTensor" under colossal_fsdp). The strategy refuses it at
setup there, naming ``WeightAveraging``, whose default average is the same SWA average and which every strategy runs
on the weights' own pieces (``strategies/weight_averaging.py``). Where ranks hold every parameter whole (colossal_ddp,
ZeRO-1/2, hybrid with only data parallelism) it trains exactly as under Lightning's own DDP.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch.callbacks as lightning_callbacks


def refuse_averaging_callbacks(callbacks: Iterable[Any], strategy_name: str, pieces: str) -> None:
    """Raise when ``callbacks`` hold ``StochasticWeightAveraging`` and the strategy's ranks hold ``pieces`` of the
    parameters rather than whole ones (see the Note above)."""
    for callback in callbacks:
        if isinstance(callback, lightning_callbacks.StochasticWeightAveraging):
            raise ValueError(
                f"{type(callback).__name__} keeps a whole copy of the model and averages the whole parameters into it,"
                f" but under {strategy_name} each rank holds {pieces}. Use `WeightAveraging()` instead (its default"
                " average is the same SWA average; override its `should_update` to average once per epoch from an"
                " epoch on): it averages each rank's pieces under every strategy. Or train with a strategy that keeps"
                " every parameter whole on every rank: `colossal_zero2`, `colossal_zero1` or `colossal_ddp`."
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
