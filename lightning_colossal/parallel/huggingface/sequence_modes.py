"""The sequence-parallel step of the Hugging Face policies: one function, dispatching on the mode's type.

Every Hugging Face policy splits a model for tensor parallelism alone and then hands it to the mode's own attach
step, in torchtitan's order (tensor parallelism, then context parallelism): split-gather through the family's layout
(``split_gather.py``), Ulysses and ring through ``transformers``' attention interface (``sequence.py``). The policies
answer no question about sequence parallelism themselves: the layout comes from the model's family
(``split_gather.layout_for``), whether the attention interface applies from the model's class
(``sequence.uses_attention_interface``). A new mode is one more entry in ``STEPS`` (none for one more
``sequence.ATTENTION_MODES``).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from lightning_colossal.config import SplitGather
from lightning_colossal.parallel.huggingface.base_model import base_model
from lightning_colossal.parallel.huggingface.sequence import ATTENTION_MODES, attach_attention_sequence_parallel
from lightning_colossal.parallel.huggingface.split_gather import attach_split_gather, layout_for
from lightning_colossal.parallel.policy import ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext

#: A policy's tensor-parallel split of the model it was given, under the context it is given.
TensorParallelSplit = Callable[[ParallelContext], ParallelPlan]


def parallelize_with_sequence(
    model: nn.Module, context: ParallelContext, split_tensor_parallel: TensorParallelSplit
) -> ParallelPlan:
    """``split_tensor_parallel`` under tensor parallelism alone, then ``context.sequence``'s attach step (none
    without sequence parallelism); returns the plan, the attached hooks in ``plan.attached``."""
    if context.sequence is None:
        return split_tensor_parallel(context)
    return STEPS[type(context.sequence)](model, context, split_tensor_parallel)


def _split_gather(model: nn.Module, context: ParallelContext, split: TensorParallelSplit) -> ParallelPlan:
    """Megatron sequence parallelism ([Note: split-gather on Hugging Face decoders]): the family's layout, refused
    before anything is split where there is none, turns the tensor-parallel split into split-gather."""
    layout = layout_for(model)
    plan = split(context.tensor_parallel_only())
    attach_split_gather(model, base_model(model)[0], layout, context, plan)
    return plan


def _through_attention_interface(
    model: nn.Module, context: ParallelContext, split: TensorParallelSplit
) -> ParallelPlan:
    """Ulysses or ring attention registered in ``transformers``' attention interface ([Note: sequence parallelism
    through the attention interface])."""
    plan = split(context.tensor_parallel_only())
    attach_attention_sequence_parallel(model, context, plan)
    return plan


#: Each mode's attach step, by the mode's type (``context.sequence``): every mode ``sequence.ATTENTION_MODES`` runs
#: goes through the attention interface.
STEPS: dict[type, Callable[[nn.Module, ParallelContext, TensorParallelSplit], ParallelPlan]] = {
    SplitGather: _split_gather,
    **dict.fromkeys(ATTENTION_MODES, _through_attention_interface),
}
