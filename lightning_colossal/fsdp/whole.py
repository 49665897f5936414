"""Whole values of sharded DTensors, one at a time or many in a few collectives (no Lightning here).

[Note: gathering many shards at once]
Giving the module back after a run ([Note: giving the module back] in ``wrap.py``) gathers every parameter and
every optimizer state tensor whole. One ``DTensor.full_tensor()`` each is one collective each: for the 27.4M GPT of
the benchmarks that is 231 all-gathers, which took 1.1 s of a run's teardown on 2 gloo ranks, where Lightning's
FSDP2 strategy gathers nothing. ``full_tensors`` packs the local shards of many tensors into one flat buffer per
bucket and gathers that in a single all-gather, then cuts each whole tensor out of it. Each rank's shard sizes are
exchanged first (one small all-gather of integers) rather than derived from torch's chunking rule, so uneven and
empty shards need no assumption about how DTensor splits rows. Buckets hold at most ``bucket_bytes`` of whole
tensors, so the transient memory stays about twice a bucket (the rank-major receive buffer and the whole tensors cut
out of it) above the gathered values themselves. Tensors that are not a single ``Shard(dim)`` on a one-dimensional
mesh (replicated, or on a 2-D mesh) take ``full_tensor`` one by one; plain tensors come back as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from lightning_colossal.distributed import collectives

#: Whole-tensor bytes gathered in one collective at most ([Note: gathering many shards at once]).
BUCKET_BYTES = 256 * 1024 * 1024


@torch.no_grad()
def full_tensor(tensor: Tensor) -> Tensor:
    """The whole value of a DTensor (a collective over its mesh); other tensors are returned unchanged."""
    if not isinstance(tensor, DTensor):
        return tensor
    return _on_mesh_device(tensor).full_tensor()


@torch.no_grad()
def full_tensors(
    tensors: Sequence[Tensor], device: torch.device | None = None, bucket_bytes: int = BUCKET_BYTES
) -> list[Tensor]:
    """``[full_tensor(t).to(device) for t in tensors]``, gathered in a few collectives ([Note: gathering many shards
    at once]); ``device`` None leaves each where it was gathered. Each bucket's whole tensors move to ``device`` before
    the next is gathered, so a model gathered into host memory never stands whole on the accelerator.

    A collective: every rank of the tensors' meshes passes the same tensors (same global shapes) in the same order.
    """
    results: list[Tensor | None] = [None] * len(tensors)
    batches: dict[tuple[int, torch.dtype], list[int]] = {}
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, DTensor):
            results[index] = tensor if device is None else tensor.to(device)
        elif _sharded_on_one_dimension(tensor) is None:
            results[index] = full_tensor(tensor) if device is None else full_tensor(tensor).to(device)
        else:
            batches.setdefault((id(tensor.device_mesh), tensor.dtype), []).append(index)
    # Every rank builds the same buckets in the same order: they depend on global shapes and the order given.
    for indices in batches.values():
        bucket: list[int] = []
        bucket_size = 0
        for index in indices:
            size = tensors[index].numel() * tensors[index].element_size()
            if bucket and bucket_size + size > bucket_bytes:
                _gather_bucket(tensors, bucket, results, device)
                bucket, bucket_size = [], 0
            bucket.append(index)
            bucket_size += size
        if bucket:
            _gather_bucket(tensors, bucket, results, device)
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def _sharded_on_one_dimension(tensor: DTensor) -> int | None:
    """The dimension ``tensor`` is split along when it is one ``Shard`` on a 1-D mesh, else None."""
    placements = tensor.placements
    if tensor.device_mesh.ndim != 1 or len(placements) != 1 or not isinstance(placements[0], Shard) or not tensor.dim():
        return None
    return placements[0].dim % tensor.dim()


def _on_mesh_device(tensor: DTensor) -> DTensor:
    """``tensor`` with its local shard on its mesh's device: CPU offload keeps shards in host memory while the mesh's
    collectives (nccl) need device tensors."""
    local = tensor.to_local()
    mesh_device = tensor.device_mesh.device_type
    if local.device.type == mesh_device:
        return tensor
    return DTensor.from_local(
        local.to(mesh_device), tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
    )


def _gather_bucket(
    tensors: Sequence[Tensor], bucket: list[int], results: list[Tensor | None], device: torch.device | None
) -> None:
    """Gather the tensors at ``bucket`` (same mesh and dtype, each one ``Shard``) in one exchange into ``results``."""
    sharded = [_on_mesh_device(tensors[index]) for index in bucket]  # type: ignore[arg-type]
    dims = [_sharded_on_one_dimension(tensor) or 0 for tensor in sharded]
    locals_ = [tensor.to_local().contiguous() for tensor in sharded]
    group = sharded[0].device_mesh.get_group()
    mesh_device = locals_[0].device
    # Each rank's length along the split dimension, per tensor: the rest of a shard's shape is the whole tensor's.
    lengths = torch.tensor([local.shape[dim] for local, dim in zip(locals_, dims, strict=True)], device=mesh_device)
    lengths_of: list[list[int]] = collectives.all_gather_tensor(lengths, group).cpu().tolist()  # [rank][tensor]
    if collectives.sends_directly(group) and not any(dims):
        wholes = _received_in_place(sharded, locals_, lengths_of, group)
    else:
        wholes = _received_packed(sharded, locals_, dims, lengths_of, group)
    for index, whole in zip(bucket, wholes, strict=True):
        results[index] = whole if device is None else whole.to(device)


def _received_in_place(
    sharded: list[DTensor], locals_: list[Tensor], lengths_of: list[list[int]], group: ProcessGroup
) -> list[Tensor]:
    """Shards split along dimension 0 on gloo: each rank's rows are sent from where they are and received straight
    into the whole tensors' rows (point-to-point), with no staging buffer to fill, page in and cut up again."""
    wholes = [
        torch.empty(tensor.shape, dtype=tensor.dtype, device=local.device)
        for tensor, local in zip(sharded, locals_, strict=True)
    ]
    starts_of = [[0] * len(wholes)]  # [rank][tensor]: each rank's first row in the whole tensor
    for rank_lengths in lengths_of[:-1]:
        starts_of.append([start + length for start, length in zip(starts_of[-1], rank_lengths, strict=True)])

    def rows_of(rank: int) -> list[Tensor]:
        return [
            whole.narrow(0, start, length)
            for whole, start, length in zip(wholes, starts_of[rank], lengths_of[rank], strict=True)
        ]

    work = collectives.all_gather_pieces_async(locals_, rows_of, group)
    for rows, local in zip(rows_of(collectives.rank(group)), locals_, strict=True):
        rows.copy_(local)
    if work is not None:
        work.wait()
    return wholes


def _received_packed(
    sharded: list[DTensor], locals_: list[Tensor], dims: list[int], lengths_of: list[list[int]], group: ProcessGroup
) -> list[Tensor]:
    """Any split dimension, any backend: the shards packed into one buffer per rank, one all-gather, and each whole
    tensor concatenated from the rank-major result (on an accelerator these copies are cheap next to the network)."""
    device, dtype = locals_[0].device, locals_[0].dtype
    # Elements per entry of the split dimension: the whole tensor's, as every other dimension is whole in a shard.
    slice_numels = [
        tensor.numel() // tensor.shape[dim] if tensor.shape[dim] else 0
        for tensor, dim in zip(sharded, dims, strict=True)
    ]
    starts_of = [[0] for _ in lengths_of]  # [rank][tensor]: where each shard starts in that rank's packed buffer
    for starts, rank_lengths in zip(starts_of, lengths_of, strict=True):
        for length, slice_numel in zip(rank_lengths, slice_numels, strict=True):
            starts.append(starts[-1] + length * slice_numel)
    width = max(starts[-1] for starts in starts_of)
    send = torch.empty(width, dtype=dtype, device=device)
    for local, start in zip(locals_, starts_of[collectives.rank(group)], strict=False):
        send[start : start + local.numel()].copy_(local.reshape(-1))
    received = torch.empty(len(lengths_of) * width, dtype=dtype, device=device)
    collectives.all_gather_into(received, send, group)
    wholes = []
    for position, (tensor, dim) in enumerate(zip(sharded, dims, strict=True)):
        pieces = []
        for rank, (starts, rank_lengths) in enumerate(zip(starts_of, lengths_of, strict=True)):
            shape = list(tensor.shape)
            shape[dim] = rank_lengths[position]
            begin = rank * width + starts[position]
            pieces.append(received[begin : begin + starts[position + 1] - starts[position]].view(shape))
        wholes.append(torch.cat(pieces, dim=dim))
    return wholes
