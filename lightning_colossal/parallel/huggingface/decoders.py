"""Hugging Face ``transformers`` decoders that carry their own parallel plans (Llama, Qwen2, Qwen3, Mistral).

Tensor parallelism: their ``config.base_model_tp_plan`` names the column- and row-parallel projections of the base
model; the policy applies it to the base model (``model.<base_model_prefix>``). Attention reshapes in these models
use ``-1`` heads, so a rank with a share of the heads runs the unchanged forward. An untied LM head is split by
vocabulary with its logits left sharded for ``loss_parallel``; embeddings (and a head tied to them) stay whole.

Pipeline parallelism: their ``config.base_model_pp_plan`` says the base model is ``embed_tokens`` -> ``layers`` ->
``norm``; a stage runs the embedding (first), its layers, and the norm and the causal LM's head (last). Each stage
recomputes the rotary position embeddings and the causal mask for its layers, as the base model's forward does once
for all of them; the families accepted for pipelines (``PIPELINE_MODEL_TYPES``) are those whose base forward is
exactly that (no embedding scaling outside the embedding module, no extra per-layer inputs; Gemma scales inside
its embedding module), and the refusal for the others names why (``PIPELINE_REFUSED``).

Split-gather sequence parallelism: ``split_gather.py`` ([Note: split-gather on Hugging Face decoders]) holds where
each family's residual stream is split and gathered; this policy splits the model for tensor parallelism alone and
hands it over.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_colossal.parallel.huggingface import internals
from lightning_colossal.parallel.huggingface.base_model import base_model, no_cache
from lightning_colossal.parallel.huggingface.sequence import refuse_pipeline_stages
from lightning_colossal.parallel.huggingface.sequence_modes import parallelize_with_sequence
from lightning_colossal.parallel.plan_policy import PlanPolicy
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan
from lightning_colossal.parallel.tensor_parallel import (
    ParallelContext,
    TensorParallelPlacement,
    VocabParallelHead,
    shard_of,
)

#: The key of the one mask of a model whose config has no ``layer_types`` (see ``_causal_masks``).
EVERY_LAYER = "every_layer"

#: ``config.model_type`` of the decoders whose base forward is embed -> rotary + mask -> layers -> norm.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "mixtral", "qwen2_moe", "olmoe", "gemma")

#: Families with tensor parallelism but no built-in pipeline stages, and why (named in the refusal).
PIPELINE_REFUSED = {
    "gemma2": "its causal LM caps the logits (final_logit_softcapping) after the head, which the stages do not run",
    "gemma3_text": "its layers take two rotary embeddings (local and global) that the stages do not build",
    "gpt_neox": "its base model names its parts embed_in / emb_dropout / final_layer_norm and its head embed_out",
    "opt": "its base forward adds learned positions (offset by 2) and projects in and out around the decoder layers",
    "bloom": "its base forward builds ALiBi biases and runs an embedding LayerNorm before the layers",
    "falcon": "its base forward builds ALiBi biases or rotary embeddings of its own before the layers",
    "bert": "a stage cannot receive its token-type ids and padding mask",
    "t5": "an encoder-decoder runs two layer stacks, the decoder's reading the encoder's output",
    "switch_transformers": "an encoder-decoder runs two layer stacks, the decoder's reading the encoder's output",
    "vit": "its embedding adds a [CLS] token and position embeddings to patches, and its classifier reads position 0",
}


class HuggingFacePlanPolicy(ModelPolicy):
    """Tensor (from ``config.base_model_tp_plan``) and pipeline parallelism for a ``transformers`` decoder."""

    name = "huggingface (base_model_tp_plan)"

    def accepts(self, module: nn.Module) -> bool:
        from transformers import PreTrainedModel

        config = getattr(module, "config", None)
        return isinstance(module, PreTrainedModel) and bool(getattr(config, "base_model_tp_plan", None))

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        internals.warn_if_untested()
        return parallelize_with_sequence(model, context, lambda tensor_parallel: self._split(model, tensor_parallel))

    def _split(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        """Tensor parallelism alone (``context`` has no sequence parallelism)."""
        config = model.config  # type: ignore[attr-defined]
        base, prefix = base_model(model)
        heads = tuple(
            (f"config.{attribute}", int(getattr(config, attribute)))
            for attribute in ("num_attention_heads", "num_key_value_heads")
            if getattr(config, attribute, None)
        )
        model_type = getattr(config, "model_type", type(model).__name__)
        plan_policy = PlanPolicy(
            dict(config.base_model_tp_plan),
            prefix=f"{prefix}." if prefix else "",
            heads=heads,
            origin=f"The tensor-parallel plan of this '{model_type}' model (config.base_model_tp_plan)",
            fix=(
                "Train it with tp_size=1 (data parallelism and zero_stage still apply), or pass a ModelPolicy subclass"
                " that splits its layers."
            ),
        )
        plan = plan_policy.parallelize(model, context)
        self._split_head(model, base, context, plan)
        return plan

    @staticmethod
    def _split_head(model: nn.Module, base: nn.Module, context: ParallelContext, plan: ParallelPlan) -> None:
        """A causal LM's untied head, vocabulary-parallel: no rank computes the whole logits (they stay a sharded
        DTensor for ``loss_parallel``, which the model's own ``labels=`` loss also runs under). A head tied to the
        (whole) embedding, or a vocabulary that does not divide, stays whole."""
        head = getattr(model, "lm_head", None)
        if context.tp_size == 1 or base is model or not isinstance(head, nn.Linear) or head.bias is not None:
            return
        embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
        if embedding is not None and getattr(embedding, "weight", None) is head.weight:
            return
        if head.out_features % context.tp_size != 0:
            warnings.warn(
                f"lm_head has {head.out_features} outputs, not divisible by tp_size={context.tp_size}: it stays whole"
                " on every rank (pad the vocabulary to a multiple of tp_size to split it).",
                stacklevel=3,
            )
            return
        rows = TensorParallelPlacement(0)
        weight = shard_of(head.weight.detach(), rows, context.tp_rank, context.tp_size).clone()
        split = VocabParallelHead(weight, None, context)
        split.weight.requires_grad_(head.weight.requires_grad)
        model.lm_head = split
        plan.record(split.weight, rows)

    # ---------------------------------------------------------------------------------------------- pipeline
    def _check_pipeline(self, model: nn.Module) -> None:
        check_pipeline_family(model)
        base, _ = base_model(model)
        if base is not model and not isinstance(getattr(model, "lm_head", None), nn.Module):
            raise ValueError(
                f"{type(model).__name__} has no `lm_head`: built-in pipeline stages run a causal LM's head (or none,"
                " for a bare base model). Use pp_size=1, or pass a ModelPolicy subclass for this head."
            )

    def layers(self, model: nn.Module) -> nn.ModuleList:
        self._check_pipeline(model)
        base, _ = base_model(model)
        return base.layers  # type: ignore[return-value]

    def stage_module(
        self, model: nn.Module, layer_indices: list[int], first: bool, last: bool, context: ParallelContext
    ) -> nn.Module:
        self._check_pipeline(model)
        refuse_pipeline_stages(context)
        if context.split_gather:
            raise ValueError(
                "Pipeline stages of Hugging Face models do not run split-gather sequence parallelism yet: use"
                " pp_size=1 with sequence_parallel='split_gather', or drop sequence_parallel with pp_size > 1."
            )
        return DecoderStage(model, layer_indices, first, last)

    def prune(self, model: nn.Module, keep_layers: set[int], first: bool, last: bool) -> None:
        base, _ = base_model(model)
        for index in range(len(base.layers)):
            if index not in keep_layers:
                base.layers[index] = nn.Identity()
        if not first:
            base.embed_tokens = None
        if not last:
            base.norm = None
            if base is not model:
                model.lm_head = None


def check_pipeline_family(model: nn.Module) -> None:
    """Refuse a family without built-in pipeline stages, naming why (``PIPELINE_REFUSED``)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type not in PIPELINE_MODEL_TYPES:
        why = PIPELINE_REFUSED.get(model_type, "its base forward is not known to be embed -> layers -> norm")  # type: ignore[arg-type]
        raise ValueError(
            f"Pipeline stages for Hugging Face '{model_type}' models, and the layer stack activation checkpointing"
            f" recomputes, are not built in: {why}. Use pp_size=1 and activation_checkpointing=False (tensor and data"
            " parallelism still apply), or pass a ModelPolicy subclass that implements layers/stage_module/prune for"
            f" it; built in for {', '.join(PIPELINE_MODEL_TYPES)}."
        )


class DecoderStage(nn.Module):
    """One pipeline stage of a ``transformers`` decoder: references (never copies) the model's modules it runs.

    The first stage takes token ids, the others hidden states; the last returns the logits (this rank's vocabulary
    slice under a vocabulary-parallel head), or the final hidden states of a base model without a head.
    """

    def __init__(self, model: nn.Module, layer_indices: list[int], first: bool, last: bool) -> None:
        super().__init__()
        base, _ = base_model(model)
        self.config = base.config
        self.first, self.last = first, last
        self.layer_indices = list(layer_indices)
        self.rotary_emb = base.rotary_emb
        if first:
            self.embed_tokens = base.embed_tokens
        self.layers = nn.ModuleList(base.layers[index] for index in layer_indices)
        if last:
            self.norm = base.norm
            self.lm_head = model.lm_head if base is not model else nn.Identity()
            if isinstance(self.lm_head, VocabParallelHead):
                self.lm_head.local_output = True
        #: The last stage returns this rank's vocabulary slice of the logits (see ``PipelineStep._stage_loss``).
        self.vocab_parallel_output = last and isinstance(getattr(model, "lm_head", None), VocabParallelHead)

    def forward(self, hidden: Tensor) -> Tensor:
        if self.first:
            hidden = self.embed_tokens(hidden)
        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        masks = _causal_masks(self.config, hidden, position_ids)
        layers = zip(self.layer_indices, self.layers, strict=True)
        hidden = _run_layers(self.config, layers, hidden, masks, position_ids, position_embeddings)
        if self.last:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def _run_layers(
    config: Any,
    layers: Iterable[tuple[int, nn.Module]],
    hidden: Tensor,
    masks: dict[str, Any],
    position_ids: Tensor,
    position_embeddings: Any,
) -> Tensor:
    """Decoder layers ``(index in the whole model, layer)`` in order, each with the mask of its attention type."""
    layer_types = getattr(config, "layer_types", None)
    for index, layer in layers:
        mask = masks[layer_types[index] if layer_types else EVERY_LAYER]
        output = layer(hidden, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
        hidden = output[0] if isinstance(output, tuple) else output
    return hidden


def _causal_masks(
    config: Any, hidden: Tensor, position_ids: Tensor, attention_mask: Tensor | None = None
) -> dict[str, Any]:
    """The masks the base model's forward builds (``None`` where attention can use ``is_causal``), by attention
    type (``EVERY_LAYER`` for a model without ``layer_types``); ``attention_mask`` marks padding.

    The families name sliding windows two ways, and each forward reads its own: per layer in ``config.layer_types``
    (Qwen2, Qwen3, Gemma), or, without ``layer_types``, one mask for every layer that is windowed whenever
    ``config.sliding_window`` is set (Mistral, Mixtral, Phi-3, Starcoder2)."""
    create_causal_mask, create_sliding_window_causal_mask = internals.causal_mask_builders("Pipeline stages")

    arguments = {"config": config, "inputs_embeds": hidden, "attention_mask": attention_mask}
    arguments.update(no_cache(create_causal_mask))
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        windowed = getattr(config, "sliding_window", None) is not None
        mask_function = create_sliding_window_causal_mask if windowed else create_causal_mask
        return {EVERY_LAYER: mask_function(**arguments, position_ids=position_ids)}
    masks = {"full_attention": create_causal_mask(**arguments, position_ids=position_ids)}
    if "sliding_attention" in layer_types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**arguments, position_ids=position_ids)
    return masks
