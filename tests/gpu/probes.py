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
