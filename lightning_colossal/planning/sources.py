"""Where a ``ModelShape`` comes from: the demo GPT, a Hugging Face config, or a parameter count and layer shape.

Hugging Face models are built on the meta device (no memory, no initialisation cost), so a 70B config plans in
seconds. The demo GPT's layout is restated here, since the library never imports the demo (a workload built on the
library, docs/architecture.md section 1); ``tests/unit/test_plan.py`` checks it against the real ``GPT``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_colossal.planning.model_shape import Architecture, ModelShape, ParameterShape, describe_module

__all__ = [
    "DEFAULT_VOCAB",
    "DemoOverrides",
    "LayerShape",
    "demo_model",
    "huggingface_model",
    "parameter_count_model",
]

# Llama's head width; used to choose a head count when only the width is given.
DEFAULT_HEAD_DIM = 128
DEFAULT_VOCAB = 32_000


@dataclass(frozen=True)
class DemoOverrides:
    """Changes to the demo GPT's default ``GPTConfig``; ``None`` keeps the default."""

    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    vocab: int | None = None
    block_size: int | None = None


@dataclass(frozen=True)
class _DemoConfig:
    """The demo GPT's ``GPTConfig`` defaults (``lightning_colossal/demo/model.py``), restated because the library
    never imports the demo (docs/architecture.md, section 1); ``tests/unit/test_plan.py`` checks both against the
    real ``GPTConfig`` and ``GPT``."""

    vocab_size: int = 256
    block_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    embed_dim: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True


def _demo_config(overrides: DemoOverrides) -> _DemoConfig:
    changes = {
        "num_layers": overrides.layers,
        "embed_dim": overrides.hidden,
        "num_heads": overrides.heads,
        "vocab_size": overrides.vocab,
        "block_size": overrides.block_size,
    }
    config = _DemoConfig(**{key: value for key, value in changes.items() if value is not None})
    flags = {"num_layers": "--layers", "embed_dim": "--hidden", "num_heads": "--heads", "vocab_size": "--vocab"}
    for field, flag in {**flags, "block_size": "--block-size"}.items():
        if getattr(config, field) < 1:
            raise ValueError(f"{flag} {getattr(config, field)}: pass a positive integer.")
    if config.embed_dim % config.num_heads != 0:
        raise ValueError(
            f"--heads {config.num_heads} does not divide the demo GPT's embed_dim {config.embed_dim}: pass --heads"
            f" dividing --hidden, or --hidden a multiple of {config.num_heads}."
        )
    return config


def _demo_parameters(config: _DemoConfig) -> list[ParameterShape]:
    """The demo GPT's trainable parameters in registration order (its submodule names are a contract, see the
    module docstring of ``demo/model.py``); the tied head shares the token embedding, which is vocabulary-parallel."""
    hidden, width = config.embed_dim, config.mlp_ratio * config.embed_dim
    parameters = [
        ParameterShape("token_embedding.weight", (config.vocab_size, hidden), None, True),
        ParameterShape("position_embedding.weight", (config.block_size, hidden), None, False),
    ]
    linears = (("attn.qkv", 3 * hidden, hidden), ("attn.proj", hidden, hidden), ("mlp.fc", width, hidden))
    linears += (("mlp.proj", hidden, width),)
    for layer in range(config.num_layers):
        prefix = f"blocks.{layer}."
        for norm, modules in (("attn_norm", linears[:2]), ("mlp_norm", linears[2:])):
            parameters.append(ParameterShape(f"{prefix}{norm}.weight", (hidden,), layer, False))
            if config.bias:
                parameters.append(ParameterShape(f"{prefix}{norm}.bias", (hidden,), layer, False))
            for name, rows, columns in modules:
                parameters.append(ParameterShape(f"{prefix}{name}.weight", (rows, columns), layer, True))
                if config.bias:
                    parameters.append(ParameterShape(f"{prefix}{name}.bias", (rows,), layer, False))
    parameters.append(ParameterShape("final_norm.weight", (hidden,), None, False))
    if config.bias:
        parameters.append(ParameterShape("final_norm.bias", (hidden,), None, False))
    if not config.tie_weights:
        parameters.append(ParameterShape("lm_head.weight", (config.vocab_size, hidden), None, True))
    return parameters


def demo_model(overrides: DemoOverrides = DemoOverrides()) -> ModelShape:
    """The demo GPT (``lightning_colossal/demo/model.py``) with its default config and ``overrides``."""
    config = _demo_config(overrides)
    architecture = Architecture(
        layers=config.num_layers,
        hidden=config.embed_dim,
        heads=config.num_heads,
        kv_heads=config.num_heads,
        intermediate=config.mlp_ratio * config.embed_dim,
        vocab=config.vocab_size,
        gated_mlp=False,
        norm="layernorm",
        attention="sdpa",
        dropout=config.dropout,
        attention_input_matmuls=1,  # the fused, head-major qkv
        mlp_input_matmuls=1,
        activation_saves=1,
        max_sequence=config.block_size,
        tensor_parallel_policy="the demo GPT's own (GPT.parallel_policy)",
        vocab_parallel=True,
    )
    description = (
        f"demo GPT (num_layers={config.num_layers}, embed_dim={config.embed_dim}, num_heads={config.num_heads},"
        f" vocab_size={config.vocab_size}, block_size={config.block_size})"
    )
    return ModelShape(description, tuple(_demo_parameters(config)), architecture, source="demo")


def _load_huggingface_config(path: str) -> Any:
    location = Path(path)
    if not location.exists():
        raise ValueError(
            f"--model {path!r} does not exist: pass 'demo', a config.json file, or a directory holding one (e.g. a"
            " downloaded checkpoint); the planner reads local files only."
        )
    if location.is_dir() and not (location / "config.json").is_file():
        raise ValueError(f"--model {path!r} is a directory without config.json: point at the file or its directory.")
    try:
        import transformers
    except ImportError as error:
        raise ValueError("--model with a Hugging Face config needs transformers: pip install transformers") from error
    file = location / "config.json" if location.is_dir() else location
    try:
        model_type = json.loads(file.read_text()).get("model_type")
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--model {path!r}: {file} is not readable JSON ({error}); pass a config.json.") from error
    if not model_type:
        raise ValueError(f"--model {path!r}: {file} names no model_type; pass a Hugging Face config.json.")
    return transformers.AutoConfig.from_pretrained(str(location))


def _build_on_meta(config: Any) -> Any:
    """``AutoModelForCausalLM`` for causal configs (the head is part of the training memory), else ``AutoModel``."""
    import torch
    import transformers

    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:  # not a causal-LM config (an encoder, a vision model): the bare model
            return transformers.AutoModel.from_config(config)


# Hugging Face activation modules written as several Python ops, with the tensors of the MLP width each saves.
_PYTHON_ACTIVATIONS = {"NewGELUActivation": 4}


def _huggingface_layout(model: Any) -> dict[str, Any]:
    """What the parameter names and module classes say: gated MLP, separate projections, norm and activation."""
    names = [name for name, _ in model.named_parameters()]
    module_classes = {type(module).__name__ for module in model.modules()}
    gated = any(".gate" in name or "gate_" in name for name in names)
    separate_qkv = any(name.endswith(("q_proj.weight", ".query.weight")) for name in names)
    fused_gate_up = any("gate_up_proj" in name for name in names)
    python_activations = [_PYTHON_ACTIVATIONS[name] for name in module_classes if name in _PYTHON_ACTIVATIONS]
    return {
        "gated_mlp": gated,
        "norm": "rmsnorm" if any("RMSNorm" in name for name in module_classes) else "layernorm",
        "attention_input_matmuls": 3 if separate_qkv else 1,
        "mlp_input_matmuls": 2 if gated and not fused_gate_up else 1,
        "activation_saves": max(python_activations, default=1),
    }


def _huggingface_architecture(config: Any, model: Any) -> Architecture:
    hidden = config.hidden_size
    heads = config.num_attention_heads
    dropout_names = ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout_prob")
    dropouts = [getattr(config, name, 0.0) for name in (*dropout_names, "attention_probs_dropout_prob")]
    implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    policy = None
    if config.model_type in ("gpt2", "bert"):
        policy = f"built-in {config.model_type}"
    elif getattr(config, "base_model_tp_plan", None):
        policy = "config.base_model_tp_plan"
    return Architecture(
        layers=config.num_hidden_layers,
        hidden=hidden,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate=getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden,
        vocab=config.vocab_size,
        attention="eager" if implementation == "eager" else "sdpa",
        dropout=max(float(value) for value in dropouts if isinstance(value, int | float)),
        max_sequence=getattr(config, "max_position_embeddings", None),
        tensor_parallel_policy=policy,
        vocab_parallel=False,  # the Hugging Face policies split the blocks only; embeddings and heads stay whole
        experts=_routed_experts(config),
        experts_per_token=int(getattr(config, "num_experts_per_tok", None) or 0),
        **_huggingface_layout(model),
    )


def _routed_experts(config: Any) -> int:
    """Routed experts per MoE layer, under whichever name the family's config uses (0 for a dense model)."""
    for attribute in ("n_routed_experts", "num_local_experts", "num_experts"):
        value = getattr(config, attribute, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def huggingface_model(path: str) -> ModelShape:
    """A Hugging Face model from its ``config.json`` (a file or a directory), built on the meta device."""
    config = _load_huggingface_config(path)
    for attribute in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if getattr(config, attribute, None) is None:
            raise ValueError(
                f"--model {path!r}: the {config.model_type} config has no {attribute}, so it is not a transformer"
                " the planner can estimate; pass --parameters, --layers and --hidden instead."
            )
    model = _build_on_meta(config)
    architecture = _huggingface_architecture(config, model)
    description = f"{type(model).__name__} from {path} (model_type={config.model_type})"
    return describe_module(model, description, architecture, source="huggingface")


@dataclass(frozen=True)
class LayerShape:
    """A transformer given by its size: ``parameters`` total, laid out Llama-style (see ``parameter_count_model``)."""

    parameters: int
    layers: int
    hidden: int
    vocab: int = DEFAULT_VOCAB
    heads: int | None = None
    kv_heads: int | None = None
    tie_embeddings: bool = False


def _heads_of(shape: LayerShape) -> tuple[int, int]:
    heads = shape.heads
    if heads is None:
        if shape.hidden % DEFAULT_HEAD_DIM != 0:
            raise ValueError(
                f"--hidden {shape.hidden} is not a multiple of {DEFAULT_HEAD_DIM}, so the head count cannot be"
                " guessed: pass --heads."
            )
        heads = shape.hidden // DEFAULT_HEAD_DIM
    if shape.hidden % heads != 0:
        raise ValueError(f"--heads {heads} does not divide --hidden {shape.hidden}: pass a divisor of the width.")
    kv_heads = shape.kv_heads or heads
    if heads % kv_heads != 0:
        raise ValueError(f"--kv-heads {kv_heads} does not divide --heads {heads}: pass a divisor of the head count.")
    return heads, kv_heads


def _llama_parameters(shape: LayerShape, kv_width: int, intermediate: int) -> list[ParameterShape]:
    hidden = shape.hidden
    parameters = [ParameterShape("embed_tokens.weight", (shape.vocab, hidden), None, False)]
    matrices = (
        ("q_proj", (hidden, hidden)),
        ("k_proj", (kv_width, hidden)),
        ("v_proj", (kv_width, hidden)),
        ("o_proj", (hidden, hidden)),
        ("gate_proj", (intermediate, hidden)),
        ("up_proj", (intermediate, hidden)),
        ("down_proj", (hidden, intermediate)),
    )
    for layer in range(shape.layers):
        prefix = f"layers.{layer}."
        parameters += [ParameterShape(f"{prefix}{name}.weight", matrix, layer, True) for name, matrix in matrices]
        parameters.append(ParameterShape(prefix + "input_layernorm.weight", (hidden,), layer, False))
        parameters.append(ParameterShape(prefix + "post_attention_layernorm.weight", (hidden,), layer, False))
    parameters.append(ParameterShape("norm.weight", (hidden,), None, False))
    if not shape.tie_embeddings:
        parameters.append(ParameterShape("lm_head.weight", (shape.vocab, hidden), None, False))
    return parameters


def _mlp_width(shape: LayerShape, kv_width: int) -> int:
    """The MLP width that brings the total closest to ``shape.parameters``."""
    hidden = shape.hidden
    embeddings = shape.vocab * hidden * (1 if shape.tie_embeddings else 2) + hidden
    attention = 2 * hidden * hidden + 2 * kv_width * hidden + 2 * hidden
    intermediate = round(((shape.parameters - embeddings) / shape.layers - attention) / (3 * hidden))
    if intermediate < 1:
        smallest = embeddings + shape.layers * (attention + 3 * hidden)
        raise ValueError(
            f"--parameters {shape.parameters:,} is too few for {shape.layers} layers of width {hidden} with a"
            f" {shape.vocab}-token vocabulary (at least {smallest:,}): raise --parameters or lower --layers,"
            " --hidden or --vocab."
        )
    return intermediate


def parameter_count_model(shape: LayerShape) -> ModelShape:
    """A Llama-like model of about ``shape.parameters`` parameters.

    Layout: a token embedding (vocab x hidden), per layer q/o projections (hidden x hidden), k/v projections
    (kv_width x hidden), a gated MLP (gate, up: intermediate x hidden; down: hidden x intermediate) and two RMSNorm
    weights, a final norm and an untied head (unless ``tie_embeddings``). The MLP width is what makes the total come
    out closest to ``shape.parameters``; the real total is reported.
    """
    if shape.layers < 1 or shape.hidden < 1 or shape.vocab < 1:
        raise ValueError("--layers, --hidden and --vocab must be positive integers, e.g. --layers 32 --hidden 4096.")
    heads, kv_heads = _heads_of(shape)
    kv_width = shape.hidden // heads * kv_heads
    intermediate = _mlp_width(shape, kv_width)
    architecture = Architecture(
        layers=shape.layers,
        hidden=shape.hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        vocab=shape.vocab,
        gated_mlp=True,
        norm="rmsnorm",
        attention="sdpa",
        dropout=0.0,
        attention_input_matmuls=3,
        mlp_input_matmuls=2,
        activation_saves=1,
        max_sequence=None,
        tensor_parallel_policy="assumed (Megatron split of the block matrices)",
        vocab_parallel=False,
    )
    description = (
        f"Llama-like layout of --parameters {shape.parameters:,} ({shape.layers} layers, hidden {shape.hidden},"
        f" {heads} heads, {kv_heads} kv heads, MLP {intermediate}, vocab {shape.vocab})"
    )
    parameters = _llama_parameters(shape, kv_width, intermediate)
    return ModelShape(description, tuple(parameters), architecture, source="parameters")
