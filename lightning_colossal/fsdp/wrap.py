"""Applying torch FSDP2 (``fully_shard``) to a model: which modules become shard units, in which order.

[Note: roots]
FSDP2 gathers a unit's parameters in a pre-forward hook of that unit, and the outermost units ("roots") also
drive the end-of-backward reduction. Lightning calls ``training_step`` on the LightningModule itself, never through
its ``forward``, so sharding the LightningModule would leave its hooks unused. Instead every top-level child of
the LightningModule that holds parameters becomes a root (for the usual ``self.model = ...`` that is one root),
after its transformer blocks were sharded one by one. Parameters registered on the LightningModule itself
belong to no unit and are refused.

[Note: tied parameters]
FSDP2 manages each parameter in exactly one unit: a parameter shared between a block and a module outside it (BERT's
word embeddings, a block of its own by ``_no_split_modules``, tied to the MLM decoder outside it) makes the outer
unit fail with "shared with a parameter already managed by another FSDP group". A block that shares a parameter with
any module outside itself is therefore not sharded on its own; its parameters join the enclosing unit, which holds
both users of the tie (the root at the latest), so the tie survives as one Parameter.

[Note: giving the module back]
``fully_shard`` changes the user's modules in place: their classes become ``FSDP<Class>``, their parameters DTensor
shards, and hooks and a composable-API registry entry are added (which makes a second ``fully_shard`` of the same
module fail). ``unshard_model`` undoes all of it at the end of a run: it gathers every parameter into a plain full
``nn.Parameter``, removes FSDP's forward and state-dict hooks, its state and registry entry, and restores the
original classes, so the module is an ordinary one again that a later run can shard anew. Activation checkpointing
(also a composable API) is switched off instead of removed, and switched on again when the module is sharded again.
torch offers no public inverse of ``fully_shard``; the private attributes used here are read defensively and the
tests (``tests/distributed/test_refit_and_plain_weights.py``) catch a torch release that moves them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
from torch.distributed._composable_state import _module_state_mapping
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lightning_colossal.distributed import device as devices
from lightning_colossal.engine_parts.shown_techniques import ACTIVATION_CHECKPOINTING, show, unshow
from lightning_colossal.fsdp.exchange import use_direct_exchange
from lightning_colossal.fsdp.whole import full_tensors


def detect_block_classes(module: nn.Module, known_blocks: Iterable[str] = ()) -> set[str]:
    """Class names of repeated transformer blocks: those any submodule declares in ``_no_split_modules`` (Hugging
    Face's convention, which the demo GPT follows too), plus ``known_blocks``. Declarations, not imports: this package
    never imports a model's code (docs/architecture.md, section 1)."""
    names = set(known_blocks)
    for submodule in module.modules():
        names.update(getattr(submodule, "_no_split_modules", None) or [])
    return names


def parameter_holding_children(module: nn.Module) -> list[nn.Module]:
    """Top-level children of ``module`` that hold parameters (see [Note: roots])."""
    own = [name for name, _ in module.named_parameters(recurse=False)]
    if own:
        raise ValueError(
            f"Parameters {own} are registered directly on {type(module).__name__}; colossal_fsdp shards submodules."
            " Move them into a submodule (e.g. `self.head = nn.Linear(...)` or an `nn.ParameterDict`)."
        )
    children = [child for child in module.children() if any(True for _ in child.parameters())]
    # A child that is also registered inside another child (`self.backbone = self.model.encoder`, as
    # BackboneFinetuning asks for) is sharded with the child that contains it; sharding it again as a root of its own
    # fails inside torch ("Cannot concatenate overlapping meshes").
    inside_another = {id(descendant) for child in children for descendant in child.modules() if descendant is not child}
    return [child for child in children if id(child) not in inside_another]


def shard_model(
    module: nn.Module,
    mesh: DeviceMesh,
    is_block: Callable[[nn.Module], bool],
    reshard_after_forward: bool,
    mixed_precision: MixedPrecisionPolicy,
    cpu_offload: bool,
    activation_checkpointing: bool,
) -> list[FSDPModule]:
    """Shard every block, then every parameter-holding top-level child of ``module``; return the roots."""
    scalars = [name for name, parameter in module.named_parameters() if parameter.dim() == 0]
    if scalars:
        # torch's own refusal ("fully_shard doesn't support scalar parameters") names neither the parameter nor a fix.
        raise ValueError(
            f"colossal_fsdp cannot shard zero-dimensional parameters ({', '.join(scalars[:5])}"
            f"{' ...' if len(scalars) > 5 else ''}): torch FSDP2 shards along a dimension. Give them shape (1,)"
            " (e.g. `nn.Parameter(torch.tensor([value]))`), or train with `colossal_zero2` or `colossal_gemini`,"
            " which keep such parameters whole on every rank."
        )
    offload: OffloadPolicy = (
        CPUOffloadPolicy(pin_memory=devices.accelerator_available()) if cpu_offload else OffloadPolicy()
    )

    def shard(unit: nn.Module) -> FSDPModule:
        sharded = fully_shard(
            unit,
            mesh=mesh,
            reshard_after_forward=reshard_after_forward,
            mp_policy=mixed_precision,
            offload_policy=offload,
        )
        use_direct_exchange(sharded, mesh)
        return sharded

    # Innermost first: fully_shard of a unit must come after the units nested in it (ConvNext declares both its
    # stages and the layers inside them in `_no_split_modules`).
    roots = parameter_holding_children(module)
    blocks = [
        submodule
        for submodule in _modules_innermost_first(module)
        if submodule is not module
        and not any(submodule is root for root in roots)  # a root is sharded once, below, whatever its class
        and is_block(submodule)
        and not _shares_parameters_outside(submodule, module)
    ]
    for block in blocks:
        if activation_checkpointing:
            if _applied_composable_apis(block).get("checkpoint") is not None:
                # Applied by an earlier run and switched off when that run gave the module back.
                checkpoint.state(block).enable_hook = True
            else:
                # The composable form keeps parameter names unchanged (a wrapper module would rename every key).
                checkpoint(block)
            show(block, ACTIVATION_CHECKPOINTING)
        shard(block)
    return [shard(root) for root in roots]


def _modules_innermost_first(module: nn.Module) -> list[nn.Module]:
    """``module`` and its descendants, each after every module nested in it, siblings in definition order."""
    ordered: list[nn.Module] = []
    seen: set[int] = set()

    def visit(current: nn.Module) -> None:
        if id(current) in seen:
            return
        seen.add(id(current))
        for child in current.children():
            visit(child)
        ordered.append(current)

    visit(module)
    return ordered


def _shares_parameters_outside(block: nn.Module, module: nn.Module) -> bool:
    """Whether a parameter of ``block`` is also registered on a module of ``module`` outside ``block`` (a tie)."""
    inside = {id(parameter) for parameter in block.parameters()}
    inside_modules = {id(submodule) for submodule in block.modules()}
    for submodule in module.modules():
        if id(submodule) in inside_modules:
            continue
        if any(id(parameter) in inside for parameter in submodule.parameters(recurse=False)):
            return True
    return False


def sharded_roots(module: nn.Module) -> list[FSDPModule] | None:
    """The roots of a module an earlier run left sharded (see ``unshard_model``), or ``None`` if it is not sharded.

    Raises:
        ValueError: only some top-level children are sharded (an earlier run failed half-way through sharding).
    """
    children = parameter_holding_children(module)
    roots = [child for child in children if isinstance(child, FSDPModule)]
    if not roots and not any(isinstance(submodule, FSDPModule) for submodule in module.modules()):
        return None
    if len(roots) != len(children):
        unsharded = [type(child).__name__ for child in children if not isinstance(child, FSDPModule)]
        raise ValueError(
            f"{type(module).__name__} is partly sharded by FSDP ({unsharded} are not), probably by a run that failed"
            " while sharding. Build the LightningModule again (or load its weights into a new one) before this run."
        )
    return roots


@torch.no_grad()
def unshard_model(module: nn.Module, device: torch.device) -> dict[int, nn.Parameter]:
    """Give ``module`` back as an ordinary module with full, plain parameters on ``device`` (see [Note: giving the
    module back]). A collective: every rank of the sharding mesh must call it.

    Returns:
        The new plain parameter for each replaced sharded one, keyed by ``id`` of the sharded parameter, so that
        optimizers built on the shards can be pointed at the plain parameters.
    """
    units = [submodule for submodule in module.modules() if isinstance(submodule, FSDPModule)]
    for unit in units:
        # A unit built with reshard_after_forward=False still holds its gathered parameters after an evaluation
        # forward (no backward reshards them); only the sharded ones are described by FSDP's records below.
        unit.reshard()
    replaced: dict[int, nn.Parameter] = {}
    # Every unit's parameters gathered together, in a few collectives ([Note: gathering many shards at once]).
    sharded_parameters = [
        fsdp_parameter.sharded_param
        for unit in units
        for group in parameter_groups(unit._get_fsdp_state())
        for fsdp_parameter in group.fsdp_params
    ]
    whole_values = iter(full_tensors(sharded_parameters, device))
    for unit in units:
        state = unit._get_fsdp_state()
        for group in parameter_groups(state):
            for fsdp_parameter in group.fsdp_params:
                sharded = fsdp_parameter.sharded_param
                plain = nn.Parameter(next(whole_values), requires_grad=sharded.requires_grad)
                info = fsdp_parameter._module_info
                owners = [
                    (info.module, info.param_name),
                    *zip(info.shared_modules, info.shared_param_names, strict=True),
                ]
                for owner, name in owners:
                    owner._parameters[name] = plain
                fsdp_parameter._post_load_hook_handle.remove()
                replaced[id(sharded)] = plain
            hook_handles = [
                *group._module_to_pre_save_state_dict_hook_handle.values(),
                *group._module_to_pre_load_state_dict_hook_handle.values(),
            ]
            for handle in hook_handles:
                handle.remove()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        for managed in getattr(state, "_modules", (unit,)):
            _module_state_mapping.pop(managed, None)
            _forget_composable_api(managed, "fully_shard", state)
            # FSDP<Class> derives from (FSDPModule, Class): the original class is the one after FSDPModule.
            bases = type(managed).__bases__
            if len(bases) == 2 and bases[0] is FSDPModule:
                managed.__class__ = bases[1]
    for submodule in module.modules():
        for marker in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            submodule.__dict__.pop(marker, None)
        if _applied_composable_apis(submodule).get("checkpoint") is not None:
            # Outside the strategy the module behaves as built: no recomputation in backward.
            if checkpoint.state(submodule).enable_hook:
                checkpoint.state(submodule).enable_hook = False
                unshow(submodule, ACTIVATION_CHECKPOINTING)
    return replaced


def parameter_groups(state: Any) -> list[Any]:
    """The FSDP parameter groups of a unit's state, under the attribute of whichever torch is installed."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)  # torch before per-parameter meshes (2.11 has this one)
    return [group] if group is not None else []


def _applied_composable_apis(module: nn.Module) -> dict[str, Any]:
    return module.__dict__.get(REGISTRY_KEY) or {}


def _forget_composable_api(module: nn.Module, name: str, state: Any) -> None:
    """Drop the registry entry and state ``fully_shard`` (via ``contract``) stored on the module."""
    _applied_composable_apis(module).pop(name, None)
    states = module.__dict__.get(STATE_KEY) or {}
    for key in [key for key, value in states.items() if value is state]:
        del states[key]
