"""Building a model larger than one process: from the meta device straight into chunk shards.

[Note: initialisation in windows]
A model built on the meta device has shapes but no values. Each rank must end up with *its rows* of the values the
model's own initialiser would have produced, without ever holding the whole model. The initialiser (the outermost
``reset_parameters`` or Hugging Face ``init_weights``) draws every parameter from the random stream in a fixed order,
so chunk ``k``'s values depend on everything drawn before it. We therefore run the whole initialiser once per
*window* of chunks, from the same random state each time: the window's parameters point into real chunk-sized
buffers, every other chunked parameter points into one shared scratch buffer that soaks up its writes. After each
pass the rank keeps its rows of the window's chunks. Peak memory is one window plus the largest parameter, the
result is bit-identical to building the model eagerly from the same seed, and it does not depend on the world size.
The cost is one initialiser run per window (``GeminiConfig.init_window_bytes`` trades memory for passes).

An initialiser must only *write* parameters (as ``nn.init`` does); one that reads another parameter's values would
read scratch.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_colossal.distributed.meta_init import materialise_in_place, required_initialisers
from lightning_colossal.gemini.manager import ChunkManager


def materialise_chunks(module: nn.Module, manager: ChunkManager, device: torch.device, window_bytes: int) -> None:
    """Fill every chunk's shard from the model's own initialiser, one window of chunks at a time."""
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_meta:
            materialise_in_place(tensor, device)
    initialisers = required_initialisers(module)
    chunks = manager.chunks
    largest = max((member.numel for chunk in chunks for member in chunk.spec.members), default=0)
    scratch: dict[torch.dtype, torch.Tensor] = {}
    windows: list[list[int]] = []
    filled = window_bytes + 1
    for chunk in chunks:
        size = chunk.spec.numel * chunk.shard.element_size()
        if filled + size > window_bytes and (not windows or windows[-1]):
            windows.append([])
            filled = 0
        windows[-1].append(chunk.index)
        filled += size
    start_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    with torch.no_grad():
        for window in windows:
            torch.set_rng_state(start_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            in_window = set(window)
            buffers = {}
            for chunk in chunks:
                if chunk.index in in_window:
                    buffers[chunk.index] = torch.zeros(chunk.spec.numel, dtype=chunk.shard.dtype, device=device)
                    for member, parameter in zip(chunk.spec.members, chunk.parameters, strict=True):
                        parameter.data = chunk.member_full(buffers[chunk.index], member)
                else:
                    pool = scratch.get(chunk.shard.dtype)
                    if pool is None:
                        pool = scratch[chunk.shard.dtype] = torch.empty(largest, dtype=chunk.shard.dtype, device=device)
                    for parameter in chunk.parameters:
                        parameter.data = pool[: parameter.numel()].view(parameter.shape)
            for submodule in module.modules():
                if getattr(submodule, "_is_hf_initialized", False):
                    submodule.__dict__["_is_hf_initialized"] = False  # HF skips modules it believes initialised
            for initialiser in initialisers:
                initialiser()
            for index in window:
                chunk = chunks[index]
                for member in chunk.spec.members:
                    rows = chunk.member_owned_in_full(buffers[index], member)
                    chunk.member_shard(chunk.shard, member).view(-1).copy_(rows.to(chunk.shard.device))
    manager.shards_to_masters()
    for chunk in chunks:
        manager.detach_parameters(chunk)
