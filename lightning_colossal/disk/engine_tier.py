"""What ZeRO and Gemini both do with their disk tier, written once: the engines mix this in."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_colossal.disk.optimizer_state import DiskOptimizerState
from lightning_colossal.engine_parts import optimizer_takeover, sharded_state
from lightning_colossal.engine_parts.stand_ins import deferred_of


class EngineDiskTier:
    """An engine's ``disk_state`` (``None`` without a disk tier) behind the methods ``EngineStrategy`` calls
    (``engine_protocol.StepsOptimizer``). The engine sets ``disk_state``, ``process_group``, ``optimizer`` and ``compute_device``."""

    disk_state: DiskOptimizerState | None
    process_group: ProcessGroup
    optimizer: Optimizer | None
    compute_device: torch.device

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)``, streaming the state on disk through the disk tier; host masters with torch's
        fused kernel ([Note: the host step runs torch's fused kernel] in ``engine_parts/optimizer_takeover.py``)."""
        if self.disk_state is None:
            with optimizer_takeover.fused_host_step(optimizer, self.compute_device):
                return optimizer.step(**kwargs)
        return self.disk_state.step(self.process_group, **kwargs)  # the tier steps each record's masters the same way

    def release_checkpoint_copies(self) -> None:
        """Drop the host copies of on-disk optimizer state a checkpoint read (unchanged since: nothing to write)."""
        if self.disk_state is not None:
            self.disk_state.release()

    def close_disk_tier(self) -> None:
        """Remove the disk tier's files (its state is lost: after the run, or when the engine is dropped)."""
        if self.disk_state is not None:
            self.disk_state.close()
            self.disk_state = None

    def _read_disk_state_for_checkpoint(self) -> None:
        """Before describing the optimizer state for a checkpoint (to save it, or as the destination of a load):
        stand-ins for the state on disk, which the checkpoint reads or fills one at a time ([Note: deferred
        tensors] in ``engine_parts/stand_ins.py``), after a first, zero-learning-rate step if the optimizer never
        stepped. ``release_checkpoint_copies`` (after a save) and the load put the placeholders back."""
        if self.disk_state is None:
            return
        assert self.optimizer is not None
        # The last step's writes may still run; a failed one stops every rank here, before any checkpoint file.
        self.disk_state.settle(self.process_group)
        masters = [master for group in self.optimizer.param_groups for master in group["params"]]
        sharded_state.initialise_optimizer_state(self.optimizer, masters, step=self.disk_state.step)
        self.disk_state.defer()

    def _prepare_disk_state_for_load(self, loaded: dict[str, Any]) -> None:
        """Before applying a loaded optimizer state: a checkpoint without shards brings whole tensors, which are
        copied into the live state, so that state is read into host tensors first (the loaded file is in host
        memory whole anyway). A sharded load already went through the stand-ins."""
        if self.disk_state is not None and _holds_whole_tensors(loaded):
            self.disk_state.materialise()

    def _write_loaded_state_to_disk(self) -> None:
        """After a checkpoint's optimizer state was loaded: write what is in host tensors to the tier."""
        if self.disk_state is not None:
            self.disk_state.store()


def _holds_whole_tensors(loaded: dict[str, Any]) -> bool:
    """Whether a loaded optimizer state has state tensors that are neither pieces (DTensors) nor stand-ins."""
    return any(
        isinstance(value, Tensor) and value.dim() > 0 and not isinstance(value, DTensor) and deferred_of(value) is None
        for entries in loaded.get("state", {}).values()
        for value in entries.values()
    )
