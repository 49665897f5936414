"""What every Hugging Face policy here reads of a ``transformers`` model first: its base model.

A task model (``LlamaForCausalLM``, ``OPTForCausalLM``, ...) holds its base model at ``model.<base_model_prefix>``;
plans name modules relative to that base model, so each policy finds it, and the prefix leading to it, the same way.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn


def base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model (``model.<base_model_prefix>``, or ``model`` itself) and the prefix leading to it."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return getattr(model, prefix), prefix
    return model, ""


def arguments_by_name(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A forward pre-hook's ``args`` and ``kwargs`` by name (hooks that change arguments return them all by name)."""
    names = [
        name
        for name, parameter in inspect.signature(module.forward).parameters.items()
        if parameter.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    ]
    return {**dict(zip(names[: len(args)], args, strict=True)), **kwargs}


def without_cache(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], technique: str) -> dict[str, Any]:
    """Before a base model whose sequence ``technique`` splits: its arguments by name with ``use_cache=False``; a
    given KV cache is refused (``past_key_values`` is the older name of ``cache``, still accepted by transformers)."""
    arguments = arguments_by_name(module, args, kwargs)
    if arguments.get("cache") is not None or arguments.get("past_key_values") is not None:
        raise ValueError(
            f"{technique} runs without a KV cache: generate with a model trained this way after loading it without"
            " sequence parallelism."
        )
    arguments["use_cache"] = False
    return arguments


def no_cache(mask_function: Any) -> dict[str, None]:
    """The keyword that gives a ``transformers.masking_utils`` mask function no KV cache, named as the installed
    version names it (``past_key_values`` became ``cache``)."""
    parameters = inspect.signature(mask_function).parameters
    return {"cache" if "cache" in parameters else "past_key_values": None}
