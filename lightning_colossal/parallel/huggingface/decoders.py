"""Hugging Face ``transformers`` decoders that carry their own parallel plans (Llama, Qwen2, Qwen3, Mistral).

Tensor parallelism: their ``config.base_model_tp_plan`` names the column- and row-parallel projections of the base
model; the policy applies it to the base model (``model.<base_model_prefix>``). Attention reshapes in these models
use ``-1`` heads, so a rank with a share of the heads runs the unchanged forward. An untied LM head is split by
vocabulary with its logits left sharded for ``loss_parallel``; embeddings (and a head tied to them) stay whole.

Pipeline parallelism: their ``config.base_model_pp_plan`` says the base model is ``embed_tokens`` -> ``layers`` ->
``norm``; a stage runs the embedding (first), its layers, and the norm and the causal LM's head (last). Each stage
recomputes the rotary position embeddings and the causal mask for its layers, as the base model's forward does once
for all of them; the families accepted for pipelines (``PIPELINE_MODEL_TYPES``) are those whose base forward is
exactly that (no embedding scaling, no extra per-layer inputs).

[Note: split-gather on Hugging Face decoders]
These attention modules size their reshapes from their input's sequence length, so the projections cannot gather
the sequence one by one (as the demo GPT's do). Instead the residual stream and the norms are sequence shards, and
each attention and MLP block gathers the whole sequence once at its input (backward: reduce-scatter of the summed
input gradient); its column-parallel projections then take that input as it is and its row-parallel projection
reduce-scatters back to shards. The base model's own forward runs, with hooks attached ([Note: techniques attach
as hooks] in ``parallel/attached.py``):

- on the base model, before its forward: no KV cache (a given cache is refused, ``use_cache`` set to False);
- on the first decoder layer, before it: the sequence is split. Not after the embedding: the base forward builds
  position ids, the causal masks and the rotary embeddings from the embedding output's length, between the embedding
  and the first layer, and they must be the whole sequence's, which attention sees. The layer's ``position_ids``
  argument says the whole length; a hidden state of another length is a shard already, which is what the layer's
  recomputation under activation checkpointing passes (``parallel/attached.py`` explains why it comes through this
  hook);
- on each layer's ``self_attn`` and ``mlp``, before them: the sequence is gathered;
- on the final norm, after it, when the head is whole: the sequence is gathered for the head (a vocabulary-parallel
  head gathers it itself).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_colossal.distributed import differentiable
from lightning_colossal.parallel.huggingface.base_model import base_model
from lightning_colossal.parallel.plan_policy import PlanPolicy, is_lora_layer
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan, norm_parameters
from lightning_colossal.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ParallelContext,
    RowParallelLinear,
    TensorParallelPlacement,
    VocabParallelHead,
    shard_of,
)

#: The key of the one mask of a model whose config has no ``layer_types`` (see ``_causal_masks``).
EVERY_LAYER = "every_layer"

#: ``config.model_type`` of the decoders whose base forward is embed -> rotary + mask -> layers -> norm.
PIPELINE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class HuggingFacePlanPolicy(ModelPolicy):
    """Tensor (from ``config.base_model_tp_plan``) and pipeline parallelism for a ``transformers`` decoder."""

    name = "huggingface (base_model_tp_plan)"

    def accepts(self, module: nn.Module) -> bool:
        from transformers import PreTrainedModel

        config = getattr(module, "config", None)
        return isinstance(module, PreTrainedModel) and bool(getattr(config, "base_model_tp_plan", None))

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
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
        if not context.split_gather:
            plan = plan_policy.parallelize(model, context)
            self._split_head(model, base, context, plan)
            return plan
        return self._parallelize_split_gather(model, base, plan_policy, context)

    def _parallelize_split_gather(
        self, model: nn.Module, base: nn.Module, plan_policy: PlanPolicy, context: ParallelContext
    ) -> ParallelPlan:
        """Megatron sequence parallelism (see [Note: split-gather on Hugging Face decoders])."""
        model_type = getattr(model.config, "model_type", None)  # type: ignore[attr-defined]
        if model_type not in PIPELINE_MODEL_TYPES:
            raise ValueError(
                f"sequence_parallel='split_gather' is built in for Hugging Face {', '.join(PIPELINE_MODEL_TYPES)} models,"
                f" not '{model_type}': drop sequence_parallel, or pass a ModelPolicy subclass."
            )
        lora_layers = [name for name, module in model.named_modules() if is_lora_layer(module)]
        if lora_layers:
            # parallel/plan_policy.py [Note: LoRA layers under tensor parallelism]: the adapters' gradients would be partial.
            raise ValueError(
                f"sequence_parallel='split_gather' does not split peft LoRA layers ({lora_layers[0]!r}, ...): drop"
                " sequence_parallel; tensor parallelism alone splits LoRA layers."
            )
        plan = plan_policy.parallelize(model, dataclasses.replace(context, split_gather=False))
        for module in base.modules():
            if isinstance(module, ColumnParallelLinear):
                module.input_gathered = True  # gathered once per attention / MLP block below
            elif isinstance(module, RowParallelLinear):
                module.context = context  # reduce-scatter back to sequence shards
        attached = plan.attached
        attached.before_forward(base, "split-gather: no KV cache", _without_cache)
        attached.before_forward(
            base.layers[0], "split-gather: split the sequence", functools.partial(_split_whole_sequence, context)
        )
        for layer in base.layers:
            for block in ("self_attn", "mlp"):
                gather = functools.partial(_gather_sequence, context)
                attached.before_forward(getattr(layer, block), "split-gather: gather the sequence", gather)
        self._split_head(model, base, context, plan)
        plan.add_partial_gradients(norm_parameters(base))
        if not isinstance(getattr(model, "lm_head", None), VocabParallelHead):
            attached.after_forward(
                base.norm,
                "split-gather: gather the sequence for the whole head",
                functools.partial(_gather_for_head, context),
            )
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
        model_type = getattr(model.config, "model_type", None)  # type: ignore[attr-defined]
        if model_type not in PIPELINE_MODEL_TYPES:
            raise ValueError(
                f"Pipeline stages for Hugging Face '{model_type}' models are not built in (only for"
                f" {', '.join(PIPELINE_MODEL_TYPES)}): use pp_size=1 (tensor and data parallelism still apply), or"
                " pass a ModelPolicy subclass that implements layers/stage_module/prune for it."
            )
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
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    arguments = {"config": config, "inputs_embeds": hidden, "attention_mask": attention_mask, "past_key_values": None}
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        windowed = getattr(config, "sliding_window", None) is not None
        mask_function = create_sliding_window_causal_mask if windowed else create_causal_mask
        return {EVERY_LAYER: mask_function(**arguments, position_ids=position_ids)}
    masks = {"full_attention": create_causal_mask(**arguments, position_ids=position_ids)}
    if "sliding_attention" in layer_types:
        masks["sliding_attention"] = create_sliding_window_causal_mask(**arguments, position_ids=position_ids)
    return masks


def _without_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Before the base model: split-gather runs without a KV cache (every argument passed by name from here on)."""
    names = [
        name
        for name, parameter in inspect.signature(module.forward).parameters.items()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    arguments = {**dict(zip(names[: len(args)], args, strict=True)), **kwargs}
    # ``past_key_values``: the older name of ``cache``, still accepted by transformers.
    if arguments.get("cache") is not None or arguments.get("past_key_values") is not None:
        raise ValueError(
            "sequence_parallel='split_gather' runs without a KV cache: generate with a model trained this way after"
            " loading it without sequence parallelism."
        )
    arguments["use_cache"] = False
    return (), arguments


def _split_whole_sequence(
    context: ParallelContext, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Before the first decoder layer: this rank's shard of the whole sequence (see [Note: split-gather on Hugging
    Face decoders])."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise RuntimeError(
            f"Split-gather sequence parallelism reads the sequence length from the position_ids the base model passes"
            f" its decoder layers, and this transformers version's {type(module).__name__} got none: drop"
            " sequence_parallel='split_gather', or install a transformers version whose base forward passes them."
        )
    length = position_ids.shape[-1]
    if _hidden_states(args, kwargs).shape[1] != length:
        return None  # a shard already: the layer recomputed under activation checkpointing
    if length % context.tp_size != 0:
        raise ValueError(
            f"Split-gather sequence parallelism splits the sequence over tp_size={context.tp_size} ranks, but the batch"
            f" has {length} tokens per sequence: pad or crop to a multiple of {context.tp_size}."
        )
    return _with_hidden_states(
        args, kwargs, differentiable.split_along(_hidden_states(args, kwargs), 1, context.tp_group)
    )


def _gather_sequence(context: ParallelContext, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Before an attention or MLP block: the whole sequence gathered from this rank's shard (its column-parallel
    projections share the one gather; the gather's backward reduce-scatters their summed input gradient)."""
    whole = differentiable.gather_along(_hidden_states(args, kwargs), 1, context.tp_group)
    return _with_hidden_states(args, kwargs, whole)


def _gather_for_head(context: ParallelContext, module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor:
    """After the final norm: a whole head runs identically on every rank, so it needs the whole sequence (and each
    rank keeps its slice of the gradient)."""
    return differentiable.gather_for_replicated(output, 1, context.tp_group)


def _hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
    return kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]


def _with_hidden_states(args: tuple[Any, ...], kwargs: dict[str, Any], hidden: Tensor) -> tuple[Any, Any]:
    if "hidden_states" in kwargs:
        return args, {**kwargs, "hidden_states": hidden}
    return (hidden, *args[1:]), kwargs
