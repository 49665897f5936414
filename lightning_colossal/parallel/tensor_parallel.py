"""Tensor-parallel layers on plain local tensors, and the side table that says how each parameter is split.

[Note: plain local shards instead of DTensor parameters]
The built-in policies do not use torch's DTensor parallel styles. Parameters here are plain tensors holding this
rank's shard, and the layers call the differentiable collectives of ``distributed.differentiable`` themselves
(Megatron's layout). Three reasons: the ZeRO engine, the data-parallel reducer and ``torch.distributed.pipelining``
all work on plain tensors, so ZeRO-1/2 and pipelines compose with tensor parallelism without a DTensor path in each;
DTensor dispatch costs per-op time on CPU, which the tp2 step-time target against Lightning's DTensor-based
``ModelParallelStrategy`` cannot afford; and sequence parallelism needs collectives between ops that a parallel
style cannot express. DTensor is still used where it pays: the LM head returns its vocabulary-sharded logits as a
``DTensor`` so that torch's ``loss_parallel`` computes the cross-entropy without gathering them, and checkpoints
describe every shard as a ``DTensor`` so DCP reshards between layouts. A model whose ``configure_model`` applied
DTensor styles itself keeps them (``policies.UserTensorParallelPolicy``; ``local_view``/``piece_like`` below serve
its pieces).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_colossal.config import AllToAll, Ring, SequenceParallelism, SplitGather
from lightning_colossal.distributed import collectives, differentiable
from lightning_colossal.engine_parts.sharded_state import piece_of_whole


@dataclass(frozen=True)
class TensorParallelPlacement:
    """How one parameter is split over the tensor-parallel ranks.

    Args:
        dim: the parameter dimension that is split.
        fused_parts: the dimension holds this many equal blocks (e.g. GPT-2's q, k and v), each split on its own;
            the shard is then not one contiguous piece of the whole tensor.
        fused_blocks: the dimension holds blocks of these relative sizes, each split on its own (Phi-3's fused
            ``[q][k][v]`` under grouped-query attention: blocks ``(heads, kv_heads, kv_heads)``); overrides
            ``fused_parts``.
    """

    dim: int
    fused_parts: int = 1
    fused_blocks: tuple[int, ...] = ()

    @property
    def is_fused(self) -> bool:
        """Whether the shard is several pieces of the whole tensor (not one contiguous slice)."""
        return len(self.relative_blocks) > 1

    @property
    def relative_blocks(self) -> tuple[int, ...]:
        return self.fused_blocks or (1,) * self.fused_parts

    def block_lengths(self, length: int) -> list[int]:
        """The lengths, along ``dim``, of the blocks of a tensor that is ``length`` long there."""
        blocks = self.relative_blocks
        unit, remainder = divmod(length, sum(blocks))
        if remainder:
            raise ValueError(f"dimension {self.dim} of size {length} does not hold fused blocks of sizes {blocks}.")
        return [block * unit for block in blocks]


@dataclass(frozen=True, init=False)
class ParallelContext:
    """The groups a parallelised model talks to, and which sequence parallelism it runs.

    Args:
        tp_group: tensor-parallel group (``None`` when tp_size is 1).
        tp_mesh: 1-D mesh of the tensor-parallel ranks (for DTensor logits and checkpoint descriptions).
        sp_group: sequence-parallel group, Ulysses' or the ring's (``None`` when sp_size is 1).
        sequence: the sequence-parallel mode, the config's own object (``SplitGather()``, ``AllToAll(...)``,
            ``Ring(...)``), or ``None``. Policies dispatch on its type and read its ``layout``; nothing re-infers it.
        split_gather: for contexts built by hand (tests, benchmarks): ``True`` means ``sequence=SplitGather()``.
        sequence_layout: for contexts built by hand: the layout of the mode over ``sp_group``, ``"contiguous"``
            (``AllToAll``, also what an ``sp_group`` alone means) or ``"zigzag"`` (``Ring``).
    """

    tp_group: ProcessGroup | None
    tp_mesh: DeviceMesh | None
    sp_group: ProcessGroup | None
    sequence: SequenceParallelism | None

    def __init__(
        self,
        tp_group: ProcessGroup | None,
        tp_mesh: DeviceMesh | None,
        sp_group: ProcessGroup | None,
        sequence: SequenceParallelism | None = None,
        *,
        split_gather: bool = False,
        sequence_layout: str | None = None,
    ) -> None:
        if sequence is None:
            sequence = _mode_built_by_hand(sp_group, split_gather, sequence_layout)
        object.__setattr__(self, "tp_group", tp_group)
        object.__setattr__(self, "tp_mesh", tp_mesh)
        object.__setattr__(self, "sp_group", sp_group)
        object.__setattr__(self, "sequence", sequence)

    @property
    def tp_size(self) -> int:
        return collectives.world_size(self.tp_group) if self.tp_group is not None else 1

    @property
    def tp_rank(self) -> int:
        return collectives.rank(self.tp_group) if self.tp_group is not None else 0

    @property
    def sp_size(self) -> int:
        return collectives.world_size(self.sp_group) if self.sp_group is not None else 1

    @property
    def sp_rank(self) -> int:
        return collectives.rank(self.sp_group) if self.sp_group is not None else 0

    @property
    def split_gather(self) -> bool:
        """Whether activations between layers are sequence shards over the tensor-parallel ranks (``SplitGather``)."""
        return isinstance(self.sequence, SplitGather)

    @property
    def sequence_layout(self) -> str:
        """Which tokens each ``sp_group`` rank holds: the mode's own ``layout`` ([Note: sequence layouts] in
        ``sequence_layout.py``)."""
        return "contiguous" if self.sequence is None else self.sequence.layout

    @property
    def ring(self) -> bool:
        """Whether attention runs as ring attention over ``sp_group`` (``Ring``)."""
        return isinstance(self.sequence, Ring) and self.sp_size > 1

    def tensor_parallel_only(self) -> ParallelContext:
        """This context without sequence parallelism: what the tensor-parallel split runs under, before the mode's
        own step attaches it."""
        return ParallelContext(self.tp_group, self.tp_mesh, None)


def _mode_built_by_hand(
    sp_group: ProcessGroup | None, split_gather: bool, sequence_layout: str | None
) -> SequenceParallelism | None:
    """The mode a context built by hand describes with the older keywords (the engine passes ``sequence``)."""
    if split_gather:
        return SplitGather()
    size = collectives.world_size(sp_group) if sp_group is not None else 1
    if size == 1:
        return None
    modes = [mode for mode in (AllToAll, Ring) if mode.layout == (sequence_layout or "contiguous")]
    if not modes:
        raise ValueError(f"sequence_layout={sequence_layout!r}: pass 'contiguous' (Ulysses) or 'zigzag' (ring).")
    return modes[0](sp_size=size)


def shard_of(full: Tensor, placement: TensorParallelPlacement, rank: int, size: int) -> Tensor:
    """This rank's piece of a whole tensor (a view where the piece is contiguous along ``dim``)."""
    if size == 1:
        return full
    lengths = placement.block_lengths(full.shape[placement.dim])
    if any(length % size for length in lengths):
        fused = f" of fused blocks {lengths}" if placement.is_fused else ""
        raise ValueError(
            f"dimension {placement.dim} of size {full.shape[placement.dim]}{fused} does not split into {size}"
            " tensor-parallel shards."
        )
    blocks = full.split(lengths, dim=placement.dim)
    pieces = [block.chunk(size, dim=placement.dim)[rank] for block in blocks]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=placement.dim)


def full_from_shards(local: Tensor, placement: TensorParallelPlacement, group: ProcessGroup | None) -> Tensor:
    """The whole tensor, gathered from every tensor-parallel rank's piece (a collective over ``group``)."""
    size = collectives.world_size(group) if group is not None else 1
    if size == 1:
        return local
    gathered = collectives.gather_along(local.detach().contiguous(), placement.dim, group)
    if not placement.is_fused:
        return gathered
    # Rank-major [rank][block] back to block-major [block][rank].
    per_rank = gathered.chunk(size, dim=placement.dim)
    local_lengths = placement.block_lengths(local.shape[placement.dim])
    blocks = [piece.split(local_lengths, dim=placement.dim) for piece in per_rank]
    parts = range(len(local_lengths))
    return torch.cat([blocks[rank][part] for part in parts for rank in range(size)], placement.dim)


def describe_shard(
    local: Tensor, placement: TensorParallelPlacement, mesh: DeviceMesh, full_shape: torch.Size
) -> Tensor:
    """This rank's contiguous piece as a ``DTensor`` of the whole tensor (what DCP saves and reshards)."""
    assert not placement.is_fused, (
        "fused parameters are saved whole (checkpoint_view.py [Note: fused shards are saved whole])"
    )
    return piece_of_whole(local, mesh, [Shard(placement.dim)], full_shape)


class ColumnParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s output features split over the tensor-parallel ranks.

    The input is replicated (or, under split-gather sequence parallelism, a sequence shard gathered here); the
    output holds this rank's features. ``transposed`` weights are stored ``[in, out]`` (GPT-2's ``Conv1D``).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, context: ParallelContext, transposed: bool = False) -> None:
        super().__init__()
        self.weight = _as_parameter(weight)
        self.bias = None if bias is None else _as_parameter(bias)
        self.context = context
        self.transposed = transposed
        #: The input is already the whole sequence, gathered once for several layers by a caller whose backward
        #: reduces the input gradient (split-gather on models whose attention needs the whole sequence).
        self.input_gathered = False

    def forward(self, hidden: Tensor) -> Tensor:
        if self.input_gathered:
            output = hidden @ self.weight if self.transposed else F.linear(hidden, self.weight)
            return output if self.bias is None else output + self.bias
        if self.context.split_gather and self.context.tp_size > 1:
            return _sequence_gathered_linear(hidden, self.weight, self.bias, self.context.tp_group, self.transposed)
        hidden = differentiable.copy_to_group(hidden, self.context.tp_group)
        if self.transposed:
            output = hidden @ self.weight
            return output if self.bias is None else output + self.bias
        return F.linear(hidden, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x A^T + b`` with ``A``'s input features split; partial products are summed over the ranks.

    Under split-gather sequence parallelism the sum is a reduce-scatter that leaves each rank a sequence shard.
    The bias is whole on every rank and added once, after the sum.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, context: ParallelContext, transposed: bool = False) -> None:
        super().__init__()
        self.weight = _as_parameter(weight)
        self.bias = None if bias is None else _as_parameter(bias)
        self.context = context
        self.transposed = transposed

    def forward(self, hidden: Tensor) -> Tensor:
        partial = hidden @ self.weight if self.transposed else F.linear(hidden, self.weight)
        if self.context.split_gather:
            # The sequence is the dimension before the features: dim 1 of [batch, sequence, features], dim 0 of tokens
            # flattened by the model (OPT's MLP), which the column-parallel layer before gathered along the same dim.
            output = differentiable.reduce_scatter_along(partial, partial.dim() - 2, self.context.tp_group)
        else:
            output = differentiable.reduce_from_group(partial, self.context.tp_group)
        return output if self.bias is None else output + self.bias


class LocalColumnsLinear(nn.Module):
    """A whole ``y = x A^T + b`` on every rank that computes only the output features this rank uses (``columns``).

    For a fused projection some of whose blocks every rank needs whole: Falcon's multi-query ``[q heads][k][v]``,
    where each rank runs its share of the query heads against the one shared key/value head. The weight is not
    split; each rank's gradient holds its own query rows and its heads' part of the key/value rows, so the policy
    declares it partial (summed over the tensor-parallel ranks), and the input gradient is summed here in backward,
    as a column-parallel layer's is.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, columns: Tensor, context: ParallelContext) -> None:
        super().__init__()
        self.weight = _as_parameter(weight)
        self.bias = None if bias is None else _as_parameter(bias)
        self.context = context
        # Not persistent: the checkpoint holds the whole weight under its own name, nothing of this layer's own.
        self.register_buffer("columns", columns.to(self.weight.device), persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        hidden = differentiable.copy_to_group(hidden, self.context.tp_group)
        bias = None if self.bias is None else self.bias.index_select(0, self.columns)
        return F.linear(hidden, self.weight.index_select(0, self.columns), bias)


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (token ids) are split over the tensor-parallel ranks.

    Each rank looks up the ids it holds, writes zeros for the others, and the ranks sum their results (a
    reduce-scatter into sequence shards under split-gather sequence parallelism).
    """

    def __init__(self, weight: Tensor, context: ParallelContext, padding_idx: int | None = None) -> None:
        super().__init__()
        self.weight = _as_parameter(weight)
        self.context = context
        self.vocab_start = context.tp_rank * weight.shape[0]
        self.padding_idx = padding_idx

    def forward(self, input_ids: Tensor) -> Tensor:
        if self.context.tp_size == 1:
            return F.embedding(input_ids, self.weight, self.padding_idx)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        embedded = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        embedded = embedded.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.context.split_gather:
            return differentiable.reduce_scatter_along(embedded, 1, self.context.tp_group)
        return differentiable.reduce_from_group(embedded, self.context.tp_group)


class VocabParallelHead(nn.Module):
    """The LM head with its vocabulary split over the tensor-parallel ranks.

    The logits never exist whole: the output is a ``DTensor`` sharded on its last dimension, and a cross-entropy
    taken inside ``torch.distributed.tensor.parallel.loss_parallel()`` (the strategy enters it around every step)
    reduces over the vocabulary with two scalar-per-token all-reduces. ``local_output`` returns the plain local
    logits instead (pipeline stages, which hand tensors to the loss themselves). ``whole_output`` gathers them into
    plain whole logits (evaluation and prediction, where user code and Hugging Face's ``generate()`` take the
    argmax or sample over the vocabulary and mix the result with plain tensors).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, context: ParallelContext) -> None:
        super().__init__()
        self.weight = _as_parameter(weight)
        self.bias = None if bias is None else _as_parameter(bias)
        self.context = context
        self.local_output = False
        self.whole_output = False

    def forward(self, hidden: Tensor) -> Tensor:
        if self.context.split_gather and self.context.tp_size > 1:
            logits = _sequence_gathered_linear(hidden, self.weight, self.bias, self.context.tp_group, False)
        else:
            logits = F.linear(differentiable.copy_to_group(hidden, self.context.tp_group), self.weight, self.bias)
        if self.local_output or self.context.tp_size == 1:
            return logits
        sharded = vocab_sharded(logits, self.context)
        return sharded.full_tensor() if self.whole_output else sharded


def local_view(tensor: Tensor) -> Tensor:
    """This rank's tensor: the local piece of a ``DTensor`` (the user's own tensor parallelism), else ``tensor``."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def piece_like(whole: Tensor, like: DTensor) -> DTensor:
    """This rank's piece of a whole tensor, laid out as ``like`` (a ``DTensor`` parameter or state); no communication."""
    local = whole
    coordinate = like.device_mesh.get_coordinate()
    assert coordinate is not None, "every rank of the run is in the mesh"
    for mesh_dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            local = local.chunk(like.device_mesh.size(mesh_dim), dim=placement.dim)[coordinate[mesh_dim]]
        elif not isinstance(placement, Replicate):
            raise ValueError(f"Cannot load a whole tensor into a {placement} placement; save it with Shard/Replicate.")
    local = local.to(device=like.device, dtype=like.dtype).contiguous()
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=whole.shape, stride=whole.stride()
    )


def _sequence_gathered_linear(
    shard: Tensor, weight: Tensor, bias: Tensor | None, group: ProcessGroup | None, transposed: bool
) -> Tensor:
    """``gather(shard) @ weight + bias`` (see ``_SequenceGatheredProduct``), with autocast applied as ``F.linear``
    would: ops inside an autograd Function are not autocast, so the casts happen here, where autograd sees them
    (their backward returns the gradients in the parameters' own dtype)."""
    device_type = shard.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        shard, weight = shard.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type, enabled=False):
        output = _SequenceGatheredProduct.apply(shard, weight, group, transposed)
        return output if bias is None else output + bias


class _SequenceGatheredProduct(torch.autograd.Function):
    """``gather(shard) @ weight`` for split-gather sequence parallelism, keeping only the shard for backward.

    Autograd would keep the gathered (whole-sequence) input of every column-parallel layer until backward, which
    undoes sequence parallelism's saving exactly where activations are largest. Like Megatron, this keeps this rank's
    sequence shard and gathers it again in backward for the weight gradient: one more all-gather per layer, 1/tp of
    the saved input. The input gradient is reduce-scattered back to sequence shards (the gather's transpose).
    Weights are ``[out, in]`` (``F.linear``) or ``[in, out]`` when ``transposed`` (GPT-2's ``Conv1D``).
    """

    @staticmethod
    def forward(ctx: Any, shard: Tensor, weight: Tensor, group: ProcessGroup, transposed: bool) -> Tensor:
        whole = collectives.gather_along(shard.contiguous(), shard.dim() - 2, group)  # the sequence (RowParallelLinear)
        ctx.save_for_backward(shard, weight)
        ctx.group, ctx.transposed = group, transposed
        return whole @ weight if transposed else F.linear(whole, weight)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        shard, weight = ctx.saved_tensors  # one dtype: _sequence_gathered_linear casts both under autocast
        shard_gradient = weight_gradient = None
        if ctx.needs_input_grad[0]:
            whole_gradient = gradient @ weight.t() if ctx.transposed else gradient @ weight
            shard_gradient = collectives.reduce_scatter_along(
                whole_gradient.contiguous(), whole_gradient.dim() - 2, ctx.group
            )
        if ctx.needs_input_grad[1]:
            whole = collectives.gather_along(shard.contiguous(), shard.dim() - 2, ctx.group)
            inputs = whole.reshape(-1, whole.shape[-1])
            outputs = gradient.reshape(-1, gradient.shape[-1])
            weight_gradient = inputs.t() @ outputs if ctx.transposed else outputs.t() @ inputs
        return shard_gradient, weight_gradient, None, None


def _as_parameter(tensor: Tensor) -> nn.Parameter:
    """Keep a given Parameter (tied weights stay one object); wrap a fresh shard as a trainable one."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor.detach())


def vocab_sharded(local_logits: Tensor, context: ParallelContext) -> Tensor:
    """Wrap this rank's vocabulary slice of the logits as a ``DTensor`` of the whole logits (differentiably)."""
    assert context.tp_mesh is not None
    shape = (*local_logits.shape[:-1], local_logits.shape[-1] * context.tp_size)
    return piece_of_whole(local_logits, context.tp_mesh, [Shard(local_logits.dim() - 1)], shape)


def loss_context(context: ParallelContext) -> AbstractContextManager[Any]:
    """``loss_parallel`` under tensor parallelism (vocabulary-sharded logits), for forward and backward alike."""
    if context.tp_size == 1:
        return nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()
