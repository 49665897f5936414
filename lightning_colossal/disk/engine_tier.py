"""What ZeRO and Gemini both do with their disk tier, written once: the engines mix this in."""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup
from torch.optim import Optimizer

from lightning_colossal.disk.optimizer_state import DiskOptimizerState
from lightning_colossal.engine_parts import sharded_state


class EngineDiskTier:
    """An engine's ``disk_state`` (``None`` without a disk tier) behind the methods ``EngineStrategy`` calls
    (``engine_protocol.StepsOptimizer``). The engine sets ``disk_state``, ``process_group`` and ``optimizer``."""

    disk_state: DiskOptimizerState | None
    process_group: ProcessGroup
    optimizer: Optimizer | None

    def step_optimizer(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """``optimizer.step(**kwargs)``, streaming the state on disk through the disk tier."""
        if self.disk_state is None:
            return optimizer.step(**kwargs)
        return self.disk_state.step(self.process_group, **kwargs)

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
        """Before describing the optimizer state for a checkpoint: read the state on disk into host tensors (after
        a first, zero-learning-rate step if the optimizer never stepped). The next step binds the records again and
        drops these copies; so does ``release_checkpoint_copies``."""
        if self.disk_state is None:
            return
        assert self.optimizer is not None
        masters = [master for group in self.optimizer.param_groups for master in group["params"]]
        sharded_state.initialise_optimizer_state(self.optimizer, masters, step=self.disk_state.step)
        self.disk_state.materialise()

    def _write_loaded_state_to_disk(self) -> None:
        """After a checkpoint's optimizer state was loaded into host tensors: write it to the tier."""
        if self.disk_state is not None:
            self.disk_state.store()
