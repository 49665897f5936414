"""Converting optimizer state between torch's position-keyed format and our name-keyed format.

``torch.optim.Optimizer.state_dict()`` keys state by the position of a parameter in ``param_groups``; that breaks
as soon as two strategies (or two world sizes) order or shard parameters differently. The portable format keys
state by parameter *name*, exactly like ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict``:
``{"state": {name: {key: value}}, "param_groups": [{..., "params": [name, ...]}]}``.

Both functions need the *names in optimizer order*: for each param group, the names of its parameters in order.
Strategies get them from the live optimizer through ``get_optimizer_state_dict`` so that they agree with torch's own
naming (tied weights, wrapped modules).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any


def rekey_by_name(position_keyed: dict[str, Any], names_by_group: Sequence[Sequence[str]]) -> dict[str, Any]:
    """Turn a ``torch.optim.Optimizer.state_dict()`` into the name-keyed format.

    Args:
        position_keyed: ``{"state": {position: {...}}, "param_groups": [{"params": [position, ...], ...}]}``.
        names_by_group: the parameter names of the optimizer that will load the result, per group, in order.

    Raises:
        ValueError: the saved optimizer has a different number of groups or parameters per group.
    """
    saved_groups = position_keyed["param_groups"]
    if len(saved_groups) != len(names_by_group):
        raise ValueError(
            f"The checkpoint's optimizer has {len(saved_groups)} parameter groups but this run's has"
            f" {len(names_by_group)}: make `configure_optimizers` build the same parameter groups as the run that"
            " saved the checkpoint, or load only the weights (`LightningModule.load_state_dict`)."
        )
    saved_state = position_keyed.get("state", {})
    state: dict[str, Any] = {}
    param_groups: list[dict[str, Any]] = []
    for group_index, (saved_group, names) in enumerate(zip(saved_groups, names_by_group, strict=True)):
        positions = saved_group["params"]
        if len(positions) != len(names):
            raise ValueError(
                f"Parameter group {group_index} of the checkpoint's optimizer has {len(positions)} parameters but this"
                f" run's has {len(names)}: the model or `configure_optimizers` differs from the run that saved it."
            )
        for position, name in zip(positions, names, strict=True):
            if position in saved_state:
                state[name] = saved_state[position]
        group = {key: copy.deepcopy(value) for key, value in saved_group.items() if key != "params"}
        group["params"] = list(names)
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}


def rekey_by_position(name_keyed: dict[str, Any]) -> dict[str, Any]:
    """Turn the name-keyed format into ``torch.optim.Optimizer.state_dict()`` format (positions in group order)."""
    state: dict[int, Any] = {}
    param_groups: list[dict[str, Any]] = []
    position = 0
    saved_state = name_keyed.get("state", {})
    for saved_group in name_keyed["param_groups"]:
        positions: list[int] = []
        for name in saved_group["params"]:
            if name in saved_state:
                state[position] = saved_state[name]
            positions.append(position)
            position += 1
        group = {key: value for key, value in saved_group.items() if key != "params"}
        group["params"] = positions
        param_groups.append(group)
    return {"state": state, "param_groups": param_groups}
