"""Tensor parallelism from a plan: module-name patterns mapped to ``"colwise"`` / ``"rowwise"``.

This is how a user splits a model no built-in policy knows (``policy={"layers.*.attn.q": "colwise", ...}``, names
relative to the LightningModule), and how Hugging Face models that carry their own plan
(``config.base_model_tp_plan``: Llama, Qwen2, Mistral, ...) are split automatically. ``*`` matches one name
component (a layer index). Two more styles split nothing but say how a whole module's gradient is reduced (see
[Note: replicated parameters in tensor-parallel regions] in ``policy.py``): ``"replicated_with_grad_allreduce"``
(applied to this rank's slice of split features, like Qwen3's per-head ``q_norm``: gradients summed over the
tensor-parallel ranks) and ``"replicate"`` (sees the whole input: nothing to do). Built-in family plans
(``huggingface/families.py``) add ``FusedColumns`` (a fused projection split block by block) and ``"colwise"`` on an
``nn.Embedding`` (its embedding dimension split: T5's per-head position bias). Other styles (e.g. Hugging Face's
``colwise_gather_output``, whose outputs are gathered) are left unsplit with a warning: a whole layer on whole
inputs stays correct, only less of the model is sharded; one left whole inside a tensor-parallel region is refused.
Plans give tensor parallelism only; pipelines and sequence parallelism need a policy that knows the model's
structure.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from lightning_colossal.parallel.policy import (
    ModelPolicy,
    ParallelPlan,
    check_tensor_parallel_regions,
    column_parallel,
    refuse_sequence_parallel,
    row_parallel,
)
from lightning_colossal.parallel.tensor_parallel import (
    LocalColumnsLinear,
    ParallelContext,
    TensorParallelPlacement,
    shard_of,
)

SPLIT_STYLES = ("colwise", "rowwise")
#: Whole modules whose gradient is a partial sum over the tensor-parallel ranks (Hugging Face's name).
PARTIAL_GRADIENT_STYLE = "replicated_with_grad_allreduce"
#: Whole modules that see whole inputs (Hugging Face's name).
REPLICATE_STYLE = "replicate"
APPLIED_STYLES = (*SPLIT_STYLES, PARTIAL_GRADIENT_STYLE, REPLICATE_STYLE)


def module_pattern(plan_key: str) -> re.Pattern[str]:
    return re.compile(
        "^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in plan_key.split(".")) + "$"
    )


@dataclass(frozen=True)
class FusedColumns:
    """Style of a column-parallel ``nn.Linear`` whose outputs are consecutive blocks of these relative sizes.

    A contiguous split would give rank 0 all the queries and rank 1 the keys and values; instead each block is
    split on its own, so every rank holds its share of each (Phi-3's ``qkv_proj`` ``[q][k][v]``:
    ``FusedColumns((heads, kv_heads, kv_heads))``; ``gate_up_proj`` ``[gate][up]``: ``FusedColumns((1, 1))``).
    ``whole`` marks blocks every rank needs in full (Falcon's one shared key/value head under multi-query
    attention): the layer then stays whole on every rank, keeps only the outputs this rank uses, and its gradient
    is summed over the tensor-parallel ranks (see ``LocalColumnsLinear``).
    """

    blocks: tuple[int, ...]
    whole: tuple[bool, ...] = ()

    def __str__(self) -> str:
        return f"FusedColumns({self.blocks}, whole={self.whole})"


def _applied(style: str | FusedColumns) -> bool:
    return isinstance(style, FusedColumns) or style in APPLIED_STYLES


def _apply_style(
    model: nn.Module,
    name: str,
    module: nn.Module,
    style: str | FusedColumns,
    context: ParallelContext,
    plan: ParallelPlan,
) -> int:
    """Apply one plan entry to ``module`` (named ``name`` in ``model``); 1 if it split the module, else 0."""
    # The module's own parameters only (as Hugging Face's styles): a child may be split by another rule.
    if style == PARTIAL_GRADIENT_STYLE:
        plan.add_partial_gradients(module.parameters(recurse=False))
        return 0
    if style == REPLICATE_STYLE:
        plan.replicated.extend(module.parameters(recurse=False))
        return 0
    if is_lora_layer(module) and not isinstance(style, FusedColumns):
        split_lora_layer(name, module, style, context, plan)
        return 1
    if isinstance(module, nn.Embedding) and style == "colwise":
        split_embedding_columns(module, context, plan)
        return 1
    if not isinstance(module, nn.Linear):
        raise TypeError(
            f"The plan splits {name!r} ({type(module).__name__}) as {style}; only nn.Linear (or a peft LoRA layer"
            " wrapping one, for 'colwise'/'rowwise'; or an nn.Embedding, for 'colwise') can be split."
        )
    parent_name, _, attribute = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(style, FusedColumns):
        setattr(parent, attribute, fused_column_parallel(module, style, context, plan))
    else:
        split = column_parallel if style == "colwise" else row_parallel
        setattr(parent, attribute, split(module, context, plan))
    return 1


def fused_column_parallel(
    linear: nn.Linear, style: FusedColumns, context: ParallelContext, plan: ParallelPlan
) -> nn.Module:
    """A fused projection split block by block (see ``FusedColumns``)."""
    if not any(style.whole):
        return column_parallel(linear, context, plan, fused_blocks=style.blocks)
    lengths = TensorParallelPlacement(0, fused_blocks=style.blocks).block_lengths(linear.out_features)
    columns, start = [], 0
    for length, whole in zip(lengths, style.whole, strict=True):
        if not whole and length % context.tp_size:
            raise ValueError(f"A block of {length} output features does not split over tp_size={context.tp_size}.")
        piece = length if whole else length // context.tp_size
        first = start if whole else start + context.tp_rank * piece
        columns.append(torch.arange(first, first + piece))
        start += length
    layer = LocalColumnsLinear(linear.weight, linear.bias, torch.cat(columns), context)
    plan.add_partial_gradients(layer.parameters())
    return layer


def split_embedding_columns(embedding: nn.Embedding, context: ParallelContext, plan: ParallelPlan) -> None:
    """Keep this rank's columns of an ``nn.Embedding`` in place: its output is this rank's slice of the features,
    as a column-parallel layer's (T5's relative position bias: one column per attention head)."""
    placement = TensorParallelPlacement(1)
    shard = shard_of(embedding.weight.detach(), placement, context.tp_rank, context.tp_size).clone()
    embedding.weight = nn.Parameter(shard, requires_grad=embedding.weight.requires_grad)
    embedding.embedding_dim = shard.shape[1]
    plan.record(embedding.weight, placement)


def split_parameter_rows(
    model: nn.Module, name: str, parameter: nn.Parameter, context: ParallelContext, plan: ParallelPlan
) -> None:
    """A plan key naming a parameter itself as ``colwise`` (Hugging Face's ``self_attn.sinks``, one value per head):
    keep this rank's rows in place, the rows of its own heads, as a column-parallel layer keeps its output rows."""
    if parameter.dim() == 0 or parameter.shape[0] % context.tp_size:
        raise ValueError(
            f"The plan splits the parameter {name!r} (shape {tuple(parameter.shape)}) by rows over tp_size="
            f"{context.tp_size}, which does not divide its {parameter.shape[0] if parameter.dim() else 0} rows;"
            " choose a tp_size that divides the number of attention heads."
        )
    placement = TensorParallelPlacement(0)
    shard = shard_of(parameter.detach(), placement, context.tp_rank, context.tp_size).clone()
    owner_name, _, attribute = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attribute, nn.Parameter(shard, requires_grad=parameter.requires_grad))
    plan.record(getattr(owner, attribute), placement)


class PlanPolicy(ModelPolicy):
    """Split the ``nn.Linear`` modules a plan names.

    Args:
        plan: module-name pattern -> ``"colwise"``, ``"rowwise"``, ``FusedColumns(...)`` or a gradient style.
        prefix: prepended to every pattern (the path from the parallelised module to the plan's root).
        heads: ``(what, count)`` pairs that must divide by the tensor-parallel size (attention heads).
        origin: where the plan comes from, for errors (``None``: the user's ``policy=`` dict); ``fix``: what to do
            when it splits nothing.
    """

    name = "plan"

    def __init__(
        self,
        plan: dict[str, str | FusedColumns],
        prefix: str = "",
        heads: tuple[tuple[str, int], ...] = (),
        origin: str | None = None,
        fix: str = "",
    ) -> None:
        self.plan = dict(plan)
        self.prefix = prefix
        self.heads = heads
        self.origin = origin
        self.fix = fix

    def accepts(self, module: nn.Module) -> bool:
        return True  # applies to the module it is given (the LightningModule for a user plan)

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        refuse_sequence_parallel(context, "A tensor-parallel plan")
        for what, count in self.heads:
            if count % context.tp_size != 0:
                raise ValueError(
                    f"{what} = {count} is not divisible by tp_size = {context.tp_size}: attention heads are split over"
                    " the tensor-parallel ranks; choose a tp_size that divides it."
                )
        plan = ParallelPlan()
        if context.tp_size == 1:
            return plan
        ignored = sorted({str(style) for style in self.plan.values() if not _applied(style)})
        if ignored:
            warnings.warn(
                f"Tensor-parallel styles {ignored} are not applied; those modules stay whole (a whole module inside a"
                " tensor-parallel region is refused).",
                stacklevel=2,
            )
        rules = [(module_pattern(self.prefix + key), style) for key, style in self.plan.items() if _applied(style)]
        matched = 0
        for name, module in list(model.named_modules()):
            style = next((style for pattern, style in rules if pattern.match(name)), None)
            if style is not None:
                matched += _apply_style(model, name, module, style, context, plan)
        for name, parameter in list(model.named_parameters()):
            style = next((style for pattern, style in rules if pattern.match(name)), None)
            if style == "colwise":
                split_parameter_rows(model, name, parameter, context, plan)
        if matched == 0:
            raise ValueError(self._nothing_split_message(model, ignored))
        check_tensor_parallel_regions(model, plan, lambda names: self._how_to_declare(names, model))
        return plan

    def _nothing_split_message(self, model: nn.Module, ignored: list[str]) -> str:
        unsupported = (
            f" Its styles {ignored} are not applied here (only 'colwise'/'rowwise' on nn.Linear modules, and"
            f" '{PARTIAL_GRADIENT_STYLE}'/'{REPLICATE_STYLE}')."
            if ignored
            else ""
        )
        if self.origin is not None:
            return f"{self.origin} {sorted(self.plan)} split no nn.Linear of {type(model).__name__}.{unsupported} {self.fix}"
        return (
            f"The tensor-parallel plan {sorted(self.plan)} matched no nn.Linear of {type(model).__name__}.{unsupported}"
            " Write the patterns relative to the LightningModule (e.g. 'model.layers.*.attn.q_proj')."
        )

    def _how_to_declare(self, names: list[str], model: nn.Module) -> str:
        where = "config.base_model_tp_plan in configure_model" if self.origin is not None else "the policy= dict"
        # A parameter with one row per attention head (a per-head sink, a norm over each head's features) belongs
        # split with the heads: a whole one cannot even broadcast against this rank's heads.
        head_counts = {count for _, count in self.heads}
        per_head = [name for name in names if _leading_size(model, name) in head_counts]
        if per_head:
            example = ", ".join(f"'{key}': 'colwise'" for key in _plan_keys(per_head, self.prefix, model))
            return (
                f"{per_head} hold one row per attention head: add {example} to {where} (a key naming the parameter"
                " itself splits its rows with the heads); or pass a ModelPolicy subclass that declares it."
            )
        # The parameter's module as a plan key: relative to the plan's root, layer indices as `*`.
        modules = [name.rpartition(".")[0] for name in names]
        example = ", ".join(f"'{key}': '{PARTIAL_GRADIENT_STYLE}'" for key in _plan_keys(modules, self.prefix, model))
        return (
            f"Add {example} to {where} if each rank applies it to its own slice of the split heads/features (its"
            f" gradient is then summed over the tensor-parallel ranks), or '{REPLICATE_STYLE}' if it sees the whole"
            " input; or pass a ModelPolicy subclass that declares it."
        )


def _plan_keys(names: list[str], prefix: str, model: nn.Module) -> list[str]:
    """Plan keys for these names: relative to the plan's root, layer indices as ``*``. An index into an
    ``nn.Sequential`` stays as it is: its children are different steps, not repeated layers (``*`` there would
    declare the layers before the split too)."""
    keys = set()
    for name in names:
        parts = name.split(".")
        for position, part in enumerate(parts):
            if part.isdigit() and not isinstance(_submodule(model, parts[:position]), nn.Sequential):
                parts[position] = "*"
        keys.add(".".join(parts).removeprefix(prefix))
    return sorted(keys)


def _submodule(model: nn.Module, parts: list[str]) -> nn.Module | None:
    try:
        return model.get_submodule(".".join(parts))
    except AttributeError:
        return None


def _leading_size(model: nn.Module, name: str) -> int | None:
    try:
        parameter = model.get_parameter(name)
    except AttributeError:
        return None
    return parameter.shape[0] if parameter.dim() >= 1 else None


# [Note: LoRA layers under tensor parallelism]
# peft's ``get_peft_model`` replaces a targeted ``nn.Linear`` by a LoRA layer that keeps it as ``base_layer`` and adds
# ``lora_B(lora_A(x)) * scaling`` to its output, under the same module name, so a plan's pattern now names the LoRA
# layer. Splitting it means splitting ``base_layer`` and the one adapter matrix on the split side:
# - colwise: the output features are split, so ``lora_B`` (``[out, r]``) is split by rows like the base, and
#   ``lora_A`` stays whole: it sees the whole input and, because the column-parallel ``lora_B`` sums its input
#   gradient over the tensor-parallel ranks in backward, gets the complete gradient on every rank (``replicated``).
# - rowwise: the input features are split, so ``lora_A`` (``[r, in]``) is split by columns and its partial products
#   are summed (a row-parallel layer of its own, an all-reduce of ``r`` features), and ``lora_B`` stays whole: it
#   sees the whole, summed input and the whole output gradient (``replicated``).
# Parameter names and ``requires_grad`` are unchanged (the frozen base stays frozen). DoRA (its magnitude normalises
# by the whole weight's norm), LoRA on embeddings, and split-gather sequence parallelism (whose gathers and
# reduce-scatters sit at block level and would leave the adapters' gradients partial) are refused.


def is_lora_layer(module: nn.Module) -> bool:
    """A peft LoRA layer around an ``nn.Linear`` (checked by structure, so peft need not be installed)."""
    return isinstance(getattr(module, "base_layer", None), nn.Linear) and isinstance(
        getattr(module, "lora_A", None), nn.ModuleDict
    )


def split_lora_layer(name: str, module: nn.Module, style: str, context: ParallelContext, plan: ParallelPlan) -> None:
    """Split a peft LoRA layer's base and adapters in place (see [Note: LoRA layers under tensor parallelism])."""
    magnitudes = getattr(module, "lora_magnitude_vector", None)
    if magnitudes is not None and len(magnitudes) > 0:
        raise ValueError(
            f"{name!r} is a DoRA layer (LoraConfig(use_dora=True)): its magnitude is normalised by the whole weight's"
            " norm, which no tensor-parallel rank holds. Use plain LoRA (use_dora=False) with tp_size > 1, or train"
            " DoRA with tp_size=1 (data parallelism and zero_stage still apply)."
        )
    if len(getattr(module, "lora_embedding_A", {})) > 0:
        raise ValueError(f"{name!r} holds LoRA embedding adapters, which tensor parallelism does not split.")
    column = style == "colwise"
    split = column_parallel if column else row_parallel
    module.base_layer = split(module.base_layer, context, plan)
    split_side, whole_side = (module.lora_B, module.lora_A) if column else (module.lora_A, module.lora_B)
    for adapter in list(split_side.keys()):
        if not isinstance(split_side[adapter], nn.Linear):
            raise TypeError(
                f"The LoRA adapter {adapter!r} of {name!r} is a {type(split_side[adapter]).__name__}, not nn.Linear:"
                " only linear LoRA adapters can be split; train it with tp_size=1."
            )
        split_side[adapter] = split(split_side[adapter], context, plan)
    for adapter in whole_side.values():
        plan.replicated.extend(adapter.parameters())
