"""Tensor parallelism for Hugging Face families whose ``config.base_model_tp_plan`` is missing or not applicable.

One declarative ``FamilyPlan`` per family, built from the model's config, fed through the same ``PlanPolicy`` as a
user's ``policy=`` dict and a model's own ``base_model_tp_plan``: module-name patterns (relative to the base model,
``*`` for one name component) mapped to ``"colwise"`` / ``"rowwise"`` / ``FusedColumns``, plus what a split needs
beyond the weights:

- ``head_attributes``: the attention modules' head counts and widths, divided by tp_size. Unlike Llama's, these
  attentions reshape by their own ``num_heads`` (or ``n_heads``), so a rank holding half the heads must say so.
- ``local_config``: config attributes an attention reads from its ``config`` (Phi-3 finds where keys start in the
  fused ``qkv_proj`` from ``config.num_attention_heads``); the module gets its own copy with them divided, the
  model's config (saved with checkpoints) is untouched.
- ``head_counts``: config counts that must divide by tp_size (refused before training otherwise).
- ``per_head_biases``: attention modules that receive ALiBi biases for all heads (``alibi=`` keyword, Bloom and
  Falcon build them once in the base model's forward) and keep this rank's heads' rows.
- ``key_value_groups``: attention modules that cache ``num_key_value_groups`` (how many query heads share one
  key/value head, which ``repeat_kv`` in ``transformers``' attention functions reads) and the two head-count
  attributes it is the ratio of. After the division it is recomputed from the local counts: Falcon's multi-query
  attention keeps its one shared key/value head whole, so the ratio halves at tp_size=2 (since transformers 5.25,
  Falcon runs the shared attention functions, which read the count cached at construction; before, it split its
  fused projection by its own ``num_heads``).

Choices per family (see docs/huggingface.md): OPT, ViT, T5 are Megatron splits; T5's relative position bias
embedding (one column per head, in the first layer) is split by columns with the heads. Switch Transformers splits
each expert's ``wi``/``wo`` like a dense MLP (every rank runs every expert on the same tokens, so an expert that gets
no token is skipped on all ranks alike); the router sees the whole input and stays whole. Bloom's fused
``query_key_value`` is laid out per head (``[h0: q k v][h1: q k v]...``) and Falcon's new decoder architecture per
key/value group, so a contiguous split gives each rank whole heads (groups). Phi-3's ``[q][k][v]`` and
``[gate][up]`` are split block by block (``FusedColumns``). Falcon's multi-query ``[q heads][k][v]`` keeps the one
shared key/value head on every rank: that projection stays whole, each rank computes its query heads and the shared
head, and its gradient is summed over the ranks.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from lightning_colossal.parallel.huggingface import internals
from lightning_colossal.parallel.huggingface.base_model import base_model
from lightning_colossal.parallel.huggingface.decoders import HuggingFacePlanPolicy
from lightning_colossal.parallel.huggingface.sequence_modes import parallelize_with_sequence
from lightning_colossal.parallel.plan_policy import FusedColumns, PlanPolicy, module_pattern
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext

Style = str | FusedColumns


@dataclass(frozen=True)
class FamilyPlan:
    """How to split one family's base model (see the module docstring); patterns are relative to the base model."""

    tp_plan: dict[str, Style]
    head_attributes: dict[str, tuple[str, ...]]
    head_counts: tuple[str, ...]
    local_config: dict[str, tuple[str, ...]] = field(default_factory=dict)
    per_head_biases: tuple[str, ...] = ()
    key_value_groups: dict[str, tuple[str, str]] = field(default_factory=dict)


def _megatron(attention: str, projections: tuple[str, str, str, str], mlp: dict[str, str]) -> dict[str, Style]:
    """q, k, v column-parallel and the output projection row-parallel under ``attention``, plus the MLP's styles."""
    query, key, value, output = projections
    plan: dict[str, Style] = {f"{attention}.{name}": "colwise" for name in (query, key, value)}
    plan[f"{attention}.{output}"] = "rowwise"
    plan.update(mlp)
    return plan


def _opt(config: Any) -> FamilyPlan:
    layers = "decoder.layers.*"
    # fc1/fc2 sit in the decoder layer itself, so nesting puts its norms in a tensor-parallel region; they run outside
    # it, on the whole residual stream (its shards under split-gather, where split_gather.py sums their gradients).
    # Declared, they need no trace of the first forward (regions.py).
    mlp = {
        f"{layers}.fc1": "colwise",
        f"{layers}.fc2": "rowwise",
        f"{layers}.self_attn_layer_norm": "replicate",
        f"{layers}.final_layer_norm": "replicate",
    }
    return FamilyPlan(
        tp_plan=_megatron(f"{layers}.self_attn", ("q_proj", "k_proj", "v_proj", "out_proj"), mlp),
        head_attributes={f"{layers}.self_attn": ("num_heads", "embed_dim")},
        head_counts=("num_attention_heads",),
    )


def _vit(config: Any) -> FamilyPlan:
    mlp = {"layers.*.mlp.fc1": "colwise", "layers.*.mlp.fc2": "rowwise"}
    return FamilyPlan(
        tp_plan=_megatron("layers.*.attention", ("q_proj", "k_proj", "v_proj", "o_proj"), mlp),
        head_attributes={"layers.*.attention": ("num_attention_heads",)},
        head_counts=("num_attention_heads",),
    )


def _t5(config: Any) -> FamilyPlan:
    """T5 and Switch Transformers: encoder and decoder blocks, self- and cross-attention, dense or expert MLPs."""
    layers = "*.block.*.layer.*"
    plan: dict[str, Style] = {}
    for attention in ("SelfAttention", "EncDecAttention"):
        plan.update(_megatron(f"{layers}.{attention}", ("q", "k", "v", "o"), {}))
    # One column per head: each rank keeps its heads' biases (computed in the first layer, passed to the others).
    plan[f"{layers}.SelfAttention.relative_attention_bias"] = "colwise"
    for mlp in ("DenseReluDense", "mlp", "mlp.experts.*"):  # T5; Switch's dense layers; each Switch expert
        plan.update({f"{layers}.{mlp}.{name}": "colwise" for name in ("wi", "wi_0", "wi_1")})
        plan[f"{layers}.{mlp}.wo"] = "rowwise"
    heads = ("n_heads", "inner_dim")
    return FamilyPlan(
        tp_plan=plan,
        head_attributes={f"{layers}.SelfAttention": heads, f"{layers}.EncDecAttention": heads},
        head_counts=("num_heads",),
    )


def _bloom(config: Any) -> FamilyPlan:
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        raise ValueError(
            "Bloom with slow_but_exact=True and pretraining_tp > 1 slices its output projections' weights itself,"
            " which tensor parallelism has split already: set config.slow_but_exact=False (the same function,"
            " computed at once) or train with tp_size=1."
        )
    return FamilyPlan(
        tp_plan={
            "h.*.self_attention.query_key_value": "colwise",  # [h0: q k v][h1: q k v]...: whole heads per rank
            "h.*.self_attention.dense": "rowwise",
            "h.*.mlp.dense_h_to_4h": "colwise",
            "h.*.mlp.dense_4h_to_h": "rowwise",
        },
        head_attributes={"h.*.self_attention": ("num_heads", "hidden_size", "split_size")},
        head_counts=("num_attention_heads",),
        per_head_biases=("h.*.self_attention",),
    )


def _falcon(config: Any) -> FamilyPlan:
    attention = "h.*.self_attention"
    plan: dict[str, Style] = {
        f"{attention}.dense": "rowwise",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    }
    if config.new_decoder_architecture:
        # [group: q heads of the group, k, v] per key/value group: whole groups per rank.
        plan[f"{attention}.query_key_value"] = "colwise"
        heads, counts = ("num_heads", "num_kv_heads"), ("num_attention_heads", "num_kv_heads")
    elif not config.multi_query:
        # [h0: q k v][h1: q k v]...: whole heads per rank.
        plan[f"{attention}.query_key_value"] = "colwise"
        heads, counts = ("num_heads", "num_kv_heads"), ("num_attention_heads",)
    else:
        # [q heads][k][v] with one key/value head every query head attends with.
        plan[f"{attention}.query_key_value"] = FusedColumns((config.num_attention_heads, 1, 1), (False, True, True))
        heads, counts = ("num_heads",), ("num_attention_heads",)
    return FamilyPlan(
        tp_plan=plan,
        head_attributes={attention: heads},
        head_counts=counts,
        per_head_biases=(attention,) if config.alibi else (),
        key_value_groups={attention: ("num_heads", "num_kv_heads")},
    )


def _phi3(config: Any) -> FamilyPlan:
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return FamilyPlan(
        tp_plan={
            "layers.*.self_attn.qkv_proj": FusedColumns((heads, kv_heads, kv_heads)),
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_up_proj": FusedColumns((1, 1)),
            "layers.*.mlp.down_proj": "rowwise",
        },
        head_attributes={"layers.*.self_attn": ("num_key_value_heads",)},
        head_counts=("num_attention_heads", "num_key_value_heads"),
        local_config={"layers.*.self_attn": ("num_attention_heads", "num_key_value_heads")},
    )


#: ``config.model_type`` -> the family's plan for that config (the config's variant may change it).
FAMILY_PLANS: dict[str, Callable[[Any], FamilyPlan]] = {
    "opt": _opt,
    "vit": _vit,
    "t5": _t5,
    "switch_transformers": _t5,
    "bloom": _bloom,
    "falcon": _falcon,
    "phi3": _phi3,
}


class FamilyPlanPolicy(ModelPolicy):
    """Tensor parallelism for the ``transformers`` families in ``FAMILY_PLANS`` (see the module docstring)."""

    name = "huggingface family plans (" + ", ".join(FAMILY_PLANS) + ")"

    def accepts(self, module: nn.Module) -> bool:
        from transformers import PreTrainedModel

        model_type = getattr(getattr(module, "config", None), "model_type", None)
        return isinstance(module, PreTrainedModel) and model_type in FAMILY_PLANS

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        internals.warn_if_untested()
        return parallelize_with_sequence(model, context, lambda tensor_parallel: self._split(model, tensor_parallel))

    def _split(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        """Tensor parallelism alone (``context`` has no sequence parallelism)."""
        if context.tp_size == 1:
            return ParallelPlan()  # nothing to split, and no config variant to refuse
        config = model.config  # type: ignore[attr-defined]
        family = FAMILY_PLANS[config.model_type](config)
        base, prefix = base_model(model)
        plan_policy = PlanPolicy(
            family.tp_plan,
            prefix=f"{prefix}." if prefix else "",
            heads=tuple((f"config.{name}", int(getattr(config, name))) for name in family.head_counts),
            origin=f"The built-in tensor-parallel plan for '{config.model_type}' models",
            fix=(
                f"Its module names differ from this transformers version's {type(model).__name__}: train it with"
                " tp_size=1, or pass policy={...} with its projections' names."
            ),
        )
        plan = plan_policy.parallelize(model, context)
        _divide_per_rank(base, family.head_attributes, context, _divide_attributes)
        _divide_per_rank(base, family.local_config, context, _divide_local_config)
        for pattern, (query_heads, key_value_heads) in family.key_value_groups.items():
            for module in _matching(base, pattern):
                _recount_key_value_groups(module, query_heads, key_value_heads)
        for pattern in family.per_head_biases:
            for module in _matching(base, pattern):
                module.register_forward_pre_hook(functools.partial(_local_alibi, context), with_kwargs=True)
        return plan

    # Pipelines and activation checkpointing (both need the layer stack): Phi-3's base forward is a Llama's, so the
    # decoders' stages run it; the other families are refused, naming why (``decoders.PIPELINE_REFUSED``). Not
    # activation checkpointing alone for OPT, BLOOM, Falcon: their layers take the KV cache the base model makes in
    # training too, and a recomputed layer would append its keys to it a second time.
    def layers(self, model: nn.Module) -> nn.ModuleList:
        return HuggingFacePlanPolicy().layers(model)

    def stage_module(
        self, model: nn.Module, layer_indices: list[int], first: bool, last: bool, context: ParallelContext
    ) -> nn.Module:
        return HuggingFacePlanPolicy().stage_module(model, layer_indices, first, last, context)

    def prune(self, model: nn.Module, keep_layers: set[int], first: bool, last: bool) -> None:
        HuggingFacePlanPolicy().prune(model, keep_layers, first, last)


def _matching(base: nn.Module, pattern: str) -> list[nn.Module]:
    compiled = module_pattern(pattern)
    return [module for name, module in base.named_modules() if compiled.match(name)]


def _divide_per_rank(
    base: nn.Module,
    attributes_by_pattern: dict[str, tuple[str, ...]],
    context: ParallelContext,
    divide: Callable[[nn.Module, tuple[str, ...], int], None],
) -> None:
    for pattern, attributes in attributes_by_pattern.items():
        modules = _matching(base, pattern)
        if not modules and not pattern.endswith("EncDecAttention"):  # T5 encoders have no cross-attention
            raise ValueError(
                f"No module of {type(base).__name__} matches {pattern!r}, whose head counts a tensor-parallel split"
                " must divide: this transformers version names it otherwise; train with tp_size=1."
            )
        for module in modules:
            divide(module, attributes, context.tp_size)


def _divide_attributes(module: nn.Module, attributes: tuple[str, ...], parts: int) -> None:
    for attribute in attributes:
        setattr(module, attribute, _divided(module, attribute, getattr(module, attribute), parts))


def _divide_local_config(module: nn.Module, attributes: tuple[str, ...], parts: int) -> None:
    # A copy per module: the model's config (saved with checkpoints, read by the base model) keeps whole counts.
    local = copy.copy(module.config)
    for attribute in attributes:
        setattr(local, attribute, _divided(module, f"config.{attribute}", getattr(local, attribute), parts))
    module.config = local


def _recount_key_value_groups(module: nn.Module, query_heads: str, key_value_heads: str) -> None:
    """``num_key_value_groups`` from this rank's head counts, where the attention caches it (see the module
    docstring); a version that does not cache it reads the counts themselves."""
    if not hasattr(module, "num_key_value_groups"):
        return
    queries, keys = int(getattr(module, query_heads)), int(getattr(module, key_value_heads))
    if queries % keys != 0:
        raise ValueError(
            f"{type(module).__name__} holds {queries} query heads and {keys} key/value heads on this tensor-parallel"
            " rank, which do not group evenly: choose a tp_size that divides the key/value heads."
        )
    module.num_key_value_groups = queries // keys


def _divided(module: nn.Module, what: str, count: int, parts: int) -> int:
    if count % parts != 0:
        raise ValueError(
            f"{type(module).__name__}.{what} = {count} does not divide by tp_size = {parts}: choose a tp_size that"
            " divides the attention heads."
        )
    return count // parts


def _local_alibi(
    context: ParallelContext, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Keep this rank's heads of the ALiBi biases the base model built for all heads, before an attention whose
    ``num_heads`` counts this rank's heads: ``alibi`` as ``[batch * heads, 1, keys]`` (Bloom, batch-major) or
    ``[batch, heads, 1, keys]``, and a mask the biases were folded into, ``[batch, heads, queries, keys]`` (Falcon
    under SDPA). A mask without a head dimension (``[batch, 1, queries, keys]``) is left as it is."""
    heads = module.num_heads
    total = heads * context.tp_size
    rows = slice(context.tp_rank * heads, (context.tp_rank + 1) * heads)
    for name in ("alibi", "attention_mask"):
        bias = kwargs.get(name)
        if bias is None:
            continue
        if bias.dim() == 4 and bias.shape[1] == total:
            kwargs[name] = bias[:, rows]
        elif bias.dim() == 3 and name == "alibi":
            per_sequence = bias.reshape(-1, total, *bias.shape[1:])
            kwargs[name] = per_sequence[:, rows].reshape(-1, *bias.shape[1:])
    return args, kwargs
