"""Taking over the user's optimizer: the checks and the parameter swap that ZeRO and Gemini share.

[Note: optimizer takeover]
The sharding engines keep the user's optimizer object, so LR schedulers and ``param_groups`` edits keep working,
but replace the parameters in its groups by *masters* (this rank's fp32 rows of each parameter). That is only
sound for a ``torch.optim.Optimizer`` that holds nothing but the model's parameters and never stepped: state keyed
by the old parameters would be orphaned, and a tensor that is not a parameter has no rows to shard. Frozen
parameters in the optimizer are fine (users often pass ``self.parameters()`` for a LoRA model): they get no master
and leave the groups, since they never have a gradient to step. Each rank then steps only its rows, so the
optimizer's update of an element must depend on that element alone (its gradient and its own state): true of Adam,
AdamW, SGD, RMSprop, Adagrad and torch's other elementwise optimizers, false of LBFGS, Adafactor, Muon and
SparseAdam, which are refused (``WHOLE_PARAMETER_OPTIMIZERS``). An optimizer from another package is taken on trust.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.optim.optimizer as torch_optimizer_module
from torch import Tensor, nn
from torch.optim import Optimizer

# torch optimizers whose fused kernel also runs on the CPU.
FUSED_CPU_KERNELS = ("Adam", "AdamW", "SGD", "Adagrad")

# torch optimizers whose step of a parameter reads only that parameter, its gradient and its state, and that keep no
# count or statistic per step() call: stepping a subset of the parameters at a time gives the same values as one
# step of all of them (zero/exchange.py [Note: exchange overlapped with the step]).
STEP_EACH_PARAMETER_ALONE = (
    "SGD",
    "Adam",
    "AdamW",
    "Adamax",
    "NAdam",
    "RAdam",
    "Adagrad",
    "RMSprop",
    "Adadelta",
)

# torch optimizers that cannot step a rank's rows of a parameter on their own, and why ([Note: optimizer takeover]).
WHOLE_PARAMETER_OPTIMIZERS = {
    "LBFGS": "re-evaluates the loss inside step() and searches along a direction made of dot products over the whole"
    " model",
    "Adafactor": "factors its second moment into row and column statistics of each whole parameter",
    "Muon": "orthogonalises each whole weight matrix",
    "SparseAdam": "needs sparse gradients, which the engine's reduced gradient shards are not",
}


def check_optimizer(optimizer: object, engine: str) -> Optimizer:
    """``optimizer`` if the engine can take it over, else ``TypeError`` (not a torch optimizer) or ``ValueError``
    (an optimizer that needs whole parameters)."""
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"{engine} shards a torch.optim.Optimizer; got {type(optimizer).__name__}.")
    for name, reason in WHOLE_PARAMETER_OPTIMIZERS.items():
        torch_class = getattr(torch.optim, name, None)  # Adafactor and Muon are recent
        if torch_class is not None and isinstance(optimizer, torch_class):
            raise ValueError(
                f"{engine} steps each rank's rows of every parameter, but {name} {reason}: stepped in pieces its"
                " updates would be silently wrong. Use an elementwise optimizer (Adam, AdamW, SGD, RMSprop, Adagrad,"
                " ...), or `colossal_ddp`, which steps whole parameters on every rank."
            )
    return optimizer


def held_parameters(optimizer: Optimizer, module: nn.Module) -> set[int]:
    """The ids of the tensors ``optimizer`` holds, after checking that the takeover is sound ([Note: optimizer
    takeover]): every one is a parameter of ``module``, and the optimizer never stepped."""
    held = {id(parameter) for group in optimizer.param_groups for parameter in group["params"]}
    strangers = len(held - {id(parameter) for parameter in module.parameters()})
    if strangers:
        raise ValueError(
            f"The optimizer holds {strangers} tensor(s) that are not parameters of the model: build it over the"
            " parameters of the model being set up (in a LightningModule's `configure_optimizers`, from"
            " `self.parameters()` or named subsets of them; in a Fabric loop, from `model.parameters()` of the model"
            " passed to `fabric.setup`)."
        )
    if optimizer.state:
        raise ValueError(
            "The optimizer already has state (it stepped before the strategy took it over): return a fresh optimizer"
            " from `configure_optimizers`, and resume optimizer state through `ckpt_path`."
        )
    return held


def refuse_accelerator_only_options(optimizer: Optimizer, cpu_steps: str, fix: str, fused: bool = True) -> None:
    """Refuse options that step only on an accelerator when ``cpu_steps`` (why some masters step on the CPU).

    Args:
        optimizer: the user's optimizer.
        cpu_steps: why the engine steps (some) masters in CPU memory, for the message.
        fix: what the user can change instead of the option, for the message.
        fused: also refuse ``fused=True`` for optimizers without a fused CPU kernel.
    """
    name = type(optimizer).__name__
    for group in optimizer.param_groups:
        if group.get("capturable"):
            raise ValueError(
                f"{name}(capturable=True) steps only on an accelerator, but {cpu_steps}: drop capturable=True{fix}."
            )
        if fused and group.get("fused") and name not in FUSED_CPU_KERNELS:
            raise ValueError(f"{name}(fused=True) has no CPU kernel but {cpu_steps}: use foreach (the default){fix}.")


def swap_parameters(optimizer: Optimizer, replacement: Mapping[int, Tensor]) -> None:
    """Replace each parameter in ``optimizer``'s groups by ``replacement[id(parameter)]`` (its master), dropping the
    ones without a replacement (frozen parameters: they never have a gradient to step)."""
    for group in optimizer.param_groups:
        group["params"] = [replacement[id(parameter)] for parameter in group["params"] if id(parameter) in replacement]


def give_back(
    optimizer: Optimizer, user_groups: Sequence[Sequence[Tensor]], parameter_of: Mapping[int, Tensor]
) -> None:
    """Undo ``swap_parameters``: the groups the engine took over hold the user's parameters again (frozen ones too),
    groups added since stay as added, and the optimizer's state moves from each master to its parameter
    (``parameter_of`` maps a master's id to its parameter)."""
    for group, parameters in zip(optimizer.param_groups, user_groups, strict=False):
        group["params"] = list(parameters)
    rekey_state(optimizer, parameter_of)


#: Marks the ``add_param_group`` that ``on_group_added`` puts on an optimizer instance.
_WATCHER = "_engine_watches_added_groups"


def on_group_added(optimizer: Optimizer, before: Callable[[], None]) -> None:
    """Call ``before()`` whenever a param group is about to be added to ``optimizer`` (``add_param_group`` on this
    instance runs it first); undone by ``stop_watching_groups``."""
    stop_watching_groups(optimizer)
    add_param_group = optimizer.add_param_group

    def watched(param_group: dict[str, Any]) -> None:
        before()
        add_param_group(param_group)

    setattr(watched, _WATCHER, True)
    optimizer.__dict__["add_param_group"] = watched


def stop_watching_groups(optimizer: Optimizer) -> None:
    """Remove what ``on_group_added`` put on ``optimizer`` (nothing the user set)."""
    if getattr(optimizer.__dict__.get("add_param_group"), _WATCHER, False):
        del optimizer.__dict__["add_param_group"]


def rekey_state(optimizer: Optimizer, new_key_of: Mapping[int, Tensor]) -> None:
    """Move each entry of ``optimizer.state`` whose key's id is in ``new_key_of`` to that tensor (a parameter to its
    master, or back)."""
    for key in list(optimizer.state):
        replacement = new_key_of.get(id(key))
        if replacement is not None and replacement is not key:
            optimizer.state[replacement] = optimizer.state.pop(key)


def steps_each_parameter_alone(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` may be stepped a subset of its parameters at a time with the values of one whole step:
    its class's ``step`` is one of ``STEP_EACH_PARAMETER_ALONE``'s (a subclass that overrides ``step`` is not known to
    be), and no hook runs around its steps (hooks expect one call per step)."""
    # torch wraps a class's step in a profiling wrapper when the first instance is built: compare what is wrapped.
    steps = {
        inspect.unwrap(getattr(torch.optim, name).step)
        for name in STEP_EACH_PARAMETER_ALONE
        if hasattr(torch.optim, name)
    }
    if inspect.unwrap(type(optimizer).step) not in steps:
        return False
    hooks = (
        getattr(optimizer, "_optimizer_step_pre_hooks", None),
        getattr(optimizer, "_optimizer_step_post_hooks", None),
        getattr(torch_optimizer_module, "_global_optimizer_pre_hooks", None),
        getattr(torch_optimizer_module, "_global_optimizer_post_hooks", None),
    )
    return not any(hooks)


@contextmanager
def narrowed_to(optimizer: Optimizer, keep: set[int]) -> Iterator[None]:
    """Inside: each param group holds only the parameters whose ids are in ``keep`` (the same group dicts, so the
    hyperparameters are untouched); the full lists come back on exit."""
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = [parameter for parameter in params if id(parameter) in keep]
        yield
    finally:
        for group, params in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = params


# torch optimizers whose fused CPU kernel gives the values of their default step within its rounding (checked by
# tests/unit/test_host_step.py), and whose state is made the same way whichever kernel steps (a float32 ``step``).
FUSED_HOST_STEP = ("Adam", "AdamW", "SGD")


@contextmanager
def fused_host_step(optimizer: Optimizer, compute_device: torch.device) -> Iterator[None]:
    """Inside: when the model computes on an accelerator, the param groups whose parameters all live in host memory
    (offloaded masters), and that leave the implementation to torch (``fused`` and ``foreach`` both unset), step with
    torch's fused CPU kernel.

    [Note: the host step runs torch's fused kernel]
    Left to itself, torch steps host tensors with its per-tensor loop (it picks ``foreach`` and ``fused`` only for
    accelerator tensors): for AdamW about 80 bytes moved per parameter, each tensor's update several kernels with
    temporaries, against the 28 bytes a step must move (read parameter, gradient and two moments, write three back). The
    fused CPU kernel does one pass per tensor over all cores (measured here, one thread: 5.8x the loop's elements per
    second). Offloaded masters (ZeRO's ``cpu_offload``, Gemini's offloaded chunks, the disk tier's records) step on the
    host every step, so the engines step them with it for the classes in ``FUSED_HOST_STEP``, whose fused step agrees
    with the loop within rounding (AdamW: 2e-7 after five steps; SGD: bit for bit). The user's model on a GPU would
    have stepped with the GPU's kernels, which no host step reproduces bit for bit, so nothing exact is lost there.

    Not when the model computes on the host: nothing is offloaded then, and plain PyTorch on the same machine steps
    with the loop, which the engines then match bit for bit. A group that names ``fused`` or ``foreach`` keeps its
    choice, and the setting is in force only during the step: checkpoints and the user's ``param_groups`` keep what
    the user wrote. A group with parameters on the accelerator too (Gemini's mixed placement) is left as it is.
    """
    chosen: list[dict] = []
    offloaded = compute_device.type != "cpu"
    if offloaded and type(optimizer) in {getattr(torch.optim, name) for name in FUSED_HOST_STEP}:
        for group in optimizer.param_groups:
            params = group["params"]
            if (
                params
                and group.get("fused") is None
                and group.get("foreach") is None
                and not group.get("differentiable", False)
                and all(parameter.device.type == "cpu" for parameter in params)
            ):
                group["fused"] = True
                chosen.append(group)
    try:
        yield
    finally:
        for group in chosen:
            group["fused"] = None
