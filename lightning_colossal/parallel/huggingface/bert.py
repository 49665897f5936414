"""The policy for Hugging Face BERT (``BertModel``, ``BertForMaskedLM``, ``BertForSequenceClassification``, ...).

BERT carries no tensor-parallel plan of its own. Megatron's split of its encoder layers: ``query``, ``key``,
``value`` and ``intermediate.dense`` column-parallel, ``attention.output.dense`` and ``output.dense`` row-parallel
(each followed by dropout, the residual and a LayerNorm on the whole hidden size, as before). The self-attention
reshapes with ``-1`` heads, so a rank holding a share of the heads runs the unchanged forward. Embeddings, pooler
and task heads stay whole. Pipelines are not built in for BERT: its embedding takes token-type ids and an attention
mask, which a stage cannot receive from ``torch.distributed.pipelining``'s single-tensor hand-over.
"""

from __future__ import annotations

from torch import nn

from lightning_colossal.parallel.huggingface import internals
from lightning_colossal.parallel.huggingface.split_gather import layout_for
from lightning_colossal.parallel.policy import (
    ModelPolicy,
    ParallelPlan,
    check_divisible,
    column_parallel,
    refuse_sequence_parallel,
    row_parallel,
)
from lightning_colossal.parallel.tensor_parallel import ParallelContext


class BertPolicy(ModelPolicy):
    """Tensor parallelism for ``transformers`` BERT models."""

    name = "bert"

    def accepts(self, module: nn.Module) -> bool:
        from transformers import BertPreTrainedModel

        return isinstance(module, BertPreTrainedModel)

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        internals.warn_if_untested()
        if context.split_gather:
            layout_for(model)  # refuses, naming why BERT has no split-gather layout
        refuse_sequence_parallel(context, "The BERT policy")
        config = model.config  # type: ignore[attr-defined]
        check_divisible(
            "BertConfig.num_attention_heads",
            config.num_attention_heads,
            context.tp_size,
            f"attention heads are split over tp_size = {context.tp_size} ranks; choose a tp_size that divides it.",
        )
        plan = ParallelPlan()
        if context.tp_size == 1:
            return plan
        encoder = getattr(model, "bert", model).encoder
        for layer in encoder.layer:
            if getattr(layer, "crossattention", None) is not None:
                raise ValueError(
                    "BERT with cross-attention (a decoder with add_cross_attention=True) is not split by the built-in"
                    " policy: use tp_size=1 or pass a ModelPolicy subclass."
                )
            attention = layer.attention.self
            for projection in ("query", "key", "value"):
                setattr(attention, projection, column_parallel(getattr(attention, projection), context, plan))
            attention.num_attention_heads //= context.tp_size
            attention.all_head_size //= context.tp_size
            layer.attention.output.dense = row_parallel(layer.attention.output.dense, context, plan)
            layer.intermediate.dense = column_parallel(layer.intermediate.dense, context, plan)
            layer.output.dense = row_parallel(layer.output.dense, context, plan)
        return plan
