"""Ulysses and ring sequence parallelism for Hugging Face models, through ``transformers``' attention interface.

[Note: sequence parallelism through the attention interface]
``transformers`` models that declare ``_supports_attention_backend`` (Llama, Mistral, Qwen2/3, Gemma/Gemma2, Phi-3,
Mixtral, Qwen2-MoE, OLMoE, ...) look their attention up by name, ``config._attn_implementation``, in
``AttentionInterface``, and build their masks through ``AttentionMaskInterface`` under the same name. So one function
registered there gives every such family sequence parallelism without a forward of ours; nothing is per family. Each
sp rank holds its slice of every sequence (the strategy splits the batch, ``parallel/batches.split_sequence``), and:

- Ulysses (``sequence_parallel="all_to_all"``, contiguous layout): the registered attention exchanges sequence for
  heads on query, key and value (one all-to-all for the three: every rank then holds ``heads / sp`` heads of the
  whole sequence), runs the model's own attention (``sdpa`` or the family's ``eager``, whatever was configured) on them,
  and exchanges the output back. Its registered mask function builds the model's own mask (causal, sliding window,
  bidirectional, with padding) for the whole sequence: the same builder as the configured attention's, given the
  whole sequence's lengths and the padding mask gathered from the sp ranks.
- Ring (``sequence_parallel="ring"``, zigzag layout): the registered attention calls ``ring_attention``
  (``distributed/ring_attention.py``) with this rank's global positions; no rank ever holds the whole sequence. Its
  mask function describes the model's mask instead of building it (``RingMask``: causal or not, sliding window, the
  local padding), because ring attention computes visibility from positions, block by block.

The swap of ``config._attn_implementation`` is recorded with the other attached techniques (its listing names the
old and new implementation); removing the techniques restores the old name and unregisters both functions.

Around the attention, two pre-hooks (``parallel/attached.py`` [Note: techniques attach as hooks]):

- on the module that embeds the tokens (the base model, or the stack inside it a causal LM calls directly: OPT's
  decoder): no KV cache; ``position_ids`` are this rank's global positions (rotary embeddings, learned position
  embeddings), supplied when the caller passes none, and numbered over the whole sequence's real tokens for the
  families that number them from the padding mask (``POSITIONS_FROM_PADDING``). Packed sequences (positions that
  restart inside a sequence without an attention mask) and prepared 4-D masks are refused: ``transformers`` would
  build or read them over this rank's slice only. Under ring attention a call without a padding mask gets one with
  every token real ([Note: ring attention is always given a padding mask]).
- on a causal LM given ``labels``: the loss. ``ForCausalLMLoss`` shifts labels inside the model, which on a slice
  pairs the slice's last token with nothing (and the next slice's first label with no token). The hook gathers the
  labels over the sp ranks, shifts them once for the whole sequence and passes this rank's slice as
  ``shift_labels`` (which ``ForCausalLMLoss`` takes instead of shifting), so every token is paired as in one
  process. The loss normalisation: gradients are averaged over dp x sp (``parallel/groups.py`` [Note: the
  gradient-reduction axis]), so each rank's loss must be its share of the whole sequence's mean: its tokens' summed
  loss divided by ``count / sp``, where ``count`` is the number of labelled tokens of the whole sequences (passed as
  ``num_items_in_batch``; a caller's own ``num_items_in_batch`` is divided by sp). The mean of the ranks' losses is
  then exactly the one-process loss, however the padding falls between the slices; a per-rank token mean would
  weight a rank holding mostly padding as much as one holding none. A loss computed outside the model, on the logits,
  must use targets shifted before the split (a dataset's ``(inputs, targets)`` pairs are).

Not supported, and refused naming why: KV caches (``use_cache``), ``output_router_logits`` (a mixture of experts'
load-balancing loss is not a sum over tokens, so per-slice terms do not add up to it), task heads other than a causal
LM's (a sequence-classification head pools one token per sequence, which one slice holds), attention sinks
(``s_aux``), attention implementations other than ``sdpa`` and ``eager``, and under Ulysses query head counts (after
tensor parallelism) that sp_size does not divide (ring attention never splits heads). Key/value heads sp_size does not
divide are replicated instead ([Note: replicated key/value heads under Ulysses]).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_colossal.config import AllToAll, Ring, SequenceParallelism
from lightning_colossal.distributed import collectives, differentiable
from lightning_colossal.parallel.huggingface import internals
from lightning_colossal.parallel.huggingface.base_model import arguments_by_name, base_model, without_cache
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.sequence_layout import sequence_positions, shard_sequence, unshard_sequence
from lightning_colossal.parallel.tensor_parallel import ParallelContext

#: Attention implementations a sequence-parallel attention can run on the exchanged heads (Ulysses) or describe
#: (ring): ``sdpa`` and each family's own ``eager``. Flash and flex attention take other mask formats.
INNER_IMPLEMENTATIONS = ("sdpa", "eager")
IGNORE_INDEX = -100
#: ``config.model_type`` of the families whose base forward numbers only the real tokens when given no position_ids
#: (positions from the padding mask's running count, OPT's learned positions), not ``0 .. length - 1``.
POSITIONS_FROM_PADDING = ("opt", "biogpt")

_names = itertools.count()


@dataclass(frozen=True)
class AttentionSequenceParallel:
    """What one model's attention-interface sequence parallelism runs: the mode (the config's object, of a type in
    ``ATTENTION_MODES``: ``AllToAll`` or ``Ring``, which owns its token layout) and the context holding the sp group."""

    mode: SequenceParallelism
    context: ParallelContext

    @property
    def layout(self) -> str:
        """Which tokens this rank holds (``parallel/sequence_layout.py``): the mode's own layout."""
        return self.mode.layout

    @property
    def size(self) -> int:
        return self.context.sp_size

    @property
    def rank(self) -> int:
        return self.context.sp_rank

    def positions(self, local_length: int) -> Tensor:
        """Global positions of this rank's ``local_length`` tokens."""
        return sequence_positions(local_length * self.size, self.size, self.rank, self.layout)


@dataclass(frozen=True)
class RingMask:
    """What ring attention needs to know of a mask ``transformers`` asked for (see the module docstring)."""

    causal: bool
    sliding_window: int | None
    padding: Tensor | None  # bool [batch, local_length], True for a real token; None: no padding


def uses_attention_interface(model: nn.Module) -> bool:
    """Whether ``model``'s attention goes through ``transformers``' ``AttentionInterface`` (its class says so)."""
    return bool(getattr(type(model), "_supports_attention_backend", False))


def attach_attention_sequence_parallel(model: nn.Module, context: ParallelContext, plan: ParallelPlan) -> None:
    """Install ``context.sequence``'s attention (Ulysses or ring) on a ``transformers`` model (see the module
    docstring); the hooks and the attention swap go into ``plan.attached``. Refuses, naming the fix, what it cannot
    run exactly."""
    mode = context.sequence
    attention_mode = ATTENTION_MODES.get(type(mode))
    if mode is None or attention_mode is None:
        raise TypeError(f"sequence parallelism {mode!r} does not run through the attention interface.")
    parallelism = AttentionSequenceParallel(mode, context)
    config: Any = model.config  # type: ignore[attr-defined]
    model_type = getattr(config, "model_type", type(model).__name__)
    _check_model(model, model_type)
    inner = config._attn_implementation or "eager"
    if inner not in INNER_IMPLEMENTATIONS:
        raise ValueError(
            f"Sequence parallelism runs this '{model_type}' model's attention as 'sdpa' or 'eager' on its exchanged"
            f" heads or ring blocks, but the model was loaded with attn_implementation={inner!r}: load it with"
            " attn_implementation='sdpa' (or 'eager'), or drop sp_size."
        )
    if attention_mode.check is not None:
        attention_mode.check(config, context, model_type)
    name = f"lightning_colossal_{attention_mode.registered_as}_{next(_names)}"
    attention, mask = attention_mode.functions(parallelism, inner)
    internals.register_attention(name, attention, mask, f"Sequence parallelism ({mode.name})")
    # Every config the modules read: a family plan gives attention modules their own copy (families.py local_config).
    configs = {id(config): config}
    for module in model.modules():
        module_config = module.__dict__.get("config")
        if module_config is not None and hasattr(module_config, "_attn_implementation"):
            configs[id(module_config)] = module_config
    for each in configs.values():
        each._attn_implementation = name

    def restore() -> None:
        for each in configs.values():
            each._attn_implementation = inner
        internals.unregister_attention(name)

    plan.attached.changed(
        model, f"{mode.name}: config._attn_implementation {inner!r} -> {name!r} (restored on removal)", restore
    )
    base, _ = base_model(model)
    plan.attached.before_forward(
        _embedding_owner(base),
        f"{mode.name}: global positions, no KV cache",
        functools.partial(_base_inputs, parallelism),
    )
    if base is not model:
        plan.attached.before_forward(
            model,
            f"{mode.name}: labels shifted over the whole sequence",
            functools.partial(_labels, parallelism),
        )


def without_attention_interface(what: str) -> ValueError:
    """The refusal of sp_size > 1 for a model whose attention does not go through the attention interface."""
    return ValueError(
        f"{what} computes attention in its own forward, not through transformers' AttentionInterface (its class"
        " does not declare _supports_attention_backend), so sequence parallelism (sp_size > 1) has no attention to"
        " replace: drop sp_size, or use a family that goes through the interface (Llama, Mistral, Qwen2/3, Gemma,"
        " Phi-3, Mixtral, ...)."
    )


def _embedding_owner(base: nn.Module) -> nn.Module:
    """The module whose forward embeds the tokens (and takes the positions and the cache): the base model itself,
    or the stack inside it that a causal LM calls directly (OPT's ``model.decoder``)."""
    embedding = base.get_input_embeddings() if hasattr(base, "get_input_embeddings") else None
    for module in base.modules():
        if embedding is not None and any(child is embedding for child in module.children()):
            return module
    return base


def refuse_pipeline_stages(context: ParallelContext) -> None:
    """Pipeline stages of Hugging Face models run their layers without the base model's forward, so without the
    positions hook and the whole-sequence masks: refused under sp."""
    if context.sp_size > 1:
        raise ValueError(
            "Pipeline stages of Hugging Face models build their own positions and masks for whole sequences, so"
            " they do not run Ulysses or ring sequence parallelism: use pp_size=1 with sp_size > 1."
        )


# ------------------------------------------------------------------------------------------------ checks


def _check_model(model: nn.Module, model_type: str) -> None:
    if not uses_attention_interface(model):
        raise without_attention_interface(f"This '{model_type}' model")
    if getattr(model, "main_input_name", "input_ids") != "input_ids":
        raise ValueError(
            f"Sequence parallelism splits token sequences (dim 1 of every batch tensor), but this '{model_type}' model"
            f" reads {model.main_input_name!r}: drop sp_size for it."
        )
    base, _ = base_model(model)
    # The loss the model computes from ``labels`` (``PreTrainedModel.loss_function``; causal LMs' by default).
    causal_lm_loss = internals.causal_lm_loss("Sequence parallelism's loss over the whole sequence")
    if base is not model and getattr(model, "loss_function", None) is not causal_lm_loss:
        raise ValueError(
            f"Sequence parallelism gives each sp rank a slice of every sequence; {type(model).__name__} is not a causal"
            " LM (its head may pool one token per sequence, which only one slice holds): parallelise its base model"
            f" ({type(base).__name__}) or a *ForCausalLM model, or drop sp_size."
        )


def _check_heads(config: Any, context: ParallelContext, model_type: str) -> None:
    """Ulysses splits the query heads over the sp ranks; key/value heads are replicated where they do not split
    ([Note: replicated key/value heads under Ulysses])."""
    heads = int(config.num_attention_heads)
    local = heads // context.tp_size
    if local % context.sp_size != 0:
        raise ValueError(
            f"Ulysses gives each of sp_size={context.sp_size} ranks an equal share of the attention heads, but this"
            f" '{model_type}' model has config.num_attention_heads = {heads} ({local} per tensor-parallel rank at"
            f" tp_size={context.tp_size}), which sp_size does not divide: choose tp_size * sp_size dividing {heads},"
            " or use sequence_parallel='ring', which never splits heads."
        )


# ------------------------------------------------------------------------------------------------ registration
def _inner_attention(inner: str, module: nn.Module) -> Callable[..., Any]:
    """The attention the model was configured with: ``sdpa``, or the family's own ``eager_attention_forward``."""
    if inner == "sdpa":
        return internals.sdpa_attention("Ulysses sequence parallelism")
    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)
    if eager is None:
        raise ValueError(
            f"{type(module).__name__}'s module defines no eager_attention_forward for Ulysses to run on the exchanged"
            " heads: load the model with attn_implementation='sdpa'."
        )
    return eager


# ------------------------------------------------------------------------------------------------ Ulysses
def _ulysses_attention(
    parallelism: AttentionSequenceParallel,
    inner: str,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Sequence shards to head shards, the model's own attention over the whole sequence, and back."""
    _refuse_sinks(module, kwargs)
    group = parallelism.context.sp_group
    replicas = _key_value_replicas(key.shape[1], parallelism.size)
    if replicas > 1:
        key, value = key.repeat_interleave(replicas, dim=1), value.repeat_interleave(replicas, dim=1)
    query, key, value = _to_head_shards(query, key, value, parallelism.size, group)
    kwargs.pop("position_ids", None)  # this rank's slice; sdpa and eager read positions from the mask
    with _query_heads_per_key_head(module, query.shape[1] // key.shape[1], replicas > 1):
        output, _ = _inner_attention(inner, module)(module, query, key, value, attention_mask, **kwargs)
    # [batch, whole, heads / sp, dim] -> [batch, local, heads, dim]: scatter the sequence, gather heads.
    return differentiable.all_to_all(output, 1, 2, group), None


def _to_head_shards(query: Tensor, key: Tensor, value: Tensor, sp_size: int, group: Any) -> tuple[Tensor, ...]:
    """``[batch, heads, local, dim]`` -> ``[batch, heads / sp, whole, dim]`` for query, key and value in one
    all-to-all: each rank's piece is its query heads, then its key heads, then its value heads."""
    batch, _, length, dim = query.shape
    pieces = [tensor.reshape(batch, sp_size, -1, length, dim) for tensor in (query, key, value)]
    counts = [piece.shape[2] for piece in pieces]
    fused = torch.cat(pieces, dim=2).flatten(1, 2)  # rank r's heads at r * sum(counts) ...
    exchanged = differentiable.all_to_all(fused, 1, 2, group)  # scatter heads, gather the sequence
    return exchanged.split(counts, dim=1)


def _key_value_replicas(kv_heads: int, sp_size: int) -> int:
    """How many copies of each key/value head Ulysses sends, so that sp_size divides them.

    [Note: replicated key/value heads under Ulysses]
    With fewer key/value heads than sp ranks (or a count sp does not divide), each head is repeated ``r = sp /
    gcd(kv_heads, sp)`` times before the exchange (ColossalAI's choice too): ``lcm(kv_heads, sp)`` heads, so each rank
    receives whole heads. Every rank's query heads (``heads / sp`` consecutive ones, ``sp`` dividing ``heads``) fall
    into the groups of the heads it receives, because ``lcm(kv_heads, sp)`` divides ``heads``; backward sums the
    copies' gradients into the one head. The price is ``r`` times the key/value bytes in the exchange.
    """
    return sp_size // math.gcd(kv_heads, sp_size)


@contextmanager
def _query_heads_per_key_head(module: nn.Module, groups: int, replicated: bool) -> Iterator[None]:
    """With replicated key/value heads the attention's own ``num_key_value_groups`` (which ``repeat_kv`` reads)
    counts the original heads; for the call it must say how many query heads share each received head."""
    if not replicated or not hasattr(module, "num_key_value_groups"):
        yield
        return
    original = module.num_key_value_groups
    module.num_key_value_groups = groups
    try:
        yield
    finally:
        module.num_key_value_groups = original


def _ulysses_mask(
    parallelism: AttentionSequenceParallel,
    inner: str,
    *,
    batch_size: int,
    q_length: int,
    kv_length: int,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The configured attention's own mask for the whole sequence (attention sees all of it after the exchange)."""
    kwargs.pop("q_offset", None), kwargs.pop("kv_offset", None)  # no cache: both 0
    padding = None if attention_mask is None else _gather_tokens(attention_mask, parallelism)
    return internals.mask_builder(inner, "Ulysses sequence parallelism")(
        batch_size=batch_size,
        q_length=q_length * parallelism.size,
        kv_length=kv_length * parallelism.size,
        attention_mask=padding,
        **kwargs,
    )


# ------------------------------------------------------------------------------------------------ ring
def _ring_attention(
    parallelism: AttentionSequenceParallel,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """Ring attention over this rank's zigzag slice; returns ``[batch, local, heads, dim]`` as the interface's."""
    from lightning_colossal.distributed.ring_attention import ring_attention

    _refuse_sinks(module, kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "Ring attention has no logit soft-capping (Gemma2's attn_logit_softcapping): set"
            " config.attn_logit_softcapping=None, or use sequence_parallel='all_to_all'."
        )
    if dropout:
        raise ValueError(
            f"Ring attention has no attention dropout, but this model's attention asks for {dropout}: set the config's"
            " attention_dropout to 0.0, or use sequence_parallel='all_to_all'."
        )
    if attention_mask is not None and not isinstance(attention_mask, RingMask):
        raise ValueError(
            "Ring attention received a prepared attention mask (a 4-D mask passed to the model): pass a 2-D padding"
            " mask [batch, sequence] (or none), from which ring attention computes visibility block by block."
        )
    mask = attention_mask or RingMask(
        causal=bool(getattr(module, "is_causal", True)), sliding_window=None, padding=None
    )
    positions = parallelism.positions(query.shape[2]).to(query.device)
    output = ring_attention(
        query,
        key,
        value,
        parallelism.context.sp_group,
        query_positions=positions,
        key_positions=positions,
        causal=mask.causal,
        sliding_window=mask.sliding_window,
        key_padding=mask.padding,
        scale=scaling,
    )
    return output.transpose(1, 2).contiguous(), None


def _ring_mask(
    parallelism: AttentionSequenceParallel,
    *,
    mask_function: Callable[..., Any],
    attention_mask: Tensor | None = None,
    local_size: int | None = None,
    device: Any = "cpu",
    **kwargs: Any,
) -> RingMask:
    """Describe the mask ``transformers`` asks for: which of causal, sliding-window causal or bidirectional it is,
    read off ``mask_function`` at probe pairs of positions, and this rank's padding."""
    queries, keys = _probe_pairs(local_size, device)
    asked = _evaluate(mask_function, queries, keys)
    causal = queries >= keys
    candidates: list[tuple[bool, int | None, Tensor]] = [(True, None, causal), (False, None, torch.ones_like(causal))]
    if local_size is not None:
        candidates.append((True, local_size, causal & (queries - keys < local_size)))
    for is_causal, window, pattern in candidates:
        if asked is not None and torch.equal(asked, pattern):
            return RingMask(causal=is_causal, sliding_window=window, padding=_padding(attention_mask))
    raise ValueError(
        "Ring attention computes causal, sliding-window causal and bidirectional attention from positions; this model"
        " asks for another mask pattern (chunked attention, packed sequences, an image-token overlay): use"
        " sequence_parallel='all_to_all', or drop sp_size."
    )


def _probe_pairs(window: int | None, device: Any) -> tuple[Tensor, Tensor]:
    """(query, key) positions that tell the three patterns apart: every pair of the first 8 positions (causal or
    not), and pairs just inside and just outside the window (sliding or not). A few dozen pairs, whatever the
    sequence length."""
    first = torch.arange(8, device=device)
    queries, keys = [first.repeat_interleave(8)], [first.repeat(8)]
    if window is not None:
        starts = torch.arange(4, device=device)
        for distance in (window - 1, window):
            queries.append(starts + distance)
            keys.append(starts)
    return torch.cat(queries), torch.cat(keys)


def _evaluate(mask_function: Callable[..., Any], queries: Tensor, keys: Tensor) -> Tensor | None:
    """``mask_function`` at each (query, key) pair (transformers' index-based mask functions take index tensors);
    ``None`` when it cannot be evaluated there (a function over a tensor of this rank's tokens only)."""
    try:
        zero = torch.zeros((), dtype=torch.long, device=queries.device)
        result = mask_function(zero, zero, queries, keys)
    except (IndexError, RuntimeError, TypeError):
        return None
    return torch.as_tensor(result, device=queries.device).to(torch.bool).expand(queries.shape)


# ------------------------------------------------------------------------------------------------ hooks
def _base_inputs(
    parallelism: AttentionSequenceParallel, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
):
    """Before the base model: no cache, this rank's global positions, no packed sequences."""
    arguments = without_cache(module, args, kwargs, "Sequence parallelism (sp_size > 1)")
    tokens = arguments.get("input_ids")
    if tokens is None:
        tokens = arguments.get("inputs_embeds")
    if tokens is None:
        return (), arguments
    position_ids = arguments.get("position_ids")
    padding = arguments.get("attention_mask")
    if isinstance(padding, Tensor) and padding.dim() != 2:
        raise ValueError(
            f"Sequence parallelism builds the attention mask of the whole sequence from a 2-D padding mask, but this"
            f" attention_mask has shape {tuple(padding.shape)} (a prepared mask over this rank's slice only): pass the"
            " 2-D [batch, sequence] padding mask (1 for real tokens), or none."
        )
    numbers_real_tokens = getattr(getattr(module, "config", None), "model_type", None) in POSITIONS_FROM_PADDING
    if position_ids is None and padding is not None and numbers_real_tokens:
        # The family numbers real tokens only (the padding mask's running count), over the whole sequence.
        whole = _gather_tokens(padding.long(), parallelism)
        numbered = whole.cumsum(dim=1) * whole - 1
        arguments["position_ids"] = shard_sequence(numbered, 1, parallelism.size, parallelism.rank, parallelism.layout)
    elif position_ids is None:
        arguments["position_ids"] = parallelism.positions(tokens.shape[1]).to(tokens.device).unsqueeze(0)
    elif arguments.get("attention_mask") is None:
        _refuse_packed(position_ids.expand(tokens.shape[0], -1), parallelism)
    if parallelism.layout == "zigzag" and arguments.get("attention_mask") is None:
        arguments["attention_mask"] = _no_padding(tokens.shape[:2], tokens.device)
    return (), arguments


#: The all-real-token masks ``_no_padding`` made, by id, while they live: ``_ring_mask`` reads them as no padding.
_NO_PADDING: weakref.WeakValueDictionary[int, Tensor] = weakref.WeakValueDictionary()


def _no_padding(shape: torch.Size, device: torch.device) -> Tensor:
    """A padding mask with every token real, for a ring-attention call given none.

    [Note: ring attention is always given a padding mask]
    With no ``attention_mask``, ``transformers`` reads ``position_ids`` for packed sequences (a position that does not
    follow its neighbour starts a new sequence, ``masking_utils.find_packed_sequence_indices``), and a zigzag slice's
    global positions jump where its two chunks meet: the mask it would ask for is the packed-sequence one, which ring
    attention refuses. Given a 2-D mask, it never looks. The mask is bool on the tokens' device, which
    ``transformers`` keeps as it is (its ``.to`` returns the same tensor), so ``_ring_mask`` recognises it and gives
    ring attention no padding to gather or apply; were a release to copy it, the mask would still be all real tokens,
    only slower.
    """
    mask = torch.ones(shape, dtype=torch.bool, device=device)
    _NO_PADDING[id(mask)] = mask
    return mask


def _padding(attention_mask: Tensor | None) -> Tensor | None:
    """Ring attention's key padding from the mask ``transformers`` passed on; ``None`` for no padding."""
    if attention_mask is None or _NO_PADDING.get(id(attention_mask)) is attention_mask:
        return None
    return attention_mask.to(torch.bool)


def _labels(parallelism: AttentionSequenceParallel, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]):
    """Before a causal LM given labels: labels shifted over the whole sequence, the loss normalised over it."""
    arguments = arguments_by_name(module, args, kwargs)
    labels = arguments.get("labels")
    if labels is None:
        return (), arguments
    router_logits = arguments.get("output_router_logits")
    if router_logits is None:
        router_logits = getattr(getattr(module, "config", None), "output_router_logits", False)
    if router_logits:
        raise ValueError(
            "output_router_logits=True adds a mixture of experts' load-balancing loss, which is not a sum over tokens:"
            " under sequence parallelism each rank sees only its slice's routing, and the slices' terms do not add up"
            " to the whole sequence's. Set output_router_logits=False (config or call), or drop sp_size."
        )
    if arguments.get("shift_labels") is None:
        whole = _gather_tokens(labels, parallelism)
        shifted = torch.nn.functional.pad(whole[:, 1:], (0, 1), value=IGNORE_INDEX)
        local = shard_sequence(shifted, 1, parallelism.size, parallelism.rank, parallelism.layout)
        arguments["shift_labels"] = local.contiguous()  # the loss flattens it with ``view``
        count = (shifted != IGNORE_INDEX).sum()
    else:
        local = arguments["shift_labels"]
        count = collectives.all_reduce((local != IGNORE_INDEX).sum(), group=parallelism.context.sp_group)
    given = arguments.get("num_items_in_batch")
    # [Note: sequence parallelism through the attention interface]: the ranks' mean is the whole sequence's mean.
    arguments["num_items_in_batch"] = (count if given is None else given) / parallelism.size
    return (), arguments


def _gather_tokens(tensor: Tensor, parallelism: AttentionSequenceParallel) -> Tensor:
    """The whole sequences of a ``[batch, local, ...]`` tensor, in natural token order (not differentiable)."""
    dtype = tensor.dtype
    # gloo has no bool all-gather
    moved = tensor.to(torch.uint8) if dtype == torch.bool else tensor
    gathered = collectives.gather_along(moved.contiguous(), 1, parallelism.context.sp_group)
    whole = unshard_sequence(gathered, 1, parallelism.size, parallelism.layout)
    return whole.to(dtype)


def _refuse_packed(position_ids: Tensor, parallelism: AttentionSequenceParallel) -> None:
    whole = _gather_tokens(position_ids, parallelism)
    if bool((whole[:, 1:] - whole[:, :-1] != 1).any()):
        raise ValueError(
            "These position_ids restart inside a sequence (packed sequences) and no attention_mask is given:"
            " transformers would build the packed-sequence mask from positions, but each sequence-parallel rank holds"
            " only a slice of them. Pass an attention_mask, unpack the sequences, or drop sp_size."
        )


def _refuse_sinks(module: nn.Module, kwargs: dict[str, Any]) -> None:
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError(
            f"{type(module).__name__} has attention sinks (s_aux), which sequence parallelism does not carry: drop"
            " sp_size for this model."
        )


# ------------------------------------------------------------------------------------------------ the modes
def _ulysses_functions(parallelism: AttentionSequenceParallel, inner: str) -> tuple[Callable[..., Any], ...]:
    return functools.partial(_ulysses_attention, parallelism, inner), functools.partial(
        _ulysses_mask, parallelism, inner
    )


def _ring_functions(parallelism: AttentionSequenceParallel, inner: str) -> tuple[Callable[..., Any], ...]:
    return functools.partial(_ring_attention, parallelism), functools.partial(_ring_mask, parallelism)


@dataclass(frozen=True)
class AttentionMode:
    """How one mode runs through the attention interface.

    Args:
        registered_as: the stem of the registered implementation's name (``lightning_colossal_ulysses_0``, as
            ``docs/hybrid.md`` shows it): the algorithm's name, which users see in ``config._attn_implementation``.
        functions: the attention and mask functions to register, given the mode and the configured attention.
        check: what the mode refuses of a model's config before anything is registered, or ``None``.
    """

    registered_as: str
    functions: Callable[[AttentionSequenceParallel, str], tuple[Callable[..., Any], ...]]
    check: Callable[[Any, ParallelContext, str], None] | None = None


#: The modes that run through the attention interface, by type (``context.sequence``).
ATTENTION_MODES: dict[type, AttentionMode] = {
    AllToAll: AttentionMode("ulysses", _ulysses_functions, _check_heads),
    Ring: AttentionMode("ring", _ring_functions),
}
