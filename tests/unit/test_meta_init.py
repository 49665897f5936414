"""Windowed initialisation of meta-device models (engine_parts/meta_init.py): values, windows, unset tensors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_colossal.engine_parts.meta_init import initialise_in_windows


class Net(nn.Module):
    def __init__(self, with_computed_buffer: bool = False) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16)
        self.second = nn.Linear(16, 4)
        if with_computed_buffer:
            self.register_buffer("scale", torch.arange(4.0))  # computed here, never by reset_parameters

    def reset_parameters(self) -> None:
        for layer in (self.first, self.second):
            nn.init.normal_(layer.weight, std=0.02)
            nn.init.zeros_(layer.bias)


def _initialised(window_bytes: int, wanted=lambda names: True) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        template = Net()
    values: dict[str, torch.Tensor] = {}

    def keep(names, whole):
        for name in names:
            values[name] = whole.clone()

    torch.manual_seed(3)
    initialise_in_windows(template, wanted, keep, torch.device("cpu"), window_bytes)
    return values


def test_windows_give_the_eager_values_whatever_their_size():
    # Eager reference whose only draws are reset_parameters' (built on meta, as the demo GPT builds its layers).
    with torch.device("meta"):
        eager = Net()
    eager.to_empty(device="cpu")
    torch.manual_seed(3)
    eager.reset_parameters()
    for window_bytes in (1, 100, 2**30):
        values = _initialised(window_bytes)
        assert set(values) == set(eager.state_dict())
        for name, expected in eager.state_dict().items():
            assert torch.equal(values[name], expected), (window_bytes, name)


def test_unwanted_tensors_are_drawn_but_not_kept():
    all_values = _initialised(2**30)
    only_second = _initialised(2**30, wanted=lambda names: names[0].startswith("second"))
    assert set(only_second) == {"second.weight", "second.bias"}
    assert torch.equal(only_second["second.weight"], all_values["second.weight"])


def test_a_tensor_the_initialiser_never_sets_is_named():
    with torch.device("meta"):
        template = Net(with_computed_buffer=True)
    with pytest.raises(ValueError, match="'scale'.*does not set it"):
        initialise_in_windows(copy.deepcopy(template), lambda names: True, lambda *_: None, torch.device("cpu"), 2**30)


def test_a_model_without_an_initialiser_is_refused():
    with torch.device("meta"):
        bare = nn.Sequential(nn.ReLU())
        bare.register_parameter("weight", nn.Parameter(torch.empty(2)))
    with pytest.raises(ValueError, match="reset_parameters"):
        initialise_in_windows(bare, lambda names: True, lambda *_: None, torch.device("cpu"), 2**30)
