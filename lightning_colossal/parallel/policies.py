"""Choosing the policy for a model: one the model declares, a built-in one by model class, a user plan, or the
user's own policy.

[Note: declared policies]
A model may declare its own policy: a method ``parallel_policy(self) -> ModelPolicy`` on its class. ``find_policy``
asks every module, outermost first, before trying the built-in policies on it; the demo GPT declares its policy this
way (``lightning_colossal/demo/parallel_policy.py``), so this package never imports the demo, which imports
Lightning (docs/architecture.md, section 1).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_colossal.parallel.policy import ModelPolicy, ParallelPlan, refuse_sequence_parallel
from lightning_colossal.parallel.tensor_parallel import ParallelContext


class DataParallelOnlyPolicy(ModelPolicy):
    """No model parallelism (tp = pp = sp = 1): nothing is split, any model works."""

    name = "none"

    def accepts(self, module: nn.Module) -> bool:
        return True

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        return ParallelPlan()


class UserTensorParallelPolicy(ModelPolicy):
    """The user's ``configure_model`` split the model itself (DTensor parameters, e.g. torch's ``parallelize_module``
    over ``self.device_mesh["tp"]``): nothing more is split; the engine averages, clips and checkpoints the DTensors
    as they are."""

    name = "user DTensor tensor parallelism"

    def accepts(self, module: nn.Module) -> bool:
        return any(isinstance(parameter, DTensor) for parameter in module.parameters())

    def parallelize(self, model: nn.Module, context: ParallelContext) -> ParallelPlan:
        refuse_sequence_parallel(context, "Tensor parallelism applied in configure_model")
        for name, parameter in model.named_parameters():
            if isinstance(parameter, DTensor) and (
                parameter.device_mesh.ndim != 1 or parameter.device_mesh.size() != context.tp_size
            ):
                raise ValueError(
                    f"Parameter {name!r} is a DTensor over a mesh of shape {tuple(parameter.device_mesh.shape)}, not the"
                    f" tensor-parallel axis (tp_size = {context.tp_size}): apply your tensor parallelism over"
                    " `self.device_mesh['tp']` only; the strategy owns the other axes."
                )
        return ParallelPlan()


#: The method by which a model declares its own policy (see [Note: declared policies]).
DECLARED_POLICY_METHOD = "parallel_policy"


def declared_policy(module: nn.Module) -> ModelPolicy | None:
    """The policy ``module`` declares with ``parallel_policy()``, or ``None`` (see [Note: declared policies]).

    Raises:
        TypeError: the declaration returned something other than a ``ModelPolicy``.
    """
    # Looked up on the class: nn.Module's attribute lookup would also find a submodule or parameter of that name.
    if not callable(getattr(type(module), DECLARED_POLICY_METHOD, None)):
        return None
    policy = getattr(module, DECLARED_POLICY_METHOD)()
    if not isinstance(policy, ModelPolicy):
        raise TypeError(
            f"{type(module).__name__}.{DECLARED_POLICY_METHOD}() returned {type(policy).__name__}, not a"
            " lightning_colossal.parallel.ModelPolicy."
        )
    return policy


def built_in_policies() -> list[ModelPolicy]:
    """Built-in policies, most specific first (models may also declare their own: [Note: declared policies])."""
    try:
        from lightning_colossal.parallel.huggingface import huggingface_policies
    except ImportError:  # transformers is an optional dependency
        return []
    return huggingface_policies()


def find_policy(
    root: nn.Module, policy: ModelPolicy | dict[str, str] | None, model_parallel: bool = True
) -> tuple[nn.Module, ModelPolicy]:
    """The model inside ``root`` to parallelise and the policy for it.

    Raises:
        TypeError: no known model inside ``root`` and no policy given.
    """
    if UserTensorParallelPolicy().accepts(root):
        if policy is not None:
            raise TypeError(
                "The model already has DTensor parameters (tensor parallelism applied in `configure_model`) and a"
                " `policy` was given too: split the model one way, either in configure_model or with the policy."
            )
        return root, UserTensorParallelPolicy()
    if isinstance(policy, dict):
        from lightning_colossal.parallel.plan_policy import PlanPolicy

        return root, PlanPolicy(policy)
    candidates: list[ModelPolicy] = [policy] if policy is not None else built_in_policies()
    for module in root.modules():
        declared = declared_policy(module) if policy is None else None
        if declared is not None:
            return module, declared
        for candidate in candidates:
            if candidate.accepts(module):
                return module, candidate
    if not model_parallel:
        return root, DataParallelOnlyPolicy()
    known = ", ".join(candidate.name for candidate in built_in_policies()) or "none: transformers is not installed"
    raise TypeError(
        f"No model inside {type(root).__name__} is one the hybrid strategy knows how to split (built-in policies: {known};"
        f" models may declare their own with a `{DECLARED_POLICY_METHOD}()` method, as the demo GPT does). Build such a"
        " model in `configure_model`, pass `policy={'pattern.*.of.linear': 'colwise' | 'rowwise', ...}`, or pass a"
        " `ModelPolicy` subclass for your model."
    )
