"""Hugging Face ``transformers`` models that carry their own tensor-parallel plan (Llama, Qwen2, Mistral, ...).

Their ``config.base_model_tp_plan`` names the column- and row-parallel projections of the base model; the policy
applies it to the base model (``model.<base_model_prefix>``). Attention reshapes in these models use ``-1`` heads, so
a rank with a share of the heads runs the unchanged forward.
"""

from __future__ import annotations

from torch import nn

from lightning_colossal.parallel.plan_policy import PlanPolicy
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext


class HuggingFacePlanPolicy(ModelPolicy):
    """Tensor parallelism for a ``transformers.PreTrainedModel`` from its ``config.base_model_tp_plan``."""

    name = "huggingface (base_model_tp_plan)"

    def accepts(self, module: nn.Module) -> bool:
        from transformers import PreTrainedModel

        config = getattr(module, "config", None)
        return isinstance(module, PreTrainedModel) and bool(getattr(config, "base_model_tp_plan", None))

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        config = model.config  # type: ignore[attr-defined]
        prefix = getattr(model, "base_model_prefix", "")
        if not hasattr(model, prefix):
            prefix = ""
        heads = tuple(
            (f"config.{attribute}", int(getattr(config, attribute)))
            for attribute in ("num_attention_heads", "num_key_value_heads")
            if getattr(config, attribute, None)
        )
        plan_policy = PlanPolicy(dict(config.base_model_tp_plan), prefix=f"{prefix}." if prefix else "", heads=heads)
        return plan_policy.parallelize(model, context)


def huggingface_policies() -> list[ModelPolicy]:
    return [HuggingFacePlanPolicy()]
