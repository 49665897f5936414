"""Initialising a model built on the meta device after ``fully_shard``, each rank materialising only its shards.

[Note: FSDP meta initialisation]
Running the model's initialiser on FSDP2's DTensor shards draws every rank's shard from the random stream as if it
were the whole tensor: on a CPU mesh every rank fills its rows from the same state (duplicated rows across ranks),
and on any mesh the values differ from an eager build of the same seed. Instead, a storage-free copy of the
unsharded model is taken *before* sharding, and the shared windowed initialisation (``distributed/meta_init.py``)
runs the model's own initialiser on it, window by window, handing each tensor's whole value to this rank, which
keeps its shard. Every rank starts from rank 0's random state, so the shards fit together into exactly the model
an eager build of the same seed gives (for models whose constructors draw nothing themselves, as there). Peak
memory is one window, not the model.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_colossal.distributed.meta_init import initialise_in_windows, start_from_rank_zero_random_state

DEFAULT_INIT_WINDOW_BYTES = 1 << 30


def storage_free_template(module: nn.Module) -> nn.Module:
    """A storage-free copy of ``module``'s parameter-holding children under their own names, taken before sharding.

    The LightningModule itself is not copied (it refers to the Trainer); its children are what FSDP shards and what
    carry the initialisers.
    """
    template = nn.Module()
    for name, child in module.named_children():
        template.add_module(name, copy.deepcopy(child))
    return template


@torch.no_grad()
def initialise_shards(module: nn.Module, template: nn.Module, device: torch.device, window_bytes: int) -> None:
    """Give ``module``'s meta shards (after ``fully_shard``) the values of ``template``'s initialiser (see [Note: FSDP
    meta initialisation]). Every rank of the sharding mesh must call this: it broadcasts rank 0's random state."""
    # FSDP2's own way to give meta shards storage; buffers too.
    module.to_empty(device=device)
    live: dict[str, Tensor] = dict(
        [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    )

    def keep(names: list[str], whole: Tensor) -> None:
        targets = {id(live[name]): live[name] for name in names if name in live}
        for target in targets.values():
            if isinstance(target, DTensor):
                # src_data_rank=None: every rank cuts its own shard from the same whole value, no communication.
                shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(whole)

    start_from_rank_zero_random_state(device)
    initialise_in_windows(template, lambda names: any(name in live for name in names), keep, device, window_bytes)
    left = [
        name for name, tensor in live.items() if (tensor.to_local() if isinstance(tensor, DTensor) else tensor).is_meta
    ]
    if left:
        raise ValueError(f"{left[:5]} are still on the meta device after initialisation: build them on a real device.")
