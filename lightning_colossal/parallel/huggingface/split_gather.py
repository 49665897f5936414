"""Split-gather (Megatron) sequence parallelism on Hugging Face models: where each family's residual stream is split
and gathered, and the hooks that do it.

[Note: split-gather on Hugging Face decoders]
These attention modules size their reshapes from their input's sequence length, so the projections cannot gather
the sequence one by one (as the demo GPT's do). Instead the residual stream and the norms are sequence shards, and
each attention (and MLP) block gathers the whole sequence once at its input (backward: reduce-scatter of the summed
input gradient); its column-parallel projections then take that input as it is and its row-parallel projection
reduce-scatters back to shards. The model's own forward runs, with hooks attached ([Note: techniques attach as
hooks] in ``parallel/attached.py``):

- on the base model, before its forward: no KV cache (a given cache is refused, ``use_cache`` set to False), and
  the whole sequence's length noted;
- on the first layer, before it: the sequence is split. Not after the embedding: the base forward builds position
  ids, the causal masks, the rotary embeddings or the ALiBi biases from the embedding output's length, between the
  embedding and the first layer, and they must be the whole sequence's, which attention sees. A hidden state
  shorter than the whole sequence (the layer's ``position_ids`` argument, or the length noted before the base
  forward) is a shard already, which is what the layer's recomputation under activation checkpointing passes
  (``parallel/attached.py`` explains why it comes through this hook);
- on each layer's *gathered* blocks, before them: the sequence is gathered. This is only right where the gathered
  input feeds column-parallel layers alone (every rank's input gradient is then a part, and the reduce-scatter sums
  them): attention and MLP blocks whose projections are all split;
- on each layer's *whole-sequence* blocks (a mixture of experts, whose router and experts see the input whole;
  Falcon's multi-query attention, whose shared key/value projection stays whole): gathered before them with a
  backward that keeps this rank's slice of the input gradient, run as under tensor parallelism alone (their
  column-parallel layers sum their input gradients, their row-parallel layers all-reduce), and split after them;
- a column-parallel layer in no block (OPT's ``fc1``, in the decoder layer itself) gathers its own input, and every
  row-parallel layer outside whole-sequence blocks reduce-scatters;
- on the final norm, after it, when the head is whole: the sequence is gathered for the head (a vocabulary-parallel
  head gathers it itself).

Whole parameters that run on sequence shards get a part of their gradient on each rank, which the engine sums: every
whole parameter of the layers outside the blocks (norms, a layer scale), a row-parallel layer's bias (added after the
reduce-scatter), and the final norm. The embeddings and whatever the base model runs before the first layer (BLOOM's
embedding norm) see the whole sequence and keep complete gradients.

Each family is one ``SplitGatherLayout``; families refused name why (``REFUSED``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from lightning_colossal.distributed import differentiable
from lightning_colossal.parallel.huggingface.base_model import without_cache
from lightning_colossal.parallel.plan_policy import is_lora_layer
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.tensor_parallel import (
    ColumnParallelLinear,
    LocalColumnsLinear,
    ParallelContext,
    RowParallelLinear,
    VocabParallelHead,
)


@dataclass(frozen=True)
class SplitGatherLayout:
    """Where one family's residual stream is split and gathered; module names relative to the base model (``layers``,
    ``final_norm``) or to one layer (``gathered``, ``whole_sequence``). See [Note: split-gather on Hugging Face
    decoders]."""

    layers: str
    gathered: tuple[str, ...]
    final_norm: str
    whole_sequence: tuple[str, ...] = ()


_DECODER = SplitGatherLayout(layers="layers", gathered=("self_attn", "mlp"), final_norm="norm")
_MIXTURE = SplitGatherLayout(layers="layers", gathered=("self_attn",), final_norm="norm", whole_sequence=("mlp",))


def _falcon(config: Any) -> SplitGatherLayout:
    if config.multi_query and not config.new_decoder_architecture:
        # The one shared key/value head stays whole (``families.py``): the attention runs on the whole sequence.
        return SplitGatherLayout(layers="h", gathered=("mlp",), final_norm="ln_f", whole_sequence=("self_attention",))
    return SplitGatherLayout(layers="h", gathered=("self_attention", "mlp"), final_norm="ln_f")


#: ``config.model_type`` -> the family's layout, or a function of the config that gives it.
LAYOUTS: dict[str, SplitGatherLayout | Callable[[Any], SplitGatherLayout]] = {
    "llama": _DECODER,
    "mistral": _DECODER,
    "qwen2": _DECODER,
    "qwen3": _DECODER,
    "gemma": _DECODER,  # the embedding's scaling runs in the embedding module, on the whole sequence
    "gemma2": _DECODER,  # its extra norms around attention and MLP run on shards
    "phi3": _DECODER,
    "mixtral": _MIXTURE,
    "qwen2_moe": _MIXTURE,
    "olmoe": _MIXTURE,
    "gpt_neox": SplitGatherLayout(layers="layers", gathered=("attention", "mlp"), final_norm="final_layer_norm"),
    "opt": SplitGatherLayout(layers="decoder.layers", gathered=("self_attn",), final_norm="decoder.final_layer_norm"),
    "bloom": SplitGatherLayout(layers="h", gathered=("self_attention", "mlp"), final_norm="ln_f"),
    "falcon": _falcon,
    "gpt2": SplitGatherLayout(layers="h", gathered=("attn", "mlp"), final_norm="ln_f"),
}

#: Families with tensor parallelism whose structure split-gather does not fit, and why.
REFUSED = {
    "bert": "BERT is a bidirectional encoder whose attention output norms sit inside its attention blocks and whose"
    " pooler and task heads read whole sequences; no split-gather layout is built for it",
    "t5": "an encoder-decoder's cross-attention reads the encoder's whole output from every decoder shard, and T5's"
    " relative position bias is computed in its first layer for the whole sequence",
    "switch_transformers": "an encoder-decoder's cross-attention reads the encoder's whole output from every decoder"
    " shard, and Switch's expert capacity depends on the tokens each rank routes",
    "vit": "its classifier reads the [CLS] position of the final hidden states, and the sequence (patches + 1) seldom"
    " divides by tp_size",
}


def layout_for(model: nn.Module) -> SplitGatherLayout:
    """The layout of ``model``'s family, or a refusal naming why there is none; asked before the model is split."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    layout = LAYOUTS.get(model_type)  # type: ignore[arg-type]
    if layout is None:
        why = REFUSED.get(model_type, f"no split-gather layout is built in for '{model_type}' models")  # type: ignore[arg-type]
        raise ValueError(
            f"sequence_parallel='split_gather' is not available for this '{model_type}' model: {why}. Drop"
            f" sequence_parallel (tensor parallelism still applies); built in for {', '.join(LAYOUTS)}."
        )
    lora_layers = [name for name, module in model.named_modules() if is_lora_layer(module)]
    if lora_layers:
        # parallel/plan_policy.py [Note: LoRA layers under tensor parallelism]: the adapters' gradients would be partial.
        raise ValueError(
            f"sequence_parallel='split_gather' does not split peft LoRA layers ({lora_layers[0]!r}, ...): drop"
            " sequence_parallel; tensor parallelism alone splits LoRA layers."
        )
    return layout if isinstance(layout, SplitGatherLayout) else layout(config)


def attach_split_gather(
    model: nn.Module, base: nn.Module, layout: SplitGatherLayout, context: ParallelContext, plan: ParallelPlan
) -> None:
    """Turn ``base``, already split for tensor parallelism alone, into split-gather sequence parallelism over
    ``context`` (see [Note: split-gather on Hugging Face decoders]); the hooks go into ``plan.attached``."""
    try:
        layers, final_norm = base.get_submodule(layout.layers), base.get_submodule(layout.final_norm)
    except AttributeError:
        layers = final_norm = None
    if not isinstance(layers, nn.ModuleList) or not isinstance(final_norm, nn.Module):
        raise ValueError(
            f"Split-gather expects {type(base).__name__}.{layout.layers} to be its layers and {layout.final_norm} its"
            " final norm, which this model lacks (OPT with do_layer_norm_before=False has no final norm) or this"
            " transformers version names otherwise: drop sequence_parallel."
        )
    gathered = [layer.get_submodule(name) for layer in layers for name in layout.gathered]
    whole = [layer.get_submodule(name) for layer in layers for name in layout.whole_sequence]
    in_gathered = {id(module) for block in gathered for module in block.modules()}
    in_whole = {id(module) for block in whole for module in block.modules()}
    for module in base.modules():
        if id(module) in in_whole:
            continue  # tensor parallelism alone, on the whole sequence
        if isinstance(module, ColumnParallelLinear):
            if id(module) in in_gathered:
                module.input_gathered = True  # one gather for the block, before it
            else:
                module.context = context  # gathers its own input
        elif isinstance(module, RowParallelLinear):
            module.context = context  # reduce-scatters back to sequence shards
            if module.bias is not None:
                plan.add_partial_gradients([module.bias])
        elif isinstance(module, LocalColumnsLinear):
            raise ValueError(
                f"A {type(module).__name__} (a projection kept whole for a shared key/value head) sits outside the"
                " whole-sequence blocks of this model's split-gather layout: drop sequence_parallel."
            )
    shards = SequenceShards(context)
    attached = plan.attached
    attached.before_forward(base, "split-gather: no KV cache", shards.before_base_model)
    attached.before_forward(layers[0], "split-gather: split the sequence", shards.split_before_first_layer)
    gather = functools.partial(_gather_sequence, context)
    for block in gathered:
        attached.before_forward(block, "split-gather: gather the sequence", gather)
    for block in whole:
        attached.before_forward(
            block, "split-gather: the whole sequence for a whole block", functools.partial(_gather_whole, context)
        )
        attached.after_forward(block, "split-gather: back to sequence shards", functools.partial(_split_back, context))
    # Whole parameters that run on shards: the layers' own, outside the blocks, and the final norm's.
    split = set(plan.placements)
    in_blocks = in_gathered | in_whole
    plan.add_partial_gradients(
        parameter
        for layer in layers
        for module in layer.modules()
        if id(module) not in in_blocks and not isinstance(module, (ColumnParallelLinear, RowParallelLinear))
        for parameter in module.parameters(recurse=False)
        if id(parameter) not in split
    )
    plan.add_partial_gradients(final_norm.parameters())
    head = getattr(model, "lm_head", None)
    if isinstance(head, VocabParallelHead):
        head.context = context  # gathers the sequence shards itself, inside its product
    else:
        attached.after_forward(
            final_norm,
            "split-gather: gather the sequence for the whole head",
            functools.partial(_gather_for_head, context),
        )


class SequenceShards:
    """The hooks around the base model and its first layer, sharing the whole sequence's length."""

    def __init__(self, context: ParallelContext) -> None:
        self.context = context
        self.length: int | None = None

    def before_base_model(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before the base model: no KV cache (every argument passed by name from here on); the whole length."""
        arguments = without_cache(module, args, kwargs, "sequence_parallel='split_gather'")
        inputs = arguments.get("input_ids")
        if inputs is None:
            inputs = arguments.get("inputs_embeds")
        self.length = None if inputs is None else int(inputs.shape[1])
        return (), arguments

    def split_before_first_layer(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Before the first layer: this rank's shard of the whole sequence."""
        position_ids = kwargs.get("position_ids")
        length = position_ids.shape[-1] if position_ids is not None else self.length
        if length is None:
            raise RuntimeError(
                f"Split-gather sequence parallelism reads the whole sequence's length from the input ids or the"
                f" position_ids the base model passes its layers, and {type(module).__name__} got neither: drop"
                " sequence_parallel='split_gather'."
            )
        hidden = _hidden_states(args, kwargs)
        if hidden.shape[1] != length:
            return None  # a shard already: the layer recomputed under activation checkpointing
        if length % self.context.tp_size != 0:
            raise ValueError(
                f"Split-gather sequence parallelism splits the sequence over tp_size={self.context.tp_size} ranks, but"
                f" the batch has {length} tokens per sequence: pad or crop to a multiple of {self.context.tp_size}."
            )
        return _with_hidden_states(args, kwargs, differentiable.split_along(hidden, 1, self.context.tp_group))


def _gather_sequence(context: ParallelContext, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Before a gathered block: the whole sequence gathered from this rank's shard (its column-parallel projections
    share the one gather; the gather's backward reduce-scatters their summed input gradient)."""
    whole = differentiable.gather_along(_hidden_states(args, kwargs), 1, context.tp_group)
    return _with_hidden_states(args, kwargs, whole)


def _gather_whole(context: ParallelContext, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Before a whole-sequence block: the whole sequence, whose gradient each rank has whole (the block runs the
    same on every rank), so the backward keeps this rank's slice."""
    whole = differentiable.gather_for_replicated(_hidden_states(args, kwargs), 1, context.tp_group)
    # Contiguous: a mixture flattens its tokens with ``view`` (Mixtral), which the gathered layout does not allow.
    return _with_hidden_states(args, kwargs, whole.contiguous())


def _split_back(context: ParallelContext, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    """After a whole-sequence block: this rank's shard of its output (the first one, when it returns a tuple such
    as a mixture's ``(hidden, router_logits)``)."""
    if isinstance(output, tuple):
        return (differentiable.split_along(output[0], 1, context.tp_group), *output[1:])
    return differentiable.split_along(output, 1, context.tp_group)


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
