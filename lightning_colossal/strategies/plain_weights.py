"""Giving an FSDP-sharded LightningModule back with plain, whole parameters at the end of a run, and pointing its
optimizers at them ([Note: what the module holds after a run] in ``strategies/fsdp.py``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_colossal.fsdp import full_tensors, unshard_model
from lightning_colossal.strategies.optimizers import unwrap_optimizer


def give_back_plain_weights(
    module: torch.nn.Module, optimizers: Iterable[Optimizer], names_before_sharding: Mapping[int, str]
) -> None:
    """Unshard ``module`` into full plain parameters on the CPU and point ``optimizers`` at them (a collective).

    Args:
        names_before_sharding: the module's parameter names by ``id`` of its parameters before sharding, for the
            optimizers of an earlier fit, which still hold those.
    """
    sharded_names = {id(parameter): name for name, parameter in module.named_parameters()}
    host = torch.device("cpu")
    replaced = unshard_model(module, host)
    plain_by_name = dict(module.named_parameters())
    known_names = {**names_before_sharding, **sharded_names}
    for optimizer in optimizers:
        point_optimizer_at(unwrap_optimizer(optimizer), replaced, known_names, plain_by_name, host)


@torch.no_grad()
def point_optimizer_at(
    optimizer: Optimizer,
    replaced: Mapping[int, torch.nn.Parameter],
    known_names: Mapping[int, str],
    plain_by_name: Mapping[str, torch.nn.Parameter],
    device: torch.device | None = None,
) -> None:
    """Make ``optimizer`` hold the module's new plain parameters, with its DTensor state gathered whole (onto
    ``device``; None: where it is gathered).

    A parameter is found by identity among the replaced shards, else by its name before sharding (an optimizer of an
    earlier fit, during a later validate/test/predict run). Gathering is a collective: every rank walks the same
    parameters in the same order (param groups, then each parameter's state keys sorted), and the state is gathered
    in a few collectives ([Note: gathering many shards at once] in ``fsdp/whole.py``).
    """
    old_state = optimizer.state
    new_state: dict[Tensor, dict[str, Any]] = {}
    gathered: list[tuple[dict[str, Any], str, Any]] = []  # (new entry, key, the sharded value)
    for group in optimizer.param_groups:
        new_parameters = []
        for parameter in group["params"]:
            plain = replaced.get(id(parameter))
            if plain is None and id(parameter) in known_names:
                plain = plain_by_name.get(known_names[id(parameter)])
            plain = parameter if plain is None else plain
            new_parameters.append(plain)
            entry = old_state.get(parameter)
            if entry is not None:
                new_entry = new_state[plain] = {}
                gathered += [(new_entry, key, entry[key]) for key in sorted(entry)]
        group["params"] = new_parameters
    whole = iter(full_tensors([value for _, _, value in gathered if isinstance(value, Tensor)], device))
    for new_entry, key, value in gathered:
        new_entry[key] = next(whole) if isinstance(value, Tensor) else value
    old_state.clear()
    old_state.update(new_state)
