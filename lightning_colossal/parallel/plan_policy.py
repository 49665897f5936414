"""Tensor parallelism from a plan: module-name patterns mapped to ``"colwise"`` / ``"rowwise"``.

This is how a user splits a model no built-in policy knows (``policy={"layers.*.attn.q": "colwise", ...}``, names
relative to the LightningModule), and how Hugging Face models that carry their own plan
(``config.base_model_tp_plan``: Llama, Qwen2, Mistral, ...) are split automatically. ``*`` matches one name
component (a layer index). Styles other than column/row-wise (e.g. Hugging Face's ``*_rep`` styles, whose outputs
are gathered) are left unsplit with a warning: the model stays correct, only less of it is sharded. Plans give
tensor parallelism only; pipelines and sequence parallelism need a policy that knows the model's structure.
"""

from __future__ import annotations

import re
import warnings

from torch import nn

from lightning_colossal.parallel.policy import (
    ModelPolicy,
    ParallelPlan,
    column_parallel,
    refuse_sequence_parallel,
    row_parallel,
)
from lightning_colossal.parallel.tensor_parallel import ParallelContext

SPLIT_STYLES = ("colwise", "rowwise")


def _pattern(plan_key: str) -> re.Pattern[str]:
    return re.compile(
        "^" + r"\.".join("[^.]+" if part == "*" else re.escape(part) for part in plan_key.split(".")) + "$"
    )


class PlanPolicy(ModelPolicy):
    """Split the ``nn.Linear`` modules a plan names.

    Args:
        plan: module-name pattern -> ``"colwise"`` or ``"rowwise"``.
        prefix: prepended to every pattern (the path from the parallelised module to the plan's root).
        heads: ``(what, count)`` pairs that must divide by the tensor-parallel size (attention heads).
    """

    name = "plan"

    def __init__(self, plan: dict[str, str], prefix: str = "", heads: tuple[tuple[str, int], ...] = ()) -> None:
        self.plan = dict(plan)
        self.prefix = prefix
        self.heads = heads

    def accepts(self, module: nn.Module) -> bool:
        return True  # applies to the module it is given (the LightningModule for a user plan)

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        refuse_sequence_parallel(context, "A tensor-parallel plan")
        for what, count in self.heads:
            if count % context.tp_size != 0:
                raise ValueError(
                    f"{what} = {count} is not divisible by tp_size = {context.tp_size}: attention heads are split over"
                    " the tensor-parallel ranks; choose a tp_size that divides it."
                )
        plan = ParallelPlan()
        if context.tp_size == 1:
            return plan
        ignored = sorted({style for style in self.plan.values() if style not in SPLIT_STYLES})
        if ignored:
            warnings.warn(f"Tensor-parallel styles {ignored} are not applied; those modules stay whole.", stacklevel=2)
        rules = [(_pattern(self.prefix + key), style) for key, style in self.plan.items() if style in SPLIT_STYLES]
        matched = 0
        for name, module in list(model.named_modules()):
            style = next((style for pattern, style in rules if pattern.match(name)), None)
            if style is None:
                continue
            if not isinstance(module, nn.Linear):
                raise TypeError(f"The plan splits {name!r} ({type(module).__name__}); only nn.Linear can be split.")
            parent_name, _, attribute = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            split = column_parallel if style == "colwise" else row_parallel
            setattr(parent, attribute, split(module, context, plan))
            matched += 1
        if matched == 0:
            raise ValueError(
                f"The tensor-parallel plan {sorted(self.plan)} matched no nn.Linear of {type(model).__name__}: write the"
                " patterns relative to the LightningModule (e.g. 'model.layers.*.attn.q_proj')."
            )
        return plan
