"""Optimizer state of row-sharded masters (ZeRO and Gemini): by parameter name, clipping, first-step set-up.

Both engines give the user's optimizer one *master* per parameter: this rank's rows of it ([Note: sharding along
dim 0] in ``rows``). Everything here works on that picture only, so a checkpoint written by one engine is read by the
other, by ``colossal_ddp`` and by ``torch.distributed.checkpoint`` at any world size.

[Note: gradients nobody produced]
A rank that did not use a parameter (an unused branch, an expert without tokens) contributes zeros to the average:
the right contribution. But a parameter *no* rank used has no gradient at all in single-process torch (``grad is
None``), and optimizers skip it: no weight decay, no momentum, no Adam step count. So each engine records which
parameters received a gradient on this rank since the last optimizer step (also inside ``no_sync``), combines the
records of all ranks after each reduction (``GradientArrivals.on_any_rank``, one small all-reduce) and gives the
masters of parameters nobody gave a gradient none.

The records are host flags (a ``bytearray``), never elements of a device tensor: the hook that records an arrival runs
on the host, and on a GPU writing a Python number into one element of a device tensor (``flags[i] = 1.0``) is a
blocking host-to-device copy, one wait for the GPU's queue to drain per parameter per step. They travel once per
step, in the all-reduce that combines them, which a group of one rank skips.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim import Optimizer

from lightning_colossal.distributed import collectives
from lightning_colossal.distributed.in_flight import Activity
from lightning_colossal.engine_parts import stand_ins
from lightning_colossal.engine_parts.rows import ShardSpec


@dataclass(frozen=True)
class ShardedMaster:
    """One parameter as the optimizer sees it: its name, its rows on this rank, and the tensor that holds them."""

    name: str
    spec: ShardSpec
    master: Tensor


class ShardedClipping:
    """The clipping and gradient norm of an engine whose optimizer steps on sharded masters (ZeRO, Gemini): each
    element of the whole gradient counted on one rank (``counted_gradients``), one scalar all-reduce, summed on
    ``norm_device`` (where the gradient shards are: the host under ZeRO's offload)."""

    sharded_masters: list[ShardedMaster]
    process_group: ProcessGroup | None
    rank: int

    @property
    def norm_device(self) -> torch.device:
        raise NotImplementedError(f"{type(self).__name__} must say where its gradient shards' norm is summed.")

    def clip_by_norm(self, optimizer: Optimizer, max_norm: float) -> Tensor:
        """Clip all gradient shards by their global L2 norm (one scalar all-reduce); returns the norm."""
        return clip_by_global_norm(self.sharded_masters, max_norm, self.process_group, self.rank, self.norm_device)

    def gradient_norm(self, optimizer: Optimizer, norm_type: float) -> Tensor:
        """The norm of the whole reduced gradient over every rank's shards (one scalar all-reduce)."""
        counted = counted_gradients(self.sharded_masters, self.rank)
        return global_norm(counted, self.process_group, self.norm_device, norm_type)

    def clip_by_value(self, optimizer: Optimizer, clip_value: float) -> None:
        """Clamp every gradient element of this rank's shards to ``[-clip_value, clip_value]``."""
        clip_by_value(self.sharded_masters, clip_value)


class GradientArrivals:
    """Which of ``count`` parameters (in an order every rank shares) got a gradient on this rank since ``clear``: one
    host flag each ([Note: gradients nobody produced])."""

    def __init__(self, count: int) -> None:
        self._flags = bytearray(count)

    def mark(self, position: int) -> None:
        self._flags[position] = 1

    def mark_all(self) -> None:
        self._flags[:] = b"\x01" * len(self._flags)

    def clear(self) -> None:
        self._flags[:] = bytes(len(self._flags))

    def here(self) -> list[bool]:
        """This rank's flags."""
        return [bool(flag) for flag in self._flags]

    def on_any_rank(self, group: ProcessGroup | None) -> list[bool]:
        """Per flag, whether any rank of ``group`` set it; a group of one rank needs no collective."""
        if collectives.world_size(group) == 1:
            return self.here()
        combined = torch.tensor(list(self._flags), dtype=torch.float32)  # float: gloo has no max of bytes
        with Activity("agreeing which parameters got a gradient on any rank"):
            collectives.all_reduce(combined, op="max", group=group)
        return combined.bool().tolist()


def owned_rows_of(tensor: Tensor, spec: ShardSpec) -> Tensor:
    """The rows of a whole ``tensor`` (shaped like the parameter) that ``spec``'s rank owns."""
    if spec.replicated:
        return tensor
    return tensor[spec.row_start : spec.row_end]


def as_global(local: Tensor, spec: ShardSpec, device_mesh: DeviceMesh) -> Tensor:
    """Describe this rank's rows as a piece of the whole tensor (a DTensor sharded on dim 0)."""
    if spec.replicated:
        return local
    return piece_of_whole(local, device_mesh, [Shard(0)], spec.shape)


def piece_of_whole(
    local: Tensor, device_mesh: DeviceMesh, placements: Sequence[Placement], shape: Sequence[int]
) -> DTensor:
    """``local`` as this rank's piece of a contiguous tensor of ``shape`` laid out by ``placements`` (no communication:
    every rank's piece is already where the placements say). Differentiable when ``local`` is on the mesh's device;
    a piece held elsewhere stays there ([Note: offloaded pieces stay where they are])."""
    stride = tuple(math.prod(shape[index + 1 :]) for index in range(len(shape)))
    if local.device.type == device_mesh.device_type or local.is_meta:
        return DTensor.from_local(
            local, device_mesh, list(placements), run_check=False, shape=torch.Size(shape), stride=stride
        )
    # [Note: offloaded pieces stay where they are]
    # torch's from_local copies a local tensor to the mesh's device type. Checkpoints describe live state with these
    # pieces and DCP loads into them in place, so a copy would be a GPU duplicate of offloaded masters and optimizer
    # state that a load fills while the live host tensors keep their old values (a resume that silently restarts
    # from the pre-load weights), and saving would stage the whole offloaded state on the GPU at once. The piece is
    # therefore built around the host tensor itself: DCP reads and writes local tensors wherever they are.
    meta = TensorMeta(torch.Size(shape), stride, local.dtype)
    spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta)
    return DTensor(local.detach().view_as(local), spec, requires_grad=False)


def is_shard_state(value: Any, master: Tensor) -> bool:
    """Optimizer state shaped like its parameter's shard (``exp_avg``), as opposed to scalars (``step``)."""
    return isinstance(value, Tensor) and value.shape == master.shape and value.dim() > 0


def initialise_optimizer_state(
    optimizer: Optimizer, masters: Sequence[Tensor], step: Callable[[], Any] | None = None
) -> None:
    """Create the optimizer's state tensors (a zero-learning-rate step on zero gradients), if it never stepped.

    ``step`` runs the step instead of ``optimizer.step`` (the disk tier streams it).
    """
    if optimizer.state:
        return
    saved_gradients = [master.grad for master in masters]
    for master in masters:
        master.grad = torch.zeros_like(master)
    learning_rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    (step or optimizer.step)()
    for group, learning_rate in zip(optimizer.param_groups, learning_rates, strict=True):
        group["lr"] = learning_rate
    for master, gradient in zip(masters, saved_gradients, strict=True):
        master.grad = gradient


def optimizer_state_by_name(
    optimizer: Optimizer,
    masters: Sequence[ShardedMaster],
    device_mesh: DeviceMesh,
    describe: Callable[[ShardedMaster, Tensor], Tensor] | None = None,
) -> dict[str, Any]:
    """The optimizer state keyed by parameter name, shards as DTensors aliasing the live state.

    ``describe`` replaces the default description (``as_global`` on ``device_mesh``) when the rows are themselves a
    piece of a larger tensor (a tensor-parallel shard under hybrid parallelism).
    """
    initialise_optimizer_state(optimizer, [entry.master for entry in masters])
    entry_of = {id(entry.master): entry for entry in masters}
    state: dict[str, Any] = {}
    param_groups = []
    for group in optimizer.param_groups:
        names = []
        for master in group["params"]:
            entry = entry_of[id(master)]
            names.append(entry.name)
            state[entry.name] = {
                key: _describe(entry, value, device_mesh, describe) if is_shard_state(value, master) else value
                for key, value in optimizer.state[master].items()
            }
        param_groups.append({**{key: value for key, value in group.items() if key != "params"}, "params": names})
    return {"state": state, "param_groups": param_groups}


def _describe(
    entry: ShardedMaster,
    value: Tensor,
    device_mesh: DeviceMesh,
    describe: Callable[[ShardedMaster, Tensor], Tensor] | None,
) -> Tensor:
    return describe(entry, value) if describe is not None else as_global(value, entry.spec, device_mesh)


def load_optimizer_state_by_name(
    optimizer: Optimizer, masters: Sequence[ShardedMaster], loaded: dict[str, Any]
) -> None:
    """Apply a name-keyed state: shards DCP already filled in place, or whole tensors (plain checkpoints)."""
    entry_of = {entry.name: entry for entry in masters}
    for name, entries in loaded["state"].items():
        entry = entry_of.get(name)
        if entry is None:
            continue
        master = entry.master
        live = optimizer.state[master]
        for key, value in entries.items():
            current = live.get(key)
            if isinstance(value, DTensor):
                if current is None or value.to_local().data_ptr() != current.data_ptr():
                    live[key] = value.to_local().to(master.device).clone()
            elif isinstance(value, Tensor) and value is current:
                pass  # DCP filled the live tensor in place
            elif isinstance(value, Tensor) and isinstance(current, Tensor) and is_shard_state(current, master):
                current.copy_(owned_rows_of(value, entry.spec) if value.shape == entry.spec.shape else value)
            elif isinstance(value, Tensor) and isinstance(current, Tensor):
                current.copy_(value)
            else:
                live[key] = value
    for entry in masters:
        if entry.name not in loaded["state"] and entry.master in optimizer.state:
            # The checkpoint holds no state for it (no gradient had reached it): none here either, as in the run that
            # saved it, so a first gradient starts it fresh. A stand-in the disk tier put there goes too.
            for value in optimizer.state.pop(entry.master).values():
                if isinstance(value, Tensor) and stand_ins.deferred_of(value) is not None:
                    stand_ins.withdraw(value)
    for group, saved in zip(optimizer.param_groups, loaded["param_groups"], strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})


def clip_by_global_norm(
    masters: Sequence[ShardedMaster], max_norm: float, process_group: ProcessGroup, rank: int, device: torch.device
) -> Tensor:
    """Clip every master gradient by the L2 norm over all ranks' shards (one scalar all-reduce); returns the norm.

    Replicated (zero-dimensional) parameters are held identically by every rank, so only rank 0 counts them.
    """
    gradients = [entry.master.grad for entry in masters if entry.master.grad is not None]
    return scale_to_global_norm(gradients, counted_gradients(masters, rank), max_norm, process_group, device)


def counted_gradient(entry: ShardedMaster, rank: int) -> Tensor | None:
    """What of ``entry``'s master gradient this rank contributes to a norm over all ranks: its shard, a replicated one
    on rank 0 only (``None``: nothing)."""
    gradient = entry.master.grad
    if gradient is None or not gradient.numel() or (rank != 0 and entry.spec.replicated):
        return None
    return gradient


def counted_gradients(masters: Sequence[ShardedMaster], rank: int) -> list[Tensor]:
    """The master gradients this rank contributes to a global norm: its shards, and replicated ones on rank 0 only."""
    return [gradient for entry in masters if (gradient := counted_gradient(entry, rank)) is not None]


def global_norm(
    counted: Sequence[Tensor],
    process_group: ProcessGroup | None,
    device: torch.device,
    norm_type: float = 2.0,
    activity: str = "summing the gradient norm",
) -> Tensor:
    """The ``norm_type`` norm of the gradient whose elements are ``counted`` over ``process_group``'s ranks (each
    element on exactly one rank; the world when ``None``): one scalar all-reduce, accumulated in fp64."""
    if norm_type == math.inf:
        largest = torch.zeros((), dtype=torch.float64, device=device)
        for device_gradients in _by_device(list(counted)):
            norms = torch._foreach_norm(device_gradients, math.inf)
            largest = torch.maximum(largest, torch.stack(norms).double().max().to(device))
        with Activity(activity):
            collectives.all_reduce(largest, op="max", group=process_group)
        return largest.float()
    powers = torch.zeros((), dtype=torch.float64, device=device)
    for device_gradients in _by_device(list(counted)):
        # Per-tensor norms in one fused pass per device (as torch's clip_grad_norm_), their powers summed in fp64.
        powers += torch.stack(torch._foreach_norm(device_gradients, norm_type)).double().pow(norm_type).sum().to(device)
    with Activity(activity):
        collectives.all_reduce(powers, op="sum", group=process_group)
    return (powers.sqrt() if norm_type == 2.0 else powers.pow(1.0 / norm_type)).float()


def scale_to_global_norm(
    gradients: Sequence[Tensor],
    counted: Sequence[Tensor],
    max_norm: float,
    process_group: ProcessGroup | None,
    device: torch.device,
) -> Tensor:
    """Scale ``gradients`` so that the global L2 norm is at most ``max_norm``; returns the norm.

    ``counted`` are the gradients this rank contributes to the norm (each element of the global gradient must be
    counted on exactly one rank); their squares are summed over ``process_group`` (the world when ``None``).
    """
    norm = global_norm(counted, process_group, device, 2.0, "summing the gradient norm for clipping")
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for device_gradients in _by_device(gradients):
        torch._foreach_mul_(device_gradients, coefficient.to(device_gradients[0].device))
    return norm


def clip_by_value(masters: Sequence[ShardedMaster], clip_value: float) -> None:
    """Clamp every gradient element of this rank's shards to ``[-clip_value, clip_value]``."""
    for entry in masters:
        if entry.master.grad is not None:
            entry.master.grad.clamp_(-clip_value, clip_value)


def _by_device(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[torch.device, list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.device, []).append(tensor)
    return list(groups.values())


def norms_by_name(
    names: Sequence[str],
    pieces: Mapping[str, Tensor | None],
    process_group: ProcessGroup | None,
    device: torch.device,
    norm_type: float = 2.0,
) -> dict[str, Tensor]:
    """The ``norm_type`` norm of each of ``names``' gradients over ``process_group``'s ranks, for the names that have
    one on any rank. ``pieces`` holds the names with a gradient on this rank (others are ignored), each with the piece
    of it this rank counts (``None`` or empty: none of it; every element is counted on exactly one rank). ``names`` is
    the same list, in the same order, on every rank: one all-reduce of two values per name (the powers, accumulated in
    fp64 as in ``global_norm``, and whether the rank has a gradient), built without a value written per name."""
    index_of = {name: index for index, name in enumerate(names)}
    present = [1.0 if name in pieces else 0.0 for name in names]
    values = torch.tensor([[0.0] * len(names), present], dtype=torch.float64).to(device)  # one copy
    counted: dict[torch.device, tuple[list[int], list[Tensor]]] = {}
    for name, piece in pieces.items():
        if name in index_of and piece is not None and piece.numel():
            indices, tensors = counted.setdefault(piece.device, ([], []))
            indices.append(index_of[name])
            tensors.append(piece.detach())
    for indices, tensors in counted.values():
        # Per-tensor norms in one fused pass per device, as global_norm's.
        norms = torch.stack(torch._foreach_norm(tensors, norm_type, dtype=torch.float32)).double().to(device)
        powers = norms if norm_type == math.inf else norms.pow(norm_type)
        values[0].index_copy_(0, torch.tensor(indices).to(device), powers)
    with Activity("summing per-parameter gradient norms"):
        collectives.all_reduce(values, op="max" if norm_type == math.inf else "sum", group=process_group)
    norms = (values[0] if norm_type == math.inf else values[0].pow(1.0 / norm_type)).float().unbind()
    agreed = values[1].tolist()  # one read, after the collective
    return {name: norms[index] for index, name in enumerate(names) if agreed[index] > 0}
