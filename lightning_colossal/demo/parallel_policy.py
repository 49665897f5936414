"""The hybrid-parallel policy of the demo GPT (``lightning_colossal.demo.model``): tensor, sequence and pipeline
parallelism.

The engine never imports this module: ``GPT.parallel_policy()`` returns the policy, and ``find_policy``
(``lightning_colossal/parallel/policies.py``) asks each module for its declared policy, so ``parallel/`` needs no
import of the demo (docs/architecture.md, section 1).

Tensor parallelism follows Megatron: ``qkv`` and ``mlp.fc`` column-parallel, ``attn.proj`` and ``mlp.proj``
row-parallel (the fused ``qkv`` is head-major, see the model's [Note: head-major fused qkv], so a contiguous column
shard holds whole heads), token embedding and LM head vocabulary-parallel and still tied. Split-gather sequence
parallelism keeps the residual stream as sequence shards over the tensor-parallel ranks; Ulysses exchanges heads
for sequence inside attention.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_colossal.demo.model import GPT, CausalSelfAttention
from lightning_colossal.distributed import differentiable
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
        parallel_heads = context.tp_size * context.sp_size
        check_divisible(
            "GPTConfig.num_heads",
            config.num_heads,
            parallel_heads,
            f"attention heads are split over tp_size * sp_size = {parallel_heads} ranks; choose num_heads divisible"
            " by it or smaller tp_size/sp_size.",
        )
        check_divisible(
            "GPTConfig.vocab_size",
            config.vocab_size,
            context.tp_size,
            f"the vocabulary is split over tp_size = {context.tp_size} ranks; pad vocab_size to a multiple of it.",
        )
        plan = ParallelPlan()
        if context.tp_size > 1:
            self._split_layers(model, context, plan)
        if context.split_gather:
            plan.add_partial_gradients([*norm_parameters(model), model.position_embedding.weight])
        if context.sp_size > 1:
            for block in model.blocks:
                block.attn.forward = functools.partial(_ulysses_attention, block.attn, context)  # type: ignore[method-assign]
        if context.split_gather or context.sp_size > 1:
            model.forward = functools.partial(_forward, model, context)  # type: ignore[method-assign]
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
            hidden = _embed(self, self.context, hidden)
        for layer in self.layers:
            hidden = layer(hidden)
        if self.last:
            hidden = self.lm_head(self.final_norm(hidden))
        return hidden


def _embed(model: nn.Module, context: ParallelContext, input_ids: Tensor) -> Tensor:
    if input_ids.dim() != 2:
        raise ValueError(f"GPT expects input_ids of shape [batch, time], got shape {tuple(input_ids.shape)}.")
    if context.split_gather and input_ids.shape[1] % context.tp_size != 0:
        raise ValueError(
            f"Split-gather sequence parallelism splits the sequence over tp_size={context.tp_size} ranks, but the batch"
            f" has {input_ids.shape[1]} tokens per sequence: use a sequence length divisible by {context.tp_size}."
        )
    tokens = model.token_embedding(input_ids)  # a sequence shard under split-gather (reduce-scattered)
    positions = positions_for(input_ids.shape[1], context)
    if positions.stop > model.position_embedding.num_embeddings:
        raise ValueError(
            f"Sequence length exceeds block_size={model.position_embedding.num_embeddings}; crop the input or build"
            " the model with a larger block_size."
        )
    position_ids = torch.arange(positions.start, positions.stop, device=input_ids.device)
    return model.embedding_dropout(tokens + model.position_embedding(position_ids))


def _forward(model: GPT, context: ParallelContext, input_ids: Tensor) -> Tensor:
    hidden = _embed(model, context, input_ids)
    for block in model.blocks:
        hidden = block(hidden)
    return model.lm_head(model.final_norm(hidden))


def _ulysses_attention(attention: CausalSelfAttention, context: ParallelContext, hidden: Tensor) -> Tensor:
    """Attention over the whole sequence from sequence shards: heads are exchanged for sequence and back."""
    batch_size, local_length, _ = hidden.shape
    qkv = attention.qkv(hidden).view(batch_size, local_length, -1, 3, attention.head_dim)
    query, key, value = qkv.permute(3, 0, 2, 1, 4).unbind(0)  # each [batch, heads, local time, head_dim]
    group = context.sp_group
    # [batch, heads, time / sp, dim] -> [batch, heads / sp, time, dim]: each rank attends over every token.
    query, key, value = (differentiable.all_to_all(tensor, 1, 2, group) for tensor in (query, key, value))
    attended = F.scaled_dot_product_attention(
        query, key, value, dropout_p=attention.dropout if attention.training else 0.0, is_causal=True
    )
    attended = differentiable.all_to_all(attended, 2, 1, group)
    attended = attended.transpose(1, 2).reshape(batch_size, local_length, -1)
    return attention.residual_dropout(attention.proj(attended))


__all__ = ["GPTPolicy", "GPTStage"]
