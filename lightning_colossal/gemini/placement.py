"""Placement decisions from byte counts (pure logic, testable without devices or process groups).

Static placement fixes, once, which chunks stay gathered, which have their optimizer on the CPU and which park their
parameter shards on the CPU. Automatic placement decides before every module which chunks to move off the compute
device so the module's chunks fit the budget, evicting the chunk whose next use is farthest away (Belady's rule,
which is optimal for a known future; the future is the module order traced in the warm-up step).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from lightning_colossal.config import StaticPlacement


class PlacementPlan(NamedTuple):
    """Chunk indices per decision.

    ``offload_parameters`` park their shards on the CPU for good (static placement); ``start_offloaded`` only start
    there, and automatic placement brings each onto the compute device when a module first needs it, as the budget
    allows.
    """

    keep_gathered: frozenset[int]
    offload_optimizer: frozenset[int]
    offload_parameters: frozenset[int]
    start_offloaded: frozenset[int] = frozenset()
    disk_optimizer: frozenset[int] = frozenset()  # optimizer state on disk between steps (a subset of the above)


def leading_share(chunk_bytes: Sequence[int], fraction: float) -> frozenset[int]:
    """The first chunks (in order) whose bytes add up to at most ``fraction`` of the total (all of them at 1.0)."""
    if fraction >= 1.0:
        return frozenset(range(len(chunk_bytes)))
    # A relative tolerance so that 1.0 - 0.9 (= 0.0999...98) still admits a chunk of exactly 10% of the bytes.
    limit = fraction * sum(chunk_bytes) * (1 + 1e-9)
    chosen: set[int] = set()
    running = 0
    for index, size in enumerate(chunk_bytes):
        if running + size > limit:
            break
        running += size
        chosen.add(index)
    return frozenset(chosen)


def static_plan(chunk_bytes: Sequence[int], placement: StaticPlacement) -> PlacementPlan:
    """Which chunks stay gathered (the *last* ones, used first by backward), offload optimizer or parameters."""
    reversed_share = leading_share(list(reversed(chunk_bytes)), 1.0 - placement.shard_param_frac)
    keep = frozenset(len(chunk_bytes) - 1 - index for index in reversed_share)
    return PlacementPlan(
        keep_gathered=keep,
        offload_optimizer=leading_share(chunk_bytes, placement.offload_optim_frac),
        offload_parameters=leading_share(chunk_bytes, placement.offload_param_frac),
        disk_optimizer=leading_share(chunk_bytes, placement.disk_fraction),
    )


class HostBudgetTooSmall(ValueError):
    """Model state does not fit the host-memory budget, even with every chunk's optimizer state on disk."""


def disk_by_host_budget(
    host_bytes: Sequence[int],
    state_bytes: Sequence[int],
    budget: int,
    has_disk: bool,
    staging_bytes: Callable[[Sequence[int]], int] = lambda sizes: 0,
) -> frozenset[int]:
    """The chunks whose optimizer state goes to disk so that this rank's host bytes fit ``budget``: the last chunks
    first (the first chunks' state stays in memory, like ``offload_optim_frac`` counts them).

    Args:
        host_bytes: per chunk, every byte it keeps in host memory with its optimizer state there too.
        state_bytes: per chunk, the optimizer state's share of those bytes (what the disk can take).
        budget: the host-memory budget in bytes.
        has_disk: whether an ``offload_dir`` was given.
        staging_bytes: the host buffers the tier streams the chosen chunks' state through, from their state bytes
            (``disk.optimizer_state.staging_bytes_for``): counted against the budget too.
    """
    kept = sum(host_bytes)
    chosen: list[int] = []
    for index in reversed(range(len(host_bytes))):
        if kept + staging_bytes([state_bytes[i] for i in chosen]) <= budget or not has_disk:
            break
        if state_bytes[index]:
            kept -= state_bytes[index]
            chosen.append(index)
    total = kept + staging_bytes([state_bytes[i] for i in chosen])
    if total > budget:
        least = total if not has_disk else sum(host_bytes) - sum(state_bytes) + staging_bytes(state_bytes)
        fix = (
            "raise host_memory_budget, train on more ranks (each holds 1/N of the state), or pass offload_dir to put"
            " optimizer state on disk"
            if not has_disk
            else "raise host_memory_budget, train on more ranks (each holds 1/N), or pass masters_on_disk=True with"
            " bf16 parameters (fp32 masters go to disk too); gradient shards, offloaded parameter shards and the"
            " tier's staging buffers stay in host memory"
        )
        raise HostBudgetTooSmall(
            f"This rank's model state needs {least:,} bytes of host memory"
            f"{' with every optimizer state on disk' if has_disk else ''}, more than"
            f" host_memory_budget={budget:,}: {fix}."
        )
    return frozenset(chosen)


def auto_plan(num_chunks: int, budgeted: bool) -> PlacementPlan:
    """Automatic placement puts every optimizer on the CPU. Under a budget (``budgeted``) every parameter shard starts
    on the CPU too and comes onto the device when a module first needs it: all shards on the device at once could
    already exceed the budget (a model of 4 bytes per element larger than the device) before the first eviction.
    Without a budget (the CPU's default) the shards start on the device, where they are used."""
    everything = frozenset(range(num_chunks))
    return PlacementPlan(frozenset(), everything, frozenset(), everything if budgeted else frozenset())


class NextUse:
    """``next_use_distance`` for every position and chunk of one sequence, answered from each chunk's sorted use
    positions (a binary search) instead of a scan of the sequence: automatic placement asks it for every evictable
    chunk before every module, which with a scan cost chunks x ops per module (66 s steps at 511 chunks)."""

    def __init__(self, sequence: Sequence[frozenset[int]]) -> None:
        self.length = len(sequence)
        self.uses: dict[int, list[int]] = {}
        for position, chunks in enumerate(sequence):
            for chunk in chunks:
                self.uses.setdefault(chunk, []).append(position)

    def distance(self, position: int, chunk: int) -> float:
        """Ops from ``position`` until ``chunk`` is used again, wrapping around (``math.inf``: never)."""
        uses = self.uses.get(chunk)
        if not uses:
            return math.inf
        following = bisect.bisect_right(uses, position % self.length)
        if following < len(uses):
            return uses[following] - position % self.length
        return uses[0] + self.length - position % self.length


def next_use_distance(sequence: Sequence[frozenset[int]], position: int, chunk: int) -> float:
    """Ops from ``position`` until ``chunk`` is used again, wrapping around (the sequence repeats every step)."""
    length = len(sequence)
    for distance in range(1, length + 1):
        if chunk in sequence[(position + distance) % length]:
            return distance
    return math.inf


class BudgetTooSmall(ValueError):
    """The compute-memory budget cannot hold one module's working set."""


def choose_evictions(
    evictable_bytes: Mapping[int, int],
    needed_bytes: int,
    resident_bytes: int,
    non_model_bytes: int,
    budget: int,
    next_use: Mapping[int, float],
) -> list[int]:
    """Chunks to move off the compute device, in order, so that ``needed_bytes`` more fit in ``budget``.

    Args:
        evictable_bytes: chunks that may leave the device now, with the device bytes each would free.
        needed_bytes: bytes the current module still has to bring onto the device.
        resident_bytes: model bytes on the device now (evictable or not).
        non_model_bytes: traced activations and temporaries expected at this module.
        budget: bytes of device memory the model may use.
        next_use: ops until each chunk is needed again (missing: never).
    """
    free = budget - non_model_bytes - resident_bytes
    if free >= needed_bytes:
        return []
    order = sorted(evictable_bytes, key=lambda chunk: (-next_use.get(chunk, math.inf), chunk))
    evicted = []
    for chunk in order:
        evicted.append(chunk)
        free += evictable_bytes[chunk]
        if free >= needed_bytes:
            return evicted
    required = needed_bytes + non_model_bytes + resident_bytes - sum(evictable_bytes.values())
    raise BudgetTooSmall(
        f"{budget} usable bytes of compute memory cannot hold this module's working set: it needs at least {required}"
        f" bytes ({needed_bytes + resident_bytes - sum(evictable_bytes.values())} of chunks in use and"
        f" {non_model_bytes} of non-model memory: activations, and on a GPU the libraries' workspaces, such as"
        f" cuBLAS's 32 MiB). Raise AutoPlacement(compute_memory_budget=...) to at least {required},"
        " or use smaller chunks (chunk_numel) or a smaller batch."
    )
