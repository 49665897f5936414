"""Settings of the FSDP2 strategy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """Settings of torch FSDP2 as used by ``ColossalFSDPStrategy`` (``lightning_colossal.fsdp``).

    Args:
        wrap_policy: which modules to shard one by one (transformer blocks): class names, or a predicate
            ``module -> bool``. ``None`` detects them: the classes a model names in ``_no_split_modules`` (Hugging
            Face models; the demo GPT declares its ``Block`` the same way).
        reshard_after_forward: free gathered parameters after forward (ZeRO-3); ``False`` keeps them until backward
            (ZeRO-2-like: more memory, one all-gather less per step).
        cpu_offload: keep parameter, gradient and optimizer shards in CPU memory (FSDP2's ``CPUOffloadPolicy``).
        activation_checkpointing: recompute each sharded block's activations in backward.
        replicate_size: hybrid sharding (HSDP): parameters are sharded within groups of ``world / replicate_size``
            ranks and replicated across ``replicate_size`` such groups (e.g. one group per node); 1 is plain FSDP.
            It must divide the world size, which is checked when the processes are known.
        keep_weights_sharded: after each run leave the module's parameters as FSDP's DTensor shards instead of
            gathering full plain tensors onto every rank (the default, as Lightning's ``ddp``). For models too large
            for one rank's memory; see [Note: what the module holds after a run] in ``strategies/fsdp.py``.
    """

    wrap_policy: tuple[str, ...] | Callable[[Any], bool] | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    replicate_size: int = 1
    keep_weights_sharded: bool = False

    def __post_init__(self) -> None:
        if self.replicate_size < 1:
            raise ValueError(
                f"replicate_size={self.replicate_size}: pass 1 (plain FSDP) or the number of replica groups."
            )
