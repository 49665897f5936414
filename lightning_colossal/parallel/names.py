"""The whole model's parameter names and shapes, read before the model is split and kept across splitting.

[Note: names survive parallelisation]
Policies replace modules under their original attribute names and pipeline pruning replaces unused layers by
``nn.Identity`` (keeping indices) and drops the embedding/head attributes, so every parameter this rank still
holds has the name it had in the user's model. Checkpoints store each tensor-parallel shard as a DTensor of the
whole parameter under that name; DCP assembles and re-cuts them for any other layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ParameterNames:
    """What the unsplit model called and shaped each parameter (see [Note: names survive parallelisation]).

    Attributes:
        whole_model_keys: every weight name of the whole model (pipeline ranks hold only some of them).
        whole_parameter_order: position of each parameter (by canonical name) in the whole model's order.
        names_of: every name of each parameter this rank holds, keyed by ``id(parameter)``; the first is its
            canonical name (a weight tied across modules has several).
        full_shapes: the whole (unsplit) shape of each parameter this rank holds, keyed by ``id(parameter)``.
    """

    whole_model_keys: list[str]
    whole_parameter_order: dict[str, int]
    names_of: dict[int, list[str]]
    full_shapes: dict[int, torch.Size]

    @classmethod
    def of_whole_model(cls, root: nn.Module) -> ParameterNames:
        """Read before any policy runs, while ``root`` is still the user's whole model."""
        names_of = _names_by_parameter(root)
        return cls(
            whole_model_keys=list(root.state_dict().keys()),
            whole_parameter_order={name: index for index, (name, _) in enumerate(root.named_parameters())},
            names_of=names_of,
            full_shapes={key: root.get_parameter(names[0]).shape for key, names in names_of.items()},
        )

    def rekey_after_replacement(self, root: nn.Module) -> None:
        """Policies created new parameters under the old names: key the names and whole shapes by the new ones."""
        shapes_by_name = {names[0]: self.full_shapes[key] for key, names in self.names_of.items()}
        self.names_of = _names_by_parameter(root)
        self.full_shapes = {
            key: shapes_by_name.get(names[0], root.get_parameter(names[0]).shape)
            for key, names in self.names_of.items()
        }

    def canonical_name(self, parameter: nn.Parameter, local_name: str) -> str:
        """The first name ``parameter`` had in the whole model (``local_name`` for one it never held)."""
        return self.names_of.get(id(parameter), [local_name])[0]


def _names_by_parameter(root: nn.Module) -> dict[int, list[str]]:
    names: dict[int, list[str]] = {}
    for name, parameter in root.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
    return names


def key_of(root: nn.Module, name: str) -> int:
    """``id`` of the parameter (or buffer) called ``name`` in ``root``."""
    module_name, _, attribute = name.rpartition(".")
    module = root.get_submodule(module_name) if module_name else root
    return id(getattr(module, attribute))
