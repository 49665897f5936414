"""Ring attention: exact attention over a sequence sharded across a process group, key/value blocks passed around.

[Note: ring attention]
Each rank of the ring holds its queries, keys and values for its own tokens (any layout: the caller passes every
token's global position; the zigzag layout of ``parallel/sequence_layout.py`` balances causal work). In ``size``
steps every rank meets every rank's key/value block: at step ``s`` rank ``r`` computes its queries against the block
of rank ``r - s`` while that block's successor is already on its way (the send to ``r + 1`` and the receive from
``r - 1`` are posted before the block is computed, so communication overlaps computation). Blocks are merged with
the online softmax: each block returns its output and log-sum-exp per query row, and two partial results combine
exactly as ``(o1 * e^(l1 - l) + o2 * e^(l2 - l), l = log(e^l1 + e^l2))``, accumulated in fp32 whatever the inputs'
dtype.

Which keys a query sees is computed per block from positions, never from the block's index: ``key <= query`` when
causal, ``query - key < sliding_window`` when set, and the key's padding flag. Only the rows and columns of a block
that something sees are computed; a block nobody sees is skipped. Under the zigzag layout that halves every
off-diagonal block (either half the queries or half the keys), which is why it gives each rank the same work.

The backward pass is the same ring run again (FlashAttention's recomputation: the block probabilities come back from
the saved log-sum-exp). Each rank adds its part of the key/value gradients of the block it holds to a fp32
accumulator that travels with the block, one hop behind it; after ``size`` hops the accumulator is back at the
block's owner, complete. The query gradient never moves.

The positions and padding flags of every rank are all-gathered once per call (a few bytes per token) instead of
travelling with each block: the same information, without a third message per step.

``block_attention`` and ``block_attention_backward`` are the only compute: matmuls on the host. A fused kernel that
returns the log-sum-exp (FlashAttention's) can replace them without touching the ring.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_colossal.distributed import collectives, direct_exchange
from lightning_colossal.distributed.in_flight import Collective, RecordedWork

# Point-to-point tags of the two streams a backward pass runs on the same pair of ranks: key/value blocks and the
# gradient accumulators. gloo matches messages by (peer, tag) in order, so separate tags keep the streams apart.
_BLOCK_TAG = 7301
_GRADIENT_TAG = 7302


class _Ring:
    """This rank's place in the ring and the exchange of one tensor with its neighbours."""

    def __init__(self, group: ProcessGroup | None) -> None:
        self.group = group
        self.size = 1 if group is None else collectives.world_size(group)
        self.rank = 0 if group is None else collectives.rank(group)

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def pass_on(self, tensor: Tensor, tag: int) -> _Passing:
        """Start sending ``tensor`` to the next rank and receiving the previous rank's into a new buffer."""
        if self.size == 1:
            return _Passing(None, tensor)
        collectives.require_group_device(tensor, self.group, "ring attention's block exchange")
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        following, preceding = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        with Collective("ring_exchange", self.group, tensor, peer=following):
            works: list[Any] = [  # handles (torch types them Optional: None only for ranks outside the group)
                dist.isend(tensor, group_dst=following, group=self.group, tag=tag),
                dist.irecv(received, group_src=preceding, group=self.group, tag=tag),
            ]
        exchange = direct_exchange.DirectExchange(works, direct_exchange.group_timeout(self.group))
        return _Passing(RecordedWork(exchange, "ring_exchange", self.group, tensor), received)  # type: ignore[arg-type]


class _Passing:
    """A block on its way: ``wait()`` returns the block received from the previous rank."""

    __slots__ = ("_work", "_received")

    def __init__(self, work: RecordedWork | None, received: Tensor) -> None:
        self._work, self._received = work, received

    def wait(self) -> Tensor:
        if self._work is not None:
            self._work.wait()
        return self._received


def _visible(
    query_positions: Tensor,
    key_positions: Tensor,
    key_padding: Tensor | None,
    causal: bool,
    sliding_window: int | None,
) -> Tensor:
    """Which query sees which key: bool ``[batch or 1, 1, 1, queries, keys]`` (the grouped-head layout)."""
    queries, keys = query_positions[:, None], key_positions[None, :]
    visible = torch.ones(queries.shape[0], keys.shape[1], dtype=torch.bool, device=query_positions.device)
    if causal:
        visible &= keys <= queries
    if sliding_window is not None:
        visible &= (queries - keys) < sliding_window
    visible = visible[None, None, None]
    if key_padding is not None:
        visible = visible & key_padding[:, None, None, None, :]
    return visible


def _seen_part(visible: Tensor) -> tuple[Tensor | None, Tensor | None] | None:
    """The query rows and key columns of a block that anything sees (``None`` for all of them); ``None`` when the
    block is fully masked."""
    pairs = visible.flatten(0, 2)  # [batch or 1, queries, keys]
    rows, columns = pairs.any(0).any(1), pairs.any(0).any(0)
    if not bool(rows.any()):
        return None
    row_index = None if bool(rows.all()) else rows.nonzero().squeeze(1)
    column_index = None if bool(columns.all()) else columns.nonzero().squeeze(1)
    return row_index, column_index


def _seen_block(block: Tensor, visible: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor, Tensor] | None:
    """The part of a key/value ``block`` anything sees: (query rows, key columns, its fp32 keys and values, the
    visibility of those rows and columns); ``None`` when the block is fully masked."""
    part = _seen_part(visible)
    if part is None:
        return None
    rows, columns = part
    seen = _take(_take(visible, rows, 3), columns, 4)
    return rows, columns, _take(block[0], columns, 2).float(), _take(block[1], columns, 2).float(), seen


def _take(tensor: Tensor, index: Tensor | None, dim: int) -> Tensor:
    return tensor if index is None else tensor.index_select(dim, index)


def _group_rows(tensor: Tensor) -> Tensor:
    """``[b, kv_heads, group, rows, ...]`` as ``[b, kv_heads, group * rows, ...]``: the query heads of a group become
    rows of one matmul against their shared key/value head, which is never repeated in memory."""
    return tensor.flatten(2, 3)


def block_attention(query: Tensor, key: Tensor, value: Tensor, visible: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Attention of one block in fp32: ``query`` ``[b, kv_heads, group, q, d]``, ``key``/``value`` ``[b, kv_heads, k,
    d]``, ``visible`` broadcastable to the scores ``[b, kv_heads, group, q, k]``. Returns the output ``[b, kv_heads,
    group, q, d]`` and the log-sum-exp ``[b, kv_heads, group, q]``; a row that sees nothing gets output 0 and
    log-sum-exp -inf."""
    scores = (_group_rows(query) @ key.transpose(-1, -2)).view(*query.shape[:-1], key.shape[-2]) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    peak = scores.amax(-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
    weights = torch.exp(scores - peak)
    total = weights.sum(-1, keepdim=True)
    output = (_group_rows(weights) @ value).view(query.shape) / total.clamp_min(torch.finfo(total.dtype).tiny)
    return output, (total.log() + peak).squeeze(-1)


def block_attention_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    visible: Tensor,
    scale: float,
    output_gradient: Tensor,
    log_sum_exp: Tensor,
    delta: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block (fp32, shapes as ``block_attention``), given the whole row's log-sum-exp and ``delta``
    (the row sums of output gradient times output). Key/value gradients are summed over the query heads of a group
    (the matmuls over ``group * q`` rows sum them)."""
    scores = (_group_rows(query) @ key.transpose(-1, -2)).view(*query.shape[:-1], key.shape[-2]) * scale
    scores = scores.masked_fill(~visible, -math.inf)
    # A row that sees no key anywhere has log-sum-exp -inf and only -inf scores: its probabilities are exp(-inf) = 0.
    finite = torch.where(torch.isfinite(log_sum_exp), log_sum_exp, torch.zeros_like(log_sum_exp))
    probabilities = _group_rows(torch.exp(scores - finite.unsqueeze(-1)))
    gradient_rows = _group_rows(output_gradient)
    value_gradient = probabilities.transpose(-1, -2) @ gradient_rows
    probability_gradient = gradient_rows @ value.transpose(-1, -2)
    score_gradient = probabilities * (probability_gradient - _group_rows(delta.unsqueeze(-1))) * scale
    query_gradient = (score_gradient @ key).view(query.shape)
    key_gradient = score_gradient.transpose(-1, -2) @ _group_rows(query)
    return query_gradient, key_gradient, value_gradient


class _Layout:
    """What both passes need besides the tensors: the ring, every rank's positions and padding, the mask rule."""

    def __init__(
        self,
        ring: _Ring,
        query_positions: Tensor,
        key_positions: Tensor,
        key_padding: Tensor | None,
        causal: bool,
        sliding_window: int | None,
    ) -> None:
        self.ring, self.causal, self.sliding_window = ring, causal, sliding_window
        self.query_positions = query_positions
        group = ring.group if ring.size > 1 else None
        self.key_positions = collectives.gather_along(key_positions.contiguous(), 0, group).chunk(ring.size)
        self.key_padding: tuple[Tensor, ...] | None = None
        if key_padding is not None:
            flags = collectives.gather_along(key_padding.to(torch.uint8).contiguous(), 1, group)
            self.key_padding = tuple(part.bool() for part in flags.chunk(ring.size, dim=1))

    def visible(self, source: int) -> Tensor:
        padding = None if self.key_padding is None else self.key_padding[source]
        return _visible(self.query_positions, self.key_positions[source], padding, self.causal, self.sliding_window)


def _grouped_query(query: Tensor, kv_heads: int) -> Tensor:
    batch, heads, length, head_dim = query.shape
    return query.reshape(batch, kv_heads, heads // kv_heads, length, head_dim)


def _ring_forward(query: Tensor, key: Tensor, value: Tensor, layout: _Layout, scale: float) -> tuple[Tensor, Tensor]:
    """The merged fp32 output and log-sum-exp, grouped layout."""
    grouped = _grouped_query(query, key.shape[1]).float()
    output = torch.zeros_like(grouped)
    log_sum_exp = torch.full(grouped.shape[:-1], -math.inf, dtype=torch.float32, device=query.device)
    block = torch.stack([key, value])
    ring = layout.ring
    for step in range(ring.size):
        incoming = ring.pass_on(block, _BLOCK_TAG) if step < ring.size - 1 else None
        part = _seen_block(block, layout.visible(ring.source(step)))
        if part is not None:
            rows, columns, block_key, block_value, seen = part
            block_output, block_lse = block_attention(_take(grouped, rows, 3), block_key, block_value, seen, scale)
            merged_lse = torch.logaddexp(_take(log_sum_exp, rows, 3), block_lse)
            finite = torch.where(torch.isfinite(merged_lse), merged_lse, torch.zeros_like(merged_lse))
            kept = torch.exp(_take(log_sum_exp, rows, 3) - finite).unsqueeze(-1)
            added = torch.exp(block_lse - finite).unsqueeze(-1)
            merged = _take(output, rows, 3) * kept + block_output * added
            if rows is None:
                output, log_sum_exp = merged, merged_lse
            else:
                output.index_copy_(3, rows, merged)
                log_sum_exp.index_copy_(3, rows, merged_lse)
        if incoming is not None:
            block = incoming.wait()
    return output, log_sum_exp


def _ring_backward(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    output: Tensor,
    log_sum_exp: Tensor,
    output_gradient: Tensor,
    layout: _Layout,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """fp32 gradients of query (grouped layout), key and value (``[b, kv_heads, len, d]``)."""
    grouped = _grouped_query(query, key.shape[1]).float()
    gradient = _grouped_query(output_gradient, key.shape[1]).float()
    delta = (gradient * output).sum(-1)
    query_gradient = torch.zeros_like(grouped)
    block = torch.stack([key, value])
    ring = layout.ring
    travelling = None  # the previous step's gradient accumulator on its way to this rank's successor
    for step in range(ring.size):
        incoming = ring.pass_on(block, _BLOCK_TAG) if step < ring.size - 1 else None
        block_gradient = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
        part = _seen_block(block, layout.visible(ring.source(step)))
        if part is not None:
            rows, columns, block_key, block_value, seen = part
            part_query, part_key, part_value = block_attention_backward(
                _take(grouped, rows, 3),
                block_key,
                block_value,
                seen,
                scale,
                _take(gradient, rows, 3),
                _take(log_sum_exp, rows, 3),
                _take(delta, rows, 3),
            )
            if rows is None:
                query_gradient += part_query
            else:
                query_gradient.index_add_(3, rows, part_query)
            pair = torch.stack([part_key, part_value])
            if columns is None:
                block_gradient += pair
            else:
                block_gradient.index_add_(3, columns, pair)
        if travelling is not None:
            block_gradient += travelling.wait()  # what the ranks before this one added to the same block
        travelling = ring.pass_on(block_gradient, _GRADIENT_TAG)
        if incoming is not None:
            block = incoming.wait()
    assert travelling is not None
    own = travelling.wait()  # this rank's block, back from the whole ring
    return query_gradient, own[0], own[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: Tensor, key: Tensor, value: Tensor, layout: _Layout, scale: float
    ) -> Tensor:
        # Autocast would run the blocks' matmuls in 16 bits: the fp32 accumulation is the point, so it is off here.
        with torch.autocast(query.device.type, enabled=False):
            output, log_sum_exp = _ring_forward(query, key, value, layout, scale)
        ctx.save_for_backward(query, key, value, output, log_sum_exp)
        ctx.layout, ctx.scale = layout, scale
        return output.flatten(1, 2).to(query.dtype)

    @staticmethod
    def backward(ctx: Any, output_gradient: Tensor) -> tuple[Tensor | None, ...]:
        query, key, value, output, log_sum_exp = ctx.saved_tensors
        with torch.autocast(query.device.type, enabled=False):
            query_gradient, key_gradient, value_gradient = _ring_backward(
                query, key, value, output, log_sum_exp, output_gradient, ctx.layout, ctx.scale
            )
        return (
            query_gradient.flatten(1, 2).to(query.dtype),
            key_gradient.to(key.dtype),
            value_gradient.to(value.dtype),
            None,
            None,
        )


def _check(query: Tensor, key: Tensor, value: Tensor, query_positions: Tensor, key_positions: Tensor) -> None:
    if query.dim() != 4 or key.shape != value.shape or key.dim() != 4:
        raise ValueError(
            "ring_attention takes query [batch, heads, length, head_dim] and key/value [batch, kv_heads, length,"
            f" head_dim] of equal shapes; got query {tuple(query.shape)}, key {tuple(key.shape)}, value"
            f" {tuple(value.shape)}."
        )
    if query.shape[1] % key.shape[1] != 0:
        raise ValueError(
            f"ring_attention: {query.shape[1]} query heads do not split into groups over {key.shape[1]} key/value"
            " heads; the query head count must be a multiple of the key/value head count."
        )
    if query_positions.shape != (query.shape[2],) or key_positions.shape != (key.shape[2],):
        raise ValueError(
            "ring_attention needs one global position per local token: query_positions of shape"
            f" ({query.shape[2]},) and key_positions of shape ({key.shape[2]},), got"
            f" {tuple(query_positions.shape)} and {tuple(key_positions.shape)}."
        )


def ring_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    group: ProcessGroup | None,
    *,
    query_positions: Tensor,
    key_positions: Tensor,
    causal: bool = True,
    sliding_window: int | None = None,
    key_padding: Tensor | None = None,
    scale: float | None = None,
) -> Tensor:
    """Attention of this rank's queries over the keys and values of every rank of ``group`` ([Note: ring attention]).

    Args:
        query: ``[batch, heads, local_length, head_dim]``.
        key, value: ``[batch, kv_heads, local_length, head_dim]``; ``heads`` a multiple of ``kv_heads`` (grouped
            query attention, query head ``h`` reading key/value head ``h // (heads // kv_heads)``, never repeated in
            memory).
        group: the ring's process group; ``None`` or a group of one is plain local attention.
        query_positions, key_positions: int64 ``[local_length]``, the global positions of this rank's tokens.
        causal: a query sees keys at positions up to its own.
        sliding_window: a query sees keys fewer than this many positions before it.
        key_padding: bool ``[batch, local_length]``, True for a real token; a query row that sees no key gets zeros.
        scale: the score scale, ``1 / sqrt(head_dim)`` when ``None``.

    Returns ``[batch, heads, local_length, head_dim]`` in ``query``'s dtype, differentiable in query, key and value
    (computed and accumulated in fp32).
    """
    _check(query, key, value, query_positions, key_positions)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window}: use a positive window, or None for no window.")
    ring = _Ring(group)
    if key_padding is not None and key_padding.shape != (key.shape[0], key.shape[2]):
        raise ValueError(
            f"key_padding must be bool [batch, local_length] = {(key.shape[0], key.shape[2])}, got"
            f" {tuple(key_padding.shape)}."
        )
    layout = _Layout(
        ring,
        query_positions.to(device=query.device, dtype=torch.int64),
        key_positions.to(device=query.device, dtype=torch.int64),
        None if key_padding is None else key_padding.to(device=query.device, dtype=torch.bool),
        causal,
        sliding_window,
    )
    used_scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    return _RingAttention.apply(query, key, value, layout, used_scale)


__all__ = ["block_attention", "block_attention_backward", "ring_attention"]
