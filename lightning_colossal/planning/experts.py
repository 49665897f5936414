"""Expert parallelism in the planner: one rank's model state with the experts divided by ``ep_size``, and the bytes
its token all-to-alls move per optimizer step.

[Note: expert-parallel all-to-all bytes]
Take one MoE layer and one rank that routes ``T`` tokens in a step (its micro-batches' tokens, summed over gradient
accumulation), each to ``k`` experts: it dispatches ``T * k`` rows of ``h`` elements of ``b`` bytes. With the
experts spread evenly over the ``ep`` ranks and balanced routing, a row stays on this rank with probability
``1 / ep``, so ``(ep - 1) / ep`` of the rows cross the wire. The forward sends them out (dispatch) and their outputs
come back (combine): two all-to-alls of the same size. The backward runs the reverse of each (the gradients of the
combined outputs go out, those of the dispatched rows come back): two more. Per rank, per MoE layer, per step:

    bytes sent = T * k * h * b * 2 (dispatch, combine) * 2 (forward, backward) * (ep - 1) / ep

and as many received. Activation checkpointing recomputes the forward in backward, adding the forward's two
exchanges again (a factor 3/2). The small exchanges beside them are counted separately: the row counts (``ep``
int64 once per forward: the combine reuses the dispatch's) and each row's expert index (``T * k`` int64 ``* (ep - 1) / ep``, forward
only, as no gradient flows through it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lightning_colossal.planning.model_shape import ModelShape, ParameterShape
from lightning_colossal.planning.model_state import ModelState, Training, ddp_state, model_state
from lightning_colossal.planning.settings import Setting

INDEX_BYTES = 8  # int64 counts and expert indices


def is_expert_parameter(parameter: ParameterShape, num_experts: int) -> bool:
    """Whether ``parameter`` holds one slice per expert (the fused 3-D expert weights: ``[num_experts, ...]``)."""
    return len(parameter.shape) == 3 and parameter.shape[0] == num_experts


def expert_parallel_shapes(model: ModelShape, num_experts: int, ep_size: int) -> list[tuple[int, ...]]:
    """Every parameter's shape on one ep rank: expert weights hold ``num_experts / ep_size`` experts."""
    if num_experts % ep_size != 0:
        raise ValueError(f"{num_experts} experts do not split evenly over ep_size={ep_size}: pick a divisor.")
    return [
        (num_experts // ep_size, *parameter.shape[1:])
        if is_expert_parameter(parameter, num_experts)
        else parameter.shape
        for parameter in model.parameters
    ]


def expert_parallel_ddp_state(model: ModelShape, num_experts: int, ep_size: int, training: Training) -> ModelState:
    """One rank's parameters, gradients and optimizer state under ``colossal_hybrid(ep_size=...)`` with gradient
    averaging (``zero_stage=0``): every other parameter whole, the experts divided by ``ep_size``."""
    return ddp_state(expert_parallel_shapes(model, num_experts, ep_size), training)


def expert_parallel_state(model: ModelShape, setting: Setting, training: Training, world_size: int) -> ModelState:
    """One rank's model state under a hybrid setting with ``ep_size``: the non-expert parameters as the setting's ZeRO
    stage over ``world_size`` ranks keeps them, the experts (``1 / ep_size`` of them) whole in the parameters' dtype
    with their gradients and optimizer state, as the engine keeps them out of ZeRO (``parallel/experts.py``)."""
    experts = model.architecture.experts
    shapes = expert_parallel_shapes(model, experts, setting.ep_size)
    kept = [is_expert_parameter(parameter, experts) for parameter in model.parameters]
    rest = model_state(
        [shape for shape, expert in zip(shapes, kept, strict=True) if not expert], setting, training, world_size, 0
    )
    own = ddp_state([shape for shape, expert in zip(shapes, kept, strict=True) if expert], training)
    return ModelState(
        parameters=rest.parameters + own.parameters,
        gradients=rest.gradients + own.gradients,
        optimizer_state=rest.optimizer_state + own.optimizer_state,
    )


def moe_layers(model: ModelShape) -> int:
    """Blocks holding experts (each runs one dispatch and one combine per forward)."""
    experts = model.architecture.experts
    return len({parameter.block for parameter in model.parameters if is_expert_parameter(parameter, experts)})


@dataclass(frozen=True)
class ExpertTraffic:
    """Bytes one rank sends in its expert-parallel all-to-alls per optimizer step (it receives as many)."""

    rows: int  # hidden states and their gradients ([Note: expert-parallel all-to-all bytes])
    indices: int  # row counts and expert indices

    @property
    def total(self) -> int:
        return self.rows + self.indices


def all_to_all_bytes_per_step(
    tokens: int,
    top_k: int,
    hidden: int,
    element_bytes: int,
    ep_size: int,
    moe_layers: int,
    activation_checkpointing: bool = False,
) -> ExpertTraffic:
    """Bytes one rank sends per step ([Note: expert-parallel all-to-all bytes]).

    Args:
        tokens: tokens this rank routes in one optimizer step.
        top_k: experts per token.
        hidden: width of the hidden states.
        element_bytes: bytes of one activation element (2 under bf16, 4 under fp32).
        ep_size: expert-parallel ranks.
        moe_layers: MoE layers (each runs one dispatch and one combine per forward).
        activation_checkpointing: whether forwards run again in backward.
    """
    if ep_size == 1:
        return ExpertTraffic(0, 0)
    remote = (ep_size - 1) / ep_size
    forwards = 2 if activation_checkpointing else 1
    exchanges = 2 * (forwards + 1)  # dispatch and combine, in each forward and in the backward
    rows = tokens * top_k * hidden * element_bytes * exchanges * remote * moe_layers
    counts = ep_size * INDEX_BYTES * forwards  # one counts exchange per forward (the combine reuses them)
    indices = tokens * top_k * INDEX_BYTES * remote * forwards
    return ExpertTraffic(rows=math.ceil(rows), indices=math.ceil((counts + indices) * moe_layers))


def expert_parallel_numels(model: ModelShape, num_experts: int, ep_size: int) -> tuple[int, int]:
    """(expert elements on one rank, other elements on one rank)."""
    experts = other = 0
    for parameter, shape in zip(model.parameters, expert_parallel_shapes(model, num_experts, ep_size), strict=True):
        if is_expert_parameter(parameter, num_experts):
            experts += math.prod(shape)
        else:
            other += math.prod(shape)
    return experts, other
