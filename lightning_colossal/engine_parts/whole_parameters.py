"""Whole, differentiable parameters in place of DTensor shards, for a loss term read outside a forward.

[Note: reading sharded parameters outside a forward]
A loss term over the parameters themselves (an L2 penalty, a regulariser over some weights) reads them in
``training_step``, outside any module's forward. Under FSDP2 a parameter there is this rank's DTensor shard, and
adding a term over it to the plain loss fails in torch ("mixed torch.Tensor and DTensor"); Gemini's parameters are
empty placeholders outside their module's forward. Holding every parameter whole between forwards would undo the
sharding, so the strategies gather only inside ``whole_parameters``, on request. (The hybrid strategy's
tensor-parallel pieces are plain tensors, some fused, and a pipeline stage holds only its layers: it refuses.)

Here (FSDP2) each DTensor parameter is replaced in its module, for the duration of the context,
by its ``full_tensor()``: an all-gather whose backward gives each rank the gradient of its own rows without any
communication, which is exact because every rank computes the same term. Autograd accumulates that gradient into the
shard's ``.grad`` beside the one the engine reduces (a mean over ranks of the data term), so the step sees
``mean(data gradients) + term gradient``, what one process computes for the global batch. The gathered tensors stay
alive until backward, held by autograd: a term over every parameter costs the whole model's bytes until then.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["whole_dtensor_parameters"]


@contextmanager
def whole_dtensor_parameters(module: nn.Module) -> Iterator[None]:
    """Within the context, every DTensor parameter of ``module`` reads as the whole tensor (a collective per
    parameter: call on every rank of the parameters' mesh, in the same order); restored on exit."""
    swapped: list[tuple[nn.Module, str, Tensor]] = []
    whole_of: dict[int, Tensor] = {}  # tied parameters are gathered once
    try:
        for owner in module.modules():
            for name, parameter in list(owner._parameters.items()):
                if not isinstance(parameter, DTensor):
                    continue
                whole = whole_of.get(id(parameter))
                if whole is None:
                    whole = whole_of[id(parameter)] = parameter.full_tensor()
                # Not an nn.Parameter: a non-leaf whose gradient flows back into the shard.
                owner._parameters[name] = whole  # type: ignore[assignment]
                swapped.append((owner, name, parameter))
        yield
    finally:
        for owner, name, parameter in reversed(swapped):
            owner._parameters[name] = parameter  # type: ignore[assignment]
