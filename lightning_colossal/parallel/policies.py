"""Choosing the policy for a model: a built-in one by model class, a user plan, or the user's own policy."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_colossal.parallel.gpt_policy import GPTPolicy
from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan
from lightning_colossal.parallel.tensor_parallel import ParallelContext


class DataParallelOnlyPolicy(ModelPolicy):
    """No model parallelism (tp = pp = sp = 1): nothing is split, any model works."""

    name = "none"

    def accepts(self, module: nn.Module) -> bool:
        return True

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        return ParallelPlan()


def built_in_policies() -> list[ModelPolicy]:
    """Built-in policies, most specific first."""
    policies: list[ModelPolicy] = [GPTPolicy()]
    try:
        from lightning_colossal.parallel.huggingface import huggingface_policies
    except ImportError:  # transformers is an optional dependency
        return policies
    return policies + huggingface_policies()


def find_policy(
    root: nn.Module, policy: ModelPolicy | dict[str, str] | None, model_parallel: bool = True
) -> tuple[nn.Module, ModelPolicy]:
    """The model inside ``root`` to parallelise and the policy for it.

    Raises:
        TypeError: no known model inside ``root`` and no policy given.
    """
    if any(isinstance(parameter, DTensor) for parameter in root.parameters()):
        raise TypeError(
            "The model already has DTensor parameters (tensor parallelism applied in `configure_model`, e.g. with"
            " `parallelize_module`): colossal_hybrid splits the model itself and does not take over a user's DTensor"
            " layout yet. Build the plain model in `configure_model` and pass the split as"
            " `policy={'blocks.*.attn.qkv': 'colwise', 'blocks.*.attn.proj': 'rowwise', ...}` (or a ModelPolicy), or"
            " train your DTensor model with Lightning's ModelParallelStrategy."
        )
    if isinstance(policy, dict):
        from lightning_colossal.parallel.plan_policy import PlanPolicy

        return root, PlanPolicy(policy)
    candidates: list[ModelPolicy] = [policy] if policy is not None else built_in_policies()
    for module in root.modules():
        for candidate in candidates:
            if candidate.accepts(module):
                return module, candidate
    if not model_parallel:
        return root, DataParallelOnlyPolicy()
    known = ", ".join(candidate.name for candidate in built_in_policies())
    raise TypeError(
        f"No model inside {type(root).__name__} is one the hybrid strategy knows how to split (built-in policies: {known})."
        " Build such a model in `configure_model`, pass `policy={'pattern.*.of.linear': 'colwise' | 'rowwise', ...}`,"
        " or pass a `ModelPolicy` subclass for your model."
    )
