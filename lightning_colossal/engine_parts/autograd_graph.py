"""Which leaf tensors a backward will reach, read from the autograd graph before it runs.

Engines that reduce gradients per parameter need to know, before ``loss.backward()``, which parameters this rank
will produce a gradient for: a branch whose output the loss does not use (an expert that got no tokens) produces
none, and waiting for it would stall the reduction.

[Note: reentrant activation checkpoints hide their parameters]
``torch.utils.checkpoint.checkpoint(function, *inputs, use_reentrant=True)`` (the default of Hugging Face's
``gradient_checkpointing_enable`` in many versions) runs ``function`` under ``no_grad`` and records one node whose
backward runs the function again and a backward of its own. The parameters inside never appear in the graph the loss
sees, yet they do get gradients. Taking the graph at its word dropped them: FSDP's tracker removed their gradients as
"reached by no rank" (silently untrained weights) and Gemini reduced a chunk before they arrived. The node keeps
the function it will run (``run_function``): when that is a module or a module's bound method (Hugging Face passes
``layer.__call__``) every parameter of that module counts as reached, which may over-count (an expert without
tokens inside the layer), never under-count. Any other function (a lambda, a closure) could touch any parameter, so
the answer is then "unknown" and callers must assume every parameter is reached.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn

_REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"


def leaves_reached_from(loss: Tensor) -> set[int] | None:
    """``id``s of the leaf tensors whose gradient ``loss.backward()`` will accumulate.

    ``None`` when the graph holds a reentrant activation checkpoint around something other than a module: its
    parameters cannot be read from the graph, and any leaf may be reached (see the Note).
    """
    reached: set[int] = set()
    seen: set[Any] = set()
    stack = [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        if type(node).__name__ == _REENTRANT_CHECKPOINT_NODE:
            module = _module_run_by(getattr(node, "run_function", None))
            if module is None:
                return None
            reached.update(id(parameter) for parameter in module.parameters())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached


def _module_run_by(function: Any) -> nn.Module | None:
    """The module whose parameters ``function`` uses, when that can be told from the function itself."""
    while isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, nn.Module):
        return function
    owner = getattr(function, "__self__", None)  # a bound method: layer.__call__, layer.forward
    return owner if isinstance(owner, nn.Module) else None
