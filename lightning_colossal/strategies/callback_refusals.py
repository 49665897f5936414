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


def refuse_finetuning_callbacks(callbacks: Iterable[Any], strategy_name: str, takes_joining_parameters: bool) -> None:
    """Raise when ``callbacks`` hold a ``BaseFinetuning`` callback (``BackboneFinetuning``).

    The callback names the optimizer's parameters through ``pl_module.named_parameters()`` at every epoch start and, on
    resume, rebuilds the optimizer's groups from those names: it needs the groups to hold the module's parameters,
    where an engine that took the optimizer over holds its masters (rows of them) instead. It failed with a
    ``KeyError`` inside the callback. Where the engine takes parameters that join later
    (``takes_joining_parameters``: ZeRO), the same unfreezing written by hand works, and the message says how.
    """
    for callback in callbacks:
        if not isinstance(callback, lightning_callbacks.BaseFinetuning):
            continue
        if takes_joining_parameters:
            fix = (
                " Unfreeze by hand instead, which this strategy takes: in `on_train_epoch_start` at the epoch you want,"
                " `module.requires_grad_(True)` and `optimizer.add_param_group({'params': list(module.parameters()),"
                " 'lr': ...})` (or build the optimizer over every parameter with the backbone frozen, and only call"
                " `requires_grad_(True)`)."
            )
        else:
            fix = (
                " Put the backbone in the optimizer from the start, in its own param group with a lower learning rate"
                " (a frozen stage is a learning rate of 0 for that group, set by an LR scheduler or a callback that"
                " edits `param_groups[i]['lr']`), or train with `colossal_zero1` / `colossal_zero2`, `colossal_ddp` or"
                " `colossal_fsdp`."
            )
        raise ValueError(
            f"{type(callback).__name__} reads the optimizer's param groups as the module's parameters, but under"
            f" {strategy_name} the engine took the optimizer over and its groups hold the engine's master copies." + fix
        )
