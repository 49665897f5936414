"""What every Hugging Face policy here reads of a ``transformers`` model first: its base model.

A task model (``LlamaForCausalLM``, ``OPTForCausalLM``, ...) holds its base model at ``model.<base_model_prefix>``;
plans name modules relative to that base model, so each policy finds it, and the prefix leading to it, the same way.
"""

from __future__ import annotations

from torch import nn


def base_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The base model (``model.<base_model_prefix>``, or ``model`` itself) and the prefix leading to it."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        return getattr(model, prefix), prefix
    return model, ""
