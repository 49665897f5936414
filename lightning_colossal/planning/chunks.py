"""Gemini's chunks for a list of parameter shapes, laid out and placed by the engine's own pure functions.

``GeminiEngine`` searches the chunk size (``search_chunk_numel`` with ``GeminiConfig``'s defaults), packs the
parameters in registration order (``build_layout``) and places chunks by their bytes (``static_plan``); calling the
same functions gives the planner the engine's exact shard sizes and placement, also for partial offload fractions.
The disk tier's share (``StaticPlacement.disk_fraction``, ``static_plan``'s ``disk_optimizer``) is counted in chunk
bytes from the first chunk, like ``offload_optim_frac``. Automatic placement (``auto_plan``) puts every optimizer in
host memory and starts every shard there; under its host budget the chunks whose state goes to disk are the setting's
``disk_chunks``, which ``host_budget.py`` chooses with the engine's own ``disk_by_host_budget``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_colossal.planning.settings import Setting

__all__ = ["ChunkShape", "chunk_layout"]


@dataclass(frozen=True)
class ChunkShape:
    """One chunk as one rank holds it.

    Args:
        numel: elements of the gathered chunk (its members, whole).
        shard_numel: elements of this rank's shard (its rows of every member).
        tensors: parameters in the chunk.
        member_numels: elements of this rank's rows of each member, in order (its master views).
        optimizer_offloaded: master, gradient shard and optimizer state in host memory.
        parameters_offloaded: the working shard waits in host memory between uses.
        optimizer_on_disk: the optimizer state shaped like the parameters (Adam's moments) lives on disk between
            steps (``StaticPlacement(disk_fraction=...)``); the gradient shard stays in host memory, and so does the
            master unless ``masters_on_disk`` moves it (``model_state.shard_is_master`` says whether there is one).
        shard_moves: automatic placement brings the shard from host memory onto the compute device when a module
            needs it, so on a GPU its fp32 master is a copy of its own in host memory (``ChunkManager``: a shard that
            will move cannot share storage with a master the optimizer keeps on the host).
    """

    numel: int
    shard_numel: int
    tensors: int
    member_numels: tuple[int, ...]
    optimizer_offloaded: bool
    parameters_offloaded: bool
    optimizer_on_disk: bool = False
    shard_moves: bool = False


@functools.lru_cache(maxsize=8)
def _chunk_capacity(numels: tuple[int, ...]) -> int:
    """The chunk size ``GeminiEngine`` searches with ``GeminiConfig``'s defaults (cached: a plan asks for it several
    times, and the search packs the model once per candidate size)."""
    from lightning_colossal.config import GeminiConfig
    from lightning_colossal.gemini.layout import search_chunk_numel

    config = GeminiConfig()
    choice = search_chunk_numel(
        list(numels), config.min_chunk_numel, config.search_range_numel, config.search_step_numel
    )
    return choice.chunk_numel


def chunk_layout(
    shapes: Sequence[tuple[int, ...]], parameter_bytes: int, setting: Setting, world_size: int, rank: int
) -> list[ChunkShape]:
    """The chunks ``GeminiEngine`` builds for trainable parameters of ``shapes`` (in order) under ``setting``."""
    from lightning_colossal.config import StaticPlacement
    from lightning_colossal.gemini.layout import build_layout
    from lightning_colossal.gemini.placement import auto_plan, static_plan

    capacity = _chunk_capacity(tuple(math.prod(shape) for shape in shapes))
    specs = build_layout([(str(index), shape) for index, shape in enumerate(shapes)], capacity, world_size, rank)
    if setting.automatic:
        # Budgeted: a GPU always is (without compute_memory_budget the budget is the device's memory), and on CPU
        # ranks, where automatic placement has no budget, the device and the host are one memory anyway.
        plan = auto_plan(len(specs), budgeted=True)._replace(disk_optimizer=setting.disk_chunks)
    else:
        placement = StaticPlacement(
            offload_optim_frac=1.0 if setting.offload else 0.0,
            offload_param_frac=setting.offload_parameters,
            disk_fraction=setting.disk_fraction,
        )
        plan = static_plan([spec.numel * parameter_bytes for spec in specs], placement)
    return [
        ChunkShape(
            numel=spec.numel,
            shard_numel=spec.shard_numel,
            tensors=len(spec.members),
            member_numels=tuple(member.spec.local_numel for member in spec.members),
            optimizer_offloaded=spec.index in plan.offload_optimizer,
            parameters_offloaded=spec.index in plan.offload_parameters or spec.index in plan.start_offloaded,
            optimizer_on_disk=spec.index in plan.disk_optimizer,
            shard_moves=spec.index in plan.start_offloaded,
        )
        for spec in specs
    ]
