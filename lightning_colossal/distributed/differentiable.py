"""Collectives that autograd can differentiate: the communication of tensor and sequence parallelism.

Each function is the forward of a pair whose backward is its adjoint (Megatron's ``f``/``g`` operators):

| forward                                 | backward                         | used by                               |
|-----------------------------------------|----------------------------------|---------------------------------------|
| identity                                | all-reduce                       | input of a column-parallel linear      |
| all-reduce                              | identity                         | output of a row-parallel linear        |
| all-gather along a dim                  | reduce-scatter along that dim    | sequence shards into a column linear  |
| reduce-scatter along a dim              | all-gather along that dim        | row linear output into sequence shards |
| keep this rank's slice along a dim      | all-gather along that dim        | splitting a replicated activation     |
| all-to-all (scatter one dim, gather one)| the reverse all-to-all           | Ulysses attention                      |
| all-to-all of rows, counts per rank     | the reverse all-to-all (counts swapped) | expert-parallel token dispatch |

A group of one makes every function the identity, so single-rank runs take the same code path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_colossal.distributed import collectives


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return collectives.sum_within_group(gradient.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        return collectives.sum_within_group(tensor.contiguous().clone(), group)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:
        return gradient, None


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return collectives.gather_along(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.reduce_scatter_along(gradient, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        output = collectives.reduce_scatter_along(tensor, dim, group)
        # A view of the exchange's buffer: autograd forbids modifying a custom Function's view output in place
        # (Falcon's ``mlp_output += attention_output`` on a row-parallel layer's output), so hand out a tensor.
        return output.clone() if output._base is not None else output

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.gather_along(gradient, ctx.dim, ctx.group), None, None


class _SplitAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        size = collectives.world_size(group)
        if tensor.shape[dim] % size != 0:
            raise ValueError(f"dimension {dim} of size {tensor.shape[dim]} does not split into {size} equal slices.")
        return tensor.chunk(size, dim=dim)[collectives.rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return collectives.gather_along(gradient.contiguous(), ctx.dim, ctx.group), None, None


class _GatherForReplicated(torch.autograd.Function):
    """All-gather forward for a consumer every rank runs identically (a replicated head): each rank's gradient is
    already the whole one, so backward keeps this rank's slice instead of summing."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return collectives.gather_along(tensor.contiguous(), dim, group)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        size = collectives.world_size(ctx.group)
        return gradient.chunk(size, dim=ctx.dim)[collectives.rank(ctx.group)].contiguous(), None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.scatter_dim, ctx.gather_dim, ctx.group = scatter_dim, gather_dim, group
        return collectives.all_to_all_along(tensor, scatter_dim, gather_dim, group)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return collectives.all_to_all_along(gradient, ctx.gather_dim, ctx.scatter_dim, ctx.group), None, None, None


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, output_rows: list[int], input_rows: list[int], group: ProcessGroup
    ) -> torch.Tensor:
        ctx.output_rows, ctx.input_rows, ctx.group = output_rows, input_rows, group
        return collectives.all_to_all_rows(tensor, output_rows, input_rows, group)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        # The rows each rank received go back to where they came from.
        return collectives.all_to_all_rows(gradient, ctx.input_rows, ctx.output_rows, ctx.group), None, None, None


def _alone(group: ProcessGroup | None) -> bool:
    return group is None or collectives.world_size(group) == 1


def copy_to_group(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward."""
    return tensor if _alone(group) else _CopyToGroup.apply(tensor, group)


def reduce_from_group(tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward."""
    return tensor if _alone(group) else _ReduceFromGroup.apply(tensor, group)


def gather_along(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` forward, reduce-scatter (sum) backward."""
    return tensor if _alone(group) else _GatherAlong.apply(tensor, dim, group)


def reduce_scatter_along(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Reduce-scatter (sum) along ``dim`` forward, all-gather backward."""
    return tensor if _alone(group) else _ReduceScatterAlong.apply(tensor, dim, group)


def split_along(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """This rank's equal slice along ``dim`` forward, all-gather backward."""
    return tensor if _alone(group) else _SplitAlong.apply(tensor, dim, group)


def gather_for_replicated(tensor: torch.Tensor, dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """All-gather along ``dim`` forward, this rank's slice of the gradient backward (identical consumers)."""
    return tensor if _alone(group) else _GatherForReplicated.apply(tensor, dim, group)


def all_to_all(tensor: torch.Tensor, scatter_dim: int, gather_dim: int, group: ProcessGroup | None) -> torch.Tensor:
    """Scatter ``scatter_dim`` and gather ``gather_dim`` over the group; backward does the reverse."""
    return tensor if _alone(group) else _AllToAll.apply(tensor, scatter_dim, gather_dim, group)


def all_to_all_rows(
    tensor: torch.Tensor, output_rows: list[int], input_rows: list[int], group: ProcessGroup | None
) -> torch.Tensor:
    """Send ``input_rows[r]`` rows to rank r and receive ``output_rows[r]`` from it forward; backward sends each
    received row's gradient back to its sender. Every rank must call it, also with no rows."""
    return tensor if _alone(group) else _AllToAllRows.apply(tensor, output_rows, input_rows, group)
