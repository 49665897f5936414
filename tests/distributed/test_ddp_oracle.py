"""colossal_ddp against the single-process oracle: losses and parameters after several optimizer steps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_colossal import ColossalDDPStrategy, ColossalPrecision, LossScalerConfig
from tests.distributed.oracle import (
    RegressionModule,
    assert_matches_oracle,
    float_state,
    new_module,
    oracle_train,
    quiet_trainer,
    step_losses_from_ranks,
    train_and_record,
)

STEPS = 4


def train_ddp_body(
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    strategy = ColossalDDPStrategy(**(strategy_kwargs or {}))
    return train_and_record(strategy, steps, accumulate, clip, clip_algorithm, precision)


@pytest.mark.parametrize(
    ("accumulate", "clip", "clip_algorithm"),
    [(1, None, "norm"), (2, 0.05, "norm"), (2, 0.01, "value")],
    ids=["plain", "accumulate2-clip-norm", "accumulate2-clip-value"],
)
def test_fp32_matches_oracle(rank_pool_2, accumulate, clip, clip_algorithm):
    results = rank_pool_2.run(train_ddp_body, STEPS, accumulate, clip, clip_algorithm)
    oracle = oracle_train(
        world_size=2,
        steps=STEPS,
        accumulate=accumulate,
        clip_norm=clip if clip_algorithm == "norm" else None,
        clip_value=clip if clip_algorithm == "value" else None,
    )
    assert_matches_oracle(results, oracle, accumulate, rtol=1e-5, atol=1e-6)
    initial = float_state(new_module())
    moved = max((results[0]["parameters"][name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-3, "the parameters did not train: the comparison would prove nothing"


def test_fp32_four_ranks_with_accumulation(rank_pool_4):
    results = rank_pool_4.run(train_ddp_body, 2, 2, 0.05)
    assert_matches_oracle(results, oracle_train(world_size=4, steps=2, accumulate=2, clip_norm=0.05), 2, 1e-5, 1e-6)


def test_bf16_mixed_matches_oracle_loosely(rank_pool_2):
    results = rank_pool_2.run(train_ddp_body, STEPS, 2, None, "norm", "bf16-mixed")
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, autocast_dtype=torch.bfloat16)
    assert_matches_oracle(results, oracle, 2, rtol=2e-2, atol=2e-3)
    assert results[0]["parameters"]["model.input.weight"].dtype == torch.float32


def test_bf16_true_keeps_bf16_weights_and_matches_a_bf16_oracle(rank_pool_2):
    results = rank_pool_2.run(train_ddp_body, STEPS, 1, None, "norm", "bf16-true")
    oracle = oracle_train(world_size=2, steps=STEPS, parameter_dtype=torch.bfloat16)
    # float_state() upcasts for comparison; bf16 weights after a few Adam steps agree to bf16 resolution.
    assert_matches_oracle(results, oracle, 1, rtol=2e-2, atol=1e-2)


class ManualModule(RegressionModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        optimizer = self.optimizers()
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.model(inputs), targets)
        self.micro_batch_losses.append(loss.detach().item())
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer.step()
        return loss


def manual_optimization_body() -> dict[str, Any]:
    from lightning.pytorch import seed_everything

    from tests.distributed.oracle import MODEL_SEED

    seed_everything(MODEL_SEED, verbose=False)
    module = ManualModule()
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=torch.distributed.get_world_size(), max_steps=STEPS)
    trainer.fit(module)
    return {"losses": module.micro_batch_losses, "parameters": float_state(module)}


def test_manual_optimization_matches_oracle(rank_pool_2):
    results = rank_pool_2.run(manual_optimization_body)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS, clip_norm=0.05), 1, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_gradient_compression_is_wired_into_training(rank_pool_2, compression):
    strategy_kwargs = {"gradient_compression": compression}
    results = rank_pool_2.run(train_ddp_body, STEPS, 1, None, "norm", "32-true", strategy_kwargs)
    exact = oracle_train(world_size=2, steps=STEPS)
    losses = step_losses_from_ranks([result["losses"] for result in results], 1)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(exact.step_losses), rtol=2e-2, atol=2e-3)
    # Half-precision reduction must leave a trace; if training matched fp32 bit for bit the hook was not used.
    assert any(not torch.equal(results[0]["parameters"][name], exact.parameters[name]) for name in exact.parameters)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)


def compressed_gradients_body(dtype_name: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_colossal.distributed.compression import compressed_all_reduce_hook
    from tests.distributed.oracle import make_dataset

    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    module = new_module()
    inputs, targets = make_dataset().tensors
    shards = [(inputs[r::world_size][:8], targets[r::world_size][:8]) for r in range(world_size)]
    exact_losses = [torch.nn.functional.mse_loss(module.model(x), y) for x, y in shards]
    torch.stack(exact_losses).mean().backward()
    exact = {name: param.grad.clone() for name, param in module.named_parameters()}
    module.zero_grad(set_to_none=True)
    wrapped = DistributedDataParallel(module.model)
    wrapped.register_comm_hook(None, compressed_all_reduce_hook(getattr(torch, dtype_name)))
    torch.nn.functional.mse_loss(wrapped(shards[rank][0]), shards[rank][1]).backward()
    reduced = {name: param.grad.clone() for name, param in module.named_parameters()}
    return reduced, exact


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_compression_hook_averages_within_half_precision(rank_pool_2, dtype_name):
    epsilon = torch.finfo(getattr(torch, dtype_name)).eps
    for reduced, exact in rank_pool_2.run(compressed_gradients_body, dtype_name):
        for name in exact:
            # Each rank's share is rounded before the sum, so the error scales with the summands' magnitude, not
            # with the (possibly cancelling) result: bound it by a few epsilons of the tensor's largest gradient.
            bound = 4 * epsilon * exact[name].abs().max().item()
            torch.testing.assert_close(reduced[name], exact[name], rtol=0, atol=bound, msg=name)
        assert any(not torch.equal(reduced[name], exact[name]) for name in exact), "no rounding: hook not applied?"


def fp16_overflow_body(overflow_at_step: int) -> dict[str, Any]:
    world_size = torch.distributed.get_world_size()
    module = new_module(overflow_at_step=overflow_at_step)
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=1024.0, hysteresis=1))
    trainer = quiet_trainer(strategy=ColossalDDPStrategy(), devices=world_size, max_steps=STEPS, plugins=[plugin])
    trainer.fit(module)
    scaler = plugin.loss_scaler
    assert scaler is not None
    return {
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
        "skipped": scaler.skipped_steps,
        "scale": scaler.scale,
        "checkpoint_state": plugin.state_dict(),
    }


def test_fp16_overflow_on_one_rank_skips_exactly_that_step_everywhere(rank_pool_2):
    results = rank_pool_2.run(fp16_overflow_body, 1)
    for result in results:
        assert result["skipped"] == 1
        assert result["scale"] == 512.0  # backed off once (hysteresis=1)
        assert result["checkpoint_state"]["loss_scaler"]["skipped_steps"] == 1
    # Lightning counts a skipped step as a step, so four steps ran with the second one skipped.
    oracle = oracle_train(world_size=2, steps=STEPS, autocast_dtype=torch.float16, skip_steps=(1,))
    torch.testing.assert_close(results[0]["parameters"], oracle.parameters, rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)


def overflow_vote_body() -> bool:
    rank = torch.distributed.get_rank()
    plugin = ColossalPrecision("16-mixed", LossScalerConfig(initial_scale=2.0))
    weight = torch.nn.Parameter(torch.ones(2))
    weight.grad = torch.tensor([float("nan"), 1.0]) if rank == 1 else torch.tensor([1.0, 1.0])
    return plugin.unscale_and_check(torch.optim.SGD([weight], lr=0.1))


def test_overflow_on_one_rank_is_seen_by_every_rank(rank_pool_2):
    # Sharded engines see different gradient pieces per rank; the vote must be global (see precision.py).
    assert rank_pool_2.run(overflow_vote_body) == [True, True]
