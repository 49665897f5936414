"""The host step with torch's fused kernel (``engine_parts/optimizer_takeover.py`` [Note: the host step runs torch's
fused kernel]): which groups take it, that it is in force during the step only, and that its values agree with the
loop torch would run otherwise."""

from __future__ import annotations

import pytest
import torch

from lightning_colossal.engine_parts.optimizer_takeover import fused_host_step

GPU = torch.device("cuda", 0)  # the model computes on an accelerator: these host tensors are offloaded masters


def _fused_flags_seen_by_step(optimizer: torch.optim.Optimizer) -> list[object]:
    seen: list[object] = []
    original = type(optimizer).step

    def spy(self, *args, **kwargs):
        seen.extend(group["fused"] for group in self.param_groups)
        return original(self, *args, **kwargs)

    optimizer.step = spy.__get__(optimizer)  # type: ignore[method-assign]
    return seen


def test_only_host_groups_that_chose_no_implementation_take_the_fused_kernel():
    left_to_torch = torch.nn.Parameter(torch.randn(4))
    chose_foreach = torch.nn.Parameter(torch.randn(4))
    chose_loop = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.AdamW(
        [
            {"params": [left_to_torch]},
            {"params": [chose_foreach], "foreach": True},
            {"params": [chose_loop], "fused": False},
        ]
    )
    seen = _fused_flags_seen_by_step(optimizer)
    for parameter in (left_to_torch, chose_foreach, chose_loop):
        parameter.grad = torch.ones(4)
    with fused_host_step(optimizer, GPU):
        optimizer.step()
    assert seen == [True, None, False]
    # After the step the groups say what the user wrote: checkpoints and param_groups edits see no change.
    assert [group["fused"] for group in optimizer.param_groups] == [None, None, False]
    assert (
        "fused" in optimizer.state_dict()["param_groups"][0]
        and optimizer.state_dict()["param_groups"][0]["fused"] is None
    )


def test_a_model_computing_on_the_host_keeps_torch_s_own_step():
    """Nothing is offloaded: plain PyTorch on this machine steps with the loop, and the engines match it bit for bit."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.randn(4))])
    with fused_host_step(optimizer, torch.device("cpu")):
        assert optimizer.param_groups[0]["fused"] is None


def test_subclasses_and_other_optimizers_keep_their_own_step():
    class MyAdam(torch.optim.Adam):
        pass

    for optimizer in (
        MyAdam([torch.nn.Parameter(torch.randn(3))]),
        torch.optim.RMSprop([torch.nn.Parameter(torch.randn(3))]),
    ):
        with fused_host_step(optimizer, GPU):
            assert all(group.get("fused") is None for group in optimizer.param_groups)


def _train(optimizer_class, use_fused_host_step: bool, **settings) -> list[torch.Tensor]:
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(257, 33)), torch.nn.Parameter(torch.randn(1000))]
    optimizer = optimizer_class(parameters, **settings)
    for _ in range(5):
        for parameter in parameters:
            parameter.grad = torch.randn_like(parameter)
        if use_fused_host_step:
            with fused_host_step(optimizer, GPU):
                optimizer.step()
        else:
            optimizer.step()
    return [parameter.detach().clone() for parameter in parameters] + [
        value.clone() for state in optimizer.state.values() for value in state.values() if value.dim() > 0
    ]


@pytest.mark.parametrize(
    ("optimizer_class", "settings", "exact"),
    [
        (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, False),
        (torch.optim.Adam, {"lr": 1e-2, "amsgrad": True}, False),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}, True),
    ],
    ids=["adamw", "adam-amsgrad", "sgd-nesterov"],
)
def test_the_fused_step_agrees_with_the_loop_within_rounding(optimizer_class, settings, exact):
    loop = _train(optimizer_class, False, **settings)
    fused = _train(optimizer_class, True, **settings)
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(fused, loop, **tolerance)
