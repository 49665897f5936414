"""Applying torch FSDP2 (``fully_shard``) to a model: which modules become shard units, in which order.

[Note: roots]
FSDP2 gathers a unit's parameters in a pre-forward hook of that unit, and the outermost units ("roots") also
drive the end-of-backward reduction. Lightning calls ``training_step`` on the LightningModule itself, never through
its ``forward``, so sharding the LightningModule would leave its hooks unused. Instead every top-level child of
the LightningModule that holds parameters becomes a root (for the usual ``self.model = ...`` that is one root),
after its transformer blocks were sharded one by one. Parameters registered on the LightningModule itself
belong to no unit and are refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def detect_block_classes(module: nn.Module, known_blocks: Iterable[str] = ()) -> set[str]:
    """Class names of repeated transformer blocks: Hugging Face's ``_no_split_modules`` plus ``known_blocks``."""
    names = set(known_blocks)
    for submodule in module.modules():
        names.update(getattr(submodule, "_no_split_modules", None) or [])
    return names


def parameter_holding_children(module: nn.Module) -> list[nn.Module]:
    """Top-level children of ``module`` that hold parameters (see [Note: roots])."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"Parameters {own} are registered directly on {type(module).__name__}; colossal_fsdp shards submodules."
            " Move them into a submodule (e.g. `self.head = nn.Linear(...)` or an `nn.ParameterDict`)."
        )
    return [child for child in module.children() if any(True for _ in child.parameters())]


def shard_model(
    module: nn.Module,
    mesh: DeviceMesh,
    is_block: Callable[[nn.Module], bool],
    reshard_after_forward: bool,
    mixed_precision: MixedPrecisionPolicy,
    cpu_offload: bool,
    activation_checkpointing: bool,
) -> list[FSDPModule]:
    """Shard every block, then every parameter-holding top-level child of ``module``; return the roots."""
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()

    def shard(unit: nn.Module) -> FSDPModule:
        return fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mixed_precision,
            offload_policy=offload,
        )

    blocks = [submodule for submodule in module.modules() if submodule is not module and is_block(submodule)]
    for block in blocks:
        if activation_checkpointing:
            # The composable form keeps parameter names unchanged (a wrapper module would rename every key).
            from torch.distributed._composable import checkpoint

            checkpoint(block)
        shard(block)
    return [shard(child) for child in parameter_holding_children(module)]


def materialize_meta_parameters(module: nn.Module, device: torch.device) -> bool:
    """Allocate parameters built on the meta device and initialise them; returns whether there were any.

    Each module's own initialiser runs, outermost first: a model whose root knows its full initialisation (the demo
    GPT's ``reset_parameters``, a Hugging Face model's ``init_weights``) is initialised exactly as if it had been
    built normally; its submodules are not initialised a second time.
    """
    if not any(parameter.is_meta for parameter in module.parameters()):
        return False
    module.to_empty(device=device)
    _initialise_outermost(module)
    return True


def _initialise_outermost(module: nn.Module) -> None:
    initialiser = getattr(module, "reset_parameters", None) or getattr(module, "init_weights", None)
    if callable(initialiser):
        with torch.no_grad():
            initialiser()
        return
    for child in module.children():
        _initialise_outermost(child)
