"""The policy for Hugging Face GPT-2 (``GPT2LMHeadModel``, ``GPT2Model``, ...): tensor and pipeline parallelism, and
split-gather sequence parallelism through GPT-2's layout in ``split_gather.py``.

GPT-2 carries no tensor-parallel plan of its own, and its projections are ``Conv1D`` modules (weights stored
``[in, out]``), with q, k and v fused into one ``c_attn``. Megatron's split applies all the same: ``c_attn`` and
``mlp.c_fc`` column-parallel, ``attn.c_proj`` and ``mlp.c_proj`` row-parallel. ``c_attn``'s output is three blocks
(q, k, v), each split over the ranks on its own, so a rank holds q, k and v of its heads; the attention module is
told its per-rank width (``split_size``), and its forward infers the head count from the shapes. Embeddings and the
tied LM head stay whole (GPT-2's vocabulary, 50257, divides by no tensor-parallel size).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_colossal.parallel.huggingface import internals
from lightning_colossal.parallel.huggingface.base_model import no_cache
from lightning_colossal.parallel.huggingface.sequence import refuse_pipeline_stages
from lightning_colossal.parallel.huggingface.sequence_modes import parallelize_with_sequence
from lightning_colossal.parallel.policy import (
    ModelPolicy,
    ParallelPlan,
    check_divisible,
    column_parallel,
    row_parallel,
)
from lightning_colossal.parallel.tensor_parallel import ParallelContext


class GPT2Policy(ModelPolicy):
    """Policy for ``transformers`` GPT-2 models."""

    name = "gpt2"

    def accepts(self, module: nn.Module) -> bool:
        from transformers import GPT2PreTrainedModel

        return isinstance(module, GPT2PreTrainedModel)

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        internals.warn_if_untested()
        return parallelize_with_sequence(model, context, lambda tensor_parallel: self._split(model, tensor_parallel))

    def _split(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        """Tensor parallelism alone (``context`` has no sequence parallelism)."""
        config = model.config  # type: ignore[attr-defined]
        if context.tp_size > 1 and getattr(config, "add_cross_attention", False):
            raise ValueError(
                "GPT-2 with cross-attention (config.add_cross_attention=True) is not split by the built-in policy:"
                " use tp_size=1 or pass a ModelPolicy subclass."
            )
        check_divisible(
            "GPT2Config.n_head",
            config.n_head,
            context.tp_size,
            f"attention heads are split over tp_size = {context.tp_size} ranks; choose a tp_size that divides it.",
        )
        plan = ParallelPlan()
        if context.tp_size == 1:
            return plan
        for block in _transformer(model).h:
            attention = block.attn
            attention.c_attn = column_parallel(attention.c_attn, context, plan, transposed=True, fused_parts=3)
            attention.c_proj = row_parallel(attention.c_proj, context, plan, transposed=True)
            # The forward splits c_attn's output into q, k, v by split_size and reshapes with -1 heads.
            attention.split_size //= context.tp_size
            attention.num_heads //= context.tp_size
            block.mlp.c_fc = column_parallel(block.mlp.c_fc, context, plan, transposed=True)
            block.mlp.c_proj = row_parallel(block.mlp.c_proj, context, plan, transposed=True)
        return plan

    def layers(self, model: nn.Module) -> nn.ModuleList:
        return _transformer(model).h  # type: ignore[return-value]

    def stage_module(
        self, model: nn.Module, layer_indices: list[int], first: bool, last: bool, context: ParallelContext
    ) -> nn.Module:
        refuse_pipeline_stages(context)
        transformer = _transformer(model)
        if transformer is not model and not isinstance(getattr(model, "lm_head", None), nn.Module):
            raise ValueError(
                f"{type(model).__name__} has no `lm_head`: built-in GPT-2 pipeline stages run GPT2LMHeadModel's head"
                " (or none, for GPT2Model). Use pp_size=1, or pass a ModelPolicy subclass for this head."
            )
        return GPT2Stage(model, layer_indices, first, last)

    def prune(self, model: nn.Module, keep_layers: set[int], first: bool, last: bool) -> None:
        transformer = _transformer(model)
        for index in range(len(transformer.h)):
            if index not in keep_layers:
                transformer.h[index] = nn.Identity()
        if not first:
            transformer.wte = None
            transformer.wpe = None
        if not last:
            transformer.ln_f = None
            if transformer is not model:
                model.lm_head = None


class GPT2Stage(nn.Module):
    """One pipeline stage of GPT-2: embeddings (first), its blocks, final norm and head (last)."""

    def __init__(self, model: nn.Module, layer_indices: list[int], first: bool, last: bool) -> None:
        super().__init__()
        transformer = _transformer(model)
        self.config = transformer.config
        self.first, self.last = first, last
        self.drop = transformer.drop
        if first:
            self.wte = transformer.wte
            self.wpe = transformer.wpe
        self.layers = nn.ModuleList(transformer.h[index] for index in layer_indices)
        if last:
            self.ln_f = transformer.ln_f
            self.lm_head = model.lm_head if transformer is not model else nn.Identity()

    def forward(self, hidden: Tensor) -> Tensor:
        create_causal_mask, _ = internals.causal_mask_builders("GPT-2's pipeline stages")
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        if self.first:
            hidden = self.drop(self.wte(hidden) + self.wpe(position_ids))
        mask = create_causal_mask(
            config=self.config,
            inputs_embeds=hidden,
            attention_mask=None,
            position_ids=position_ids,
            **no_cache(create_causal_mask),
        )
        for layer in self.layers:
            output = layer(hidden, attention_mask=mask)
            hidden = output[0] if isinstance(output, tuple) else output
        if self.last:
            hidden = self.lm_head(self.ln_f(hidden))
        return hidden


def _transformer(model: nn.Module) -> nn.Module:
    """``GPT2Model`` inside a GPT-2 head model (``model.transformer``), or the model itself."""
    return getattr(model, "transformer", model)
