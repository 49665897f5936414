"""The pieces ZeRO and Gemini share in ``distributed/``: rank-major staging copies, the optimizer takeover checks,
windows of the meta initialisation, and the per-backend choice of collectives (single process, no process group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from lightning_colossal.distributed import collectives
from lightning_colossal.engine_parts import optimizer_takeover
from lightning_colossal.engine_parts.meta_init import plan_windows
from lightning_colossal.engine_parts.rows import shard_spec
from lightning_colossal.engine_parts.staging import (
    copy_out_of_flat,
    own_rows_into_whole,
    rows_from_slots,
    rows_into_slots,
)

SHAPES = [(5, 3), (1, 4), (7,), (), (0, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
def test_rows_go_into_their_rank_slots_and_back(world_size, shape):
    whole = torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    spec = shard_spec(shape, world_size, rank=0)
    offset = 2  # another parameter's place in front
    slots = torch.zeros(world_size, offset + spec.slot_numel)
    rows_into_slots(whole.reshape(-1), spec, slots, offset)
    for rank in range(world_size):
        own = shard_spec(shape, world_size, rank)
        expected = whole.reshape(-1) if own.replicated else whole[own.row_start : own.row_end].reshape(-1)
        assert torch.equal(slots[rank, offset : offset + own.local_numel], expected)
    back = torch.zeros(whole.numel())
    rows_from_slots(slots, offset, spec, back)
    assert torch.equal(back, whole.reshape(-1))


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES)
def test_own_rows_of_every_rank_sum_to_the_whole(world_size, shape):
    whole = torch.randn(shape)
    total = torch.zeros(whole.numel())
    for rank in range(world_size):
        spec = shard_spec(shape, world_size, rank)
        buffer = torch.zeros(whole.numel())
        own = whole if spec.replicated else whole[spec.row_start : spec.row_end]
        own_rows_into_whole(own, spec, buffer)
        total += buffer
    # A replicated value is written by rank 0 only, so the sum holds it once.
    assert torch.equal(total, whole.reshape(-1))


def test_copy_out_of_flat_fills_each_tensor_with_its_piece():
    tensors = [torch.zeros(2, 2), torch.zeros(3), torch.zeros(())]
    copy_out_of_flat(torch.arange(8.0), tensors)
    assert tensors[0].tolist() == [[0, 1], [2, 3]] and tensors[1].tolist() == [4, 5, 6] and tensors[2].item() == 7


def test_windows_close_when_full_and_big_items_get_their_own():
    assert plan_windows([], 10) == []
    assert plan_windows([4, 4, 4, 30, 1], 10) == [[0, 1], [2], [3], [4]]
    assert plan_windows([10, 1], 10) == [[0], [1]]


def test_communication_setting_picks_scatter_gather_unless_all_reduce_is_forced():
    assert collectives.use_scatter_gather("auto")
    assert not collectives.use_scatter_gather("all_reduce")
    assert collectives.use_scatter_gather("scatter_gather")


@pytest.mark.parametrize("scatter", [False, True])
def test_own_slot_alone_is_the_whole_buffer(scatter):
    slots = torch.arange(4.0)
    work, own = collectives.reduce_own_slot_async(slots, None, scatter=scatter)
    assert work is None and torch.equal(own, slots)
    assert (own.data_ptr() == slots.data_ptr()) is not scatter, "all-reduce keeps a view, reduce-scatter a copy"


def _model_and_optimizer(**options):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    model[0].requires_grad_(False)
    return model, torch.optim.Adam(model.parameters(), lr=0.1, **options)


def test_takeover_refuses_what_is_not_an_optimizer():
    with pytest.raises(TypeError, match="ZeRO shards a torch.optim.Optimizer; got list"):
        optimizer_takeover.check_optimizer([], "ZeRO")


@pytest.mark.parametrize("name", sorted(optimizer_takeover.WHOLE_PARAMETER_OPTIMIZERS))
def test_takeover_refuses_optimizers_that_need_whole_parameters(name):
    optimizer_class = getattr(torch.optim, name, None)
    if optimizer_class is None:
        pytest.skip(f"this torch has no torch.optim.{name}")
    optimizer = optimizer_class([nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match=rf"ZeRO steps each rank's rows .* but {name} .* `colossal_ddp`"):
        optimizer_takeover.check_optimizer(optimizer, "ZeRO")


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "RMSprop", "Adagrad", "Adamax", "NAdam", "RAdam", "Rprop"])
def test_takeover_accepts_elementwise_optimizers(name):
    optimizer = getattr(torch.optim, name)([nn.Parameter(torch.zeros(4, 4))], lr=0.1)
    assert optimizer_takeover.check_optimizer(optimizer, "ZeRO") is optimizer


def test_takeover_refuses_foreign_tensors_with_the_fix():
    model, _ = _model_and_optimizer()
    optimizer = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match=r"1 tensor\(s\) that are not parameters of the model: build it"):
        optimizer_takeover.held_parameters(optimizer, model)


def test_takeover_refuses_an_optimizer_that_stepped_with_the_fix():
    model, optimizer = _model_and_optimizer()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="already has state.*fresh optimizer"):
        optimizer_takeover.held_parameters(optimizer, model)


def test_accelerator_only_options_are_refused_when_steps_run_on_the_cpu():
    _, optimizer = _model_and_optimizer()
    optimizer.param_groups[0]["capturable"] = True
    with pytest.raises(ValueError, match=r"capturable=True\) steps only on an accelerator, but X: drop .* or Y\."):
        optimizer_takeover.refuse_accelerator_only_options(optimizer, cpu_steps="X", fix=" or Y")

    class Custom(torch.optim.SGD):
        pass

    custom = Custom(nn.Linear(1, 1).parameters(), lr=0.1)
    custom.param_groups[0]["fused"] = True
    with pytest.raises(ValueError, match=r"Custom\(fused=True\) has no CPU kernel"):
        optimizer_takeover.refuse_accelerator_only_options(custom, cpu_steps="X", fix="")
    optimizer_takeover.refuse_accelerator_only_options(custom, cpu_steps="X", fix="", fused=False)


def test_swap_replaces_parameters_and_drops_frozen_ones():
    model, optimizer = _model_and_optimizer()
    held = optimizer_takeover.held_parameters(optimizer, model)
    assert held == {id(parameter) for parameter in model.parameters()}
    masters = {id(parameter): parameter.detach().clone() for parameter in model[1].parameters()}
    optimizer_takeover.swap_parameters(optimizer, masters)
    assert [id(tensor) for tensor in optimizer.param_groups[0]["params"]] == [id(m) for m in masters.values()]


@pytest.mark.parametrize("name", optimizer_takeover.STEP_EACH_PARAMETER_ALONE)
def test_optimizers_that_step_each_parameter_alone_give_whole_step_values_in_pieces(name):
    # The promise the overlapped ZeRO exchange rests on: two narrowed steps equal one whole step, bit for bit.
    torch.manual_seed(0)
    weights = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2)]
    gradients = [[torch.randn_like(weight) for weight in weights] for _ in range(3)]
    results = []
    for in_pieces in (False, True):
        parameters = [nn.Parameter(weight.clone()) for weight in weights]
        optimizer = getattr(torch.optim, name)(
            [{"params": parameters[:2]}, {"params": parameters[2:], "lr": 0.05}], lr=0.1
        )
        assert optimizer_takeover.steps_each_parameter_alone(optimizer)
        for step_gradients in gradients:
            for parameter, gradient in zip(parameters, step_gradients, strict=True):
                parameter.grad = gradient.clone()
            if in_pieces:
                for piece in ({id(parameters[0]), id(parameters[2])}, {id(parameters[1])}):
                    with optimizer_takeover.narrowed_to(optimizer, piece):
                        optimizer.step()
                assert [len(group["params"]) for group in optimizer.param_groups] == [2, 1]
            else:
                optimizer.step()
        results.append([parameter.detach().clone() for parameter in parameters])
    for whole, pieces in zip(*results, strict=True):
        assert torch.equal(whole, pieces)
    assert not torch.equal(results[0][0], weights[0])


def test_optimizers_with_step_hooks_or_their_own_step_are_stepped_whole():
    parameters = [nn.Parameter(torch.zeros(2))]
    hooked = torch.optim.SGD(parameters, lr=0.1)
    hooked.register_step_post_hook(lambda *arguments: None)
    assert not optimizer_takeover.steps_each_parameter_alone(hooked)

    class OwnStep(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    class SameStep(torch.optim.AdamW):
        pass

    assert not optimizer_takeover.steps_each_parameter_alone(OwnStep(parameters))
    assert optimizer_takeover.steps_each_parameter_alone(SameStep(parameters))
    assert not optimizer_takeover.steps_each_parameter_alone(torch.optim.LBFGS(parameters))
    handle = register_optimizer_step_pre_hook(lambda *arguments: None)
    try:
        assert not optimizer_takeover.steps_each_parameter_alone(torch.optim.SGD(parameters, lr=0.1))
    finally:
        handle.remove()
