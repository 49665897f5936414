"""The hybrid-parallel policy of the demo GPT (``lightning_colossal.demo.model``): tensor, sequence and pipeline
parallelism.

The engine never imports this module: ``GPT.parallel_policy()`` returns the policy, and ``find_policy``
(``lightning_colossal/parallel/policies.py``) asks each module for its declared policy, so ``parallel/`` needs no
import of the demo (docs/architecture.md, section 1).

Tensor parallelism follows Megatron: ``qkv`` and ``mlp.fc`` column-parallel, ``attn.proj`` and ``mlp.proj``
row-parallel (the fused ``qkv`` is head-major, see the model's [Note: head-major fused qkv], so a contiguous column
shard holds whole heads), token embedding and LM head vocabulary-parallel and still tied. Split-gather sequence
parallelism keeps the residual stream as sequence shards over the tensor-parallel ranks; Ulysses exchanges heads
for sequence inside attention; ring attention replaces each attention's core module (``attn.core``) with
``RingAttention``, which passes key/value blocks around the sequence-parallel ranks.

Sequence parallelism is attached as hooks, so the GPT's own forward runs (``lightning_colossal/parallel/attached.py``
[Note: techniques attach as hooks]): the token embedding's pre-hook checks that the sequence splits (split-gather),
the position embedding's pre-hook looks up this rank's positions (both kinds), and in each attention a hook after
``qkv`` exchanges sequence shards for head shards and a pre-hook of ``proj`` exchanges them back (Ulysses). The
attention's forward takes its shapes from ``qkv``'s output and its head count from the features, which is what lets
it run unchanged on the exchanged heads (the model's [Note: head-major fused qkv]).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor, nn

from lightning_colossal.demo.model import GPT
from lightning_colossal.distributed import differentiable
from lightning_colossal.distributed.ring_attention import ring_attention
from lightning_colossal.parallel.policy import (
    ModelPolicy,
    ParallelPlan,
    check_divisible,
    column_parallel,
    norm_parameters,
    positions_for,
    row_parallel,
)
from lightning_colossal.parallel.tensor_parallel import (
    ParallelContext,
    TensorParallelPlacement,
    VocabParallelEmbedding,
    VocabParallelHead,
    shard_of,
)


class GPTPolicy(ModelPolicy):
    """Policy for :class:`lightning_colossal.demo.model.GPT`."""

    name = "gpt"

    def accepts(self, module: nn.Module) -> bool:
        return isinstance(module, GPT)

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        assert isinstance(model, GPT)
        config = model.config
        # Ulysses splits heads over the sequence-parallel ranks too; the ring keeps every head on every rank.
        head_splitters = "tp_size" if context.ring else "tp_size * sp_size"
        parallel_heads = context.tp_size * (1 if context.ring else context.sp_size)
        check_divisible(
            "GPTConfig.num_heads",
            config.num_heads,
            parallel_heads,
            f"attention heads are split over {head_splitters} = {parallel_heads} ranks; choose num_heads divisible"
            " by it or smaller tp_size/sp_size.",
        )
        check_divisible(
            "GPTConfig.vocab_size",
            config.vocab_size,
            context.tp_size,
            f"the vocabulary is split over tp_size = {context.tp_size} ranks; pad vocab_size to a multiple of it.",
        )
        if context.ring and config.dropout > 0:
            raise ValueError(
                f"sequence_parallel='ring' computes attention without dropout on its weights, but GPTConfig.dropout="
                f"{config.dropout}: build the GPT with dropout=0.0, or use sequence_parallel='all_to_all' (Ulysses),"
                " which keeps it."
            )
        plan = ParallelPlan()
        if context.tp_size > 1:
            self._split_layers(model, context, plan)
        attached = plan.attached
        if context.split_gather:
            plan.add_partial_gradients([*norm_parameters(model), model.position_embedding.weight])
            check = functools.partial(_check_sequence_splits, context)
            attached.before_forward(model.token_embedding, "split-gather: the sequence splits", check)
        if context.split_gather or context.sp_size > 1:
            positions = functools.partial(_rank_positions, context)
            attached.before_forward(model.position_embedding, "sequence parallelism: this rank's positions", positions)
        if context.ring:
            for block in model.blocks:
                block.attn.core = RingAttention(context)
        elif context.sp_size > 1:
            for block in model.blocks:
                head_dim = block.attn.head_dim
                to_heads = functools.partial(_sequence_shards_to_head_shards, context, head_dim)
                attached.after_forward(block.attn.qkv, "Ulysses: sequence shards to head shards", to_heads)
                to_sequence = functools.partial(_head_shards_to_sequence_shards, context, head_dim)
                attached.before_forward(block.attn.proj, "Ulysses: head shards to sequence shards", to_sequence)
        return plan

    def _split_layers(self, model: GPT, context: ParallelContext, plan: ParallelPlan) -> None:
        for block in model.blocks:
            block.attn.qkv = column_parallel(block.attn.qkv, context, plan)
            block.attn.proj = row_parallel(block.attn.proj, context, plan)
            block.mlp.fc = column_parallel(block.mlp.fc, context, plan)
            block.mlp.proj = row_parallel(block.mlp.proj, context, plan)
        rows = TensorParallelPlacement(0)
        embedding_weight = shard_of(model.token_embedding.weight.detach(), rows, context.tp_rank, context.tp_size)
        tied = model.config.tie_weights
        model.token_embedding = VocabParallelEmbedding(embedding_weight.clone(), context)
        plan.record(model.token_embedding.weight, rows)
        if tied:
            model.lm_head = VocabParallelHead(model.token_embedding.weight, None, context)
        else:
            head_weight = shard_of(model.lm_head.weight.detach(), rows, context.tp_rank, context.tp_size)
            model.lm_head = VocabParallelHead(head_weight.clone(), None, context)
            plan.record(model.lm_head.weight, rows)

    def layers(self, model: nn.Module) -> nn.ModuleList:
        assert isinstance(model, GPT)
        return model.blocks

    def prune(self, model: nn.Module, keep_layers: set[int], first: bool, last: bool) -> None:
        assert isinstance(model, GPT)
        for index in range(len(model.blocks)):
            if index not in keep_layers:
                model.blocks[index] = nn.Identity()
        if not first:
            model.token_embedding = None  # type: ignore[assignment]
            model.position_embedding = None  # type: ignore[assignment]
        if not last:
            model.final_norm = None  # type: ignore[assignment]
            model.lm_head = None  # type: ignore[assignment]

    def stage_module(
        self, model: nn.Module, layer_indices: list[int], first: bool, last: bool, context: ParallelContext
    ) -> nn.Module:
        assert isinstance(model, GPT)
        return GPTStage(model, layer_indices, first, last, context)


class RingAttention(nn.Module):
    """The attention core under ``sequence_parallel="ring"``: causal ring attention over the sequence-parallel group
    (``distributed/ring_attention.py``) of this rank's zigzag share of the sequence; replaces the model's
    ``ScaledDotProductAttention`` (no parameters, so state dicts do not change)."""

    def __init__(self, context: ParallelContext) -> None:
        super().__init__()
        self.context = context

    def forward(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        positions = positions_for(query.shape[2], self.context).to(query.device)
        return ring_attention(
            query, key, value, self.context.sp_group, query_positions=positions, key_positions=positions, causal=True
        )

    def extra_repr(self) -> str:
        return f"sp_size={self.context.sp_size}, layout={self.context.sequence_layout}, causal=True"


class GPTStage(nn.Module):
    """One pipeline stage of a GPT: it references (never copies) the model's modules it runs.

    The first stage takes token ids, the others hidden states; the last returns this rank's vocabulary slice of
    the logits as a plain tensor (the pipeline's loss wrapper turns it into a DTensor for ``loss_parallel``).
    """

    def __init__(self, model: GPT, layer_indices: list[int], first: bool, last: bool, context: ParallelContext) -> None:
        super().__init__()
        self.first, self.last, self.context = first, last, context
        self.embedding_dropout = model.embedding_dropout
        if first:
            self.token_embedding = model.token_embedding
            self.position_embedding = model.position_embedding
        self.layers = nn.ModuleList(model.blocks[index] for index in layer_indices)
        if last:
            self.final_norm = model.final_norm
            self.lm_head = model.lm_head
            if isinstance(self.lm_head, VocabParallelHead):
                self.lm_head.local_output = True
        #: The last stage returns this rank's vocabulary slice of the logits (see ``PipelineStep._stage_loss``).
        self.vocab_parallel_output = last and isinstance(model.lm_head, VocabParallelHead) and context.tp_size > 1

    def forward(self, hidden: Tensor) -> Tensor:
        if self.first:
            hidden = _embed(self, hidden)
        for layer in self.layers:
            hidden = layer(hidden)
        if self.last:
            hidden = self.lm_head(self.final_norm(hidden))
        return hidden


def _embed(stage: GPTStage, input_ids: Tensor) -> Tensor:
    """The first stage's embedding, as ``GPT.forward`` computes it (sequence parallelism's hooks on the embeddings
    apply here too)."""
    if input_ids.dim() != 2:
        raise ValueError(f"GPT expects input_ids of shape [batch, time], got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[1] > stage.position_embedding.num_embeddings:
        raise ValueError(
            f"Sequence length exceeds block_size={stage.position_embedding.num_embeddings}; crop the input or build"
            " the model with a larger block_size."
        )
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return stage.embedding_dropout(stage.token_embedding(input_ids) + stage.position_embedding(positions))


def _check_sequence_splits(
    context: ParallelContext, module: nn.Module, args: tuple[Tensor, ...], kwargs: dict[str, Any]
) -> None:
    """Before the token embedding under split-gather, which reduce-scatters its output into sequence shards."""
    length = args[0].shape[1]
    if length % context.tp_size != 0:
        raise ValueError(
            f"Split-gather sequence parallelism splits the sequence over tp_size={context.tp_size} ranks, but the batch"
            f" has {length} tokens per sequence: use a sequence length divisible by {context.tp_size}."
        )


def _rank_positions(
    context: ParallelContext, module: nn.Module, args: tuple[Tensor, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    """Before the position embedding: the positions of this rank's tokens instead of ``0 .. length - 1`` (the
    token embedding's output is a sequence shard under split-gather; under Ulysses the batch arrives split)."""
    positions = positions_for(args[0].shape[-1], context)  # on the host: the bound check reads no device tensor back
    if int(positions.max()) >= module.num_embeddings:
        raise ValueError(
            f"Sequence length exceeds block_size={module.num_embeddings}; crop the input or build the model with a"
            " larger block_size."
        )
    return (positions.to(args[0].device), *args[1:]), kwargs


def _sequence_shards_to_head_shards(
    context: ParallelContext, head_dim: int, module: nn.Module, args: tuple[Tensor, ...], qkv: Tensor
) -> Tensor:
    """After ``qkv`` under Ulysses: ``[batch, time / sp, heads * 3 * head_dim]`` becomes ``[batch, time, heads / sp
    * 3 * head_dim]``, each rank keeping its block of heads (their q, k and v: the features are head-major) over the
    whole sequence, so that attention sees every token."""
    per_head = qkv.unflatten(-1, (-1, 3 * head_dim))
    return differentiable.all_to_all(per_head, 2, 1, context.sp_group).flatten(2)


def _head_shards_to_sequence_shards(
    context: ParallelContext, head_dim: int, module: nn.Module, args: tuple[Tensor, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Tensor, ...], dict[str, Any]]:
    """Before ``proj`` under Ulysses: the attention output ``[batch, time, heads / sp * head_dim]`` back to
    ``[batch, time / sp, heads * head_dim]``."""
    per_head = args[0].unflatten(-1, (-1, head_dim))
    return (differentiable.all_to_all(per_head, 1, 2, context.sp_group).flatten(2), *args[1:]), kwargs


__all__ = ["GPTPolicy", "GPTStage", "RingAttention"]
