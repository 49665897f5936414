"""Which leaf tensors a backward will reach, read from the autograd graph before it runs.

Engines that reduce gradients per parameter need to know, before ``loss.backward()``, which parameters this rank
will produce a gradient for: a branch whose output the loss does not use (an expert that got no tokens) produces
none, and waiting for it would stall the reduction.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor


def leaves_reached_from(loss: Tensor) -> set[int]:
    """``id``s of the leaf tensors whose gradient ``loss.backward()`` will accumulate."""
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
        stack.extend(next_node for next_node, _ in node.next_functions)
    return reached
