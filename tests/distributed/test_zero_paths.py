"""ZeRO paths beyond the basic oracle runs: the NCCL-style collectives on gloo, bf16 weights with fp32 masters,
and parameters that get no gradient."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_colossal import ZeroStrategy
from lightning_colossal.checkpoint.consolidate import read_sharded
from tests.distributed.oracle import (
    RegressionModule,
    float_state,
    new_module,
    oracle_train,
    quiet_trainer,
    step_losses_from_ranks,
    train_and_record,
)

STEPS = 4


def train_body(strategy_kwargs: dict[str, Any], accumulate: int = 1) -> dict[str, Any]:
    return train_and_record(ZeroStrategy(**strategy_kwargs), STEPS, accumulate, clip=0.05)


@pytest.mark.parametrize("communication", ["all_reduce", "scatter_gather"])
@pytest.mark.parametrize("stage", [1, 2])
def test_both_collective_routes_match_oracle(rank_pool_2, stage, communication):
    # The default route is reduce-scatter + all-gather (point-to-point on gloo); the all-reduce route is the setting.
    kwargs = {"stage": stage, "communication": communication, "bucket_size_mb": 0.001}
    results = rank_pool_2.run(train_body, kwargs, 2)
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_norm=0.05)
    losses = step_losses_from_ranks([result["losses"] for result in results], 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(oracle.step_losses), rtol=1e-5, atol=1e-6)
    for result in results:
        torch.testing.assert_close(result["parameters"], oracle.parameters, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("communication", ["all_reduce", "scatter_gather"])
def test_four_ranks_with_empty_shards(rank_pool_4, communication):
    results = rank_pool_4.run(train_body, {"stage": 2, "communication": communication}, 1)
    oracle = oracle_train(world_size=4, steps=STEPS, clip_norm=0.05)
    for result in results:
        torch.testing.assert_close(result["parameters"], oracle.parameters, rtol=1e-5, atol=1e-6)


def bf16_true_body(path: str) -> dict[str, Any]:
    module = new_module()
    trainer = quiet_trainer(
        strategy=ZeroStrategy(stage=2),
        devices=torch.distributed.get_world_size(),
        max_steps=STEPS,
        precision="bf16-true",
    )
    trainer.fit(module)
    trainer.save_checkpoint(path)
    engine = trainer.strategy.engine
    masters = {
        member.name: master.detach().clone() for member, master in zip(engine.members, engine.masters, strict=True)
    }
    return {
        "parameters": float_state(module),
        "parameter_dtype": str(module.model.input.weight.dtype),
        "masters": masters,
        "master_bytes": engine.memory_report().master_bytes,
    }


def test_bf16_true_steps_fp32_masters_and_saves_them(rank_pool_2, tmp_path):
    path = str(tmp_path / "bf16.ckpt")
    results = rank_pool_2.run(bf16_true_body, path)
    assert results[0]["parameter_dtype"] == "torch.bfloat16"
    assert results[0]["master_bytes"] > 0, "bf16 parameters need separate fp32 masters"
    oracle = oracle_train(world_size=2, steps=STEPS, parameter_dtype=torch.bfloat16, clip_norm=None)
    torch.testing.assert_close(results[0]["parameters"], oracle.parameters, rtol=2e-2, atol=1e-2)
    saved = read_sharded(path, keys={"model"})["model"]
    assert saved["model.input.weight"].dtype == torch.float32, "the checkpoint must hold the fp32 masters"
    # Rank r's master rows are exactly the saved rows r*k .. (r+1)*k: the masters, not the rounded parameters.
    weight = saved["model.input.weight"]
    rows = (weight.shape[0] + 1) // 2
    torch.testing.assert_close(results[0]["masters"]["model.input.weight"], weight[:rows], rtol=0, atol=0)
    torch.testing.assert_close(results[1]["masters"]["model.input.weight"], weight[rows:], rtol=0, atol=0)
    assert not torch.equal(weight.to(torch.bfloat16).float(), weight), "masters carry more precision than bf16"


def tied_bf16_true_body(path: str) -> None:
    module = new_module()
    module.model.hidden_alias = module.model.hidden  # one weight under two names, as a tied embedding and head
    trainer = quiet_trainer(
        strategy=ZeroStrategy(stage=2), devices=torch.distributed.get_world_size(), max_steps=2, precision="bf16-true"
    )
    trainer.fit(module)
    trainer.save_checkpoint(path)


def test_bf16_true_checkpoint_holds_a_tied_weight_once_precise_under_every_name(rank_pool_2, tmp_path):
    path = str(tmp_path / "tied.ckpt")
    rank_pool_2.run(tied_bf16_true_body, path)
    saved = read_sharded(path, keys={"model"})["model"]
    weight, alias = saved["model.hidden.weight"], saved["model.hidden_alias.weight"]
    assert weight.dtype == alias.dtype == torch.float32
    assert not torch.equal(weight.to(torch.bfloat16).float(), weight), "the fp32 master, not the bf16 weight"
    torch.testing.assert_close(alias, weight, rtol=0, atol=0)


class UnusedBranchModule(RegressionModule):
    """Adds a layer that gets no gradient: never (``everywhere``) or on every rank but 0 (``rank_zero_only``)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.extra = nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        prediction = self.model(inputs)
        if self.mode == "rank_zero_only" and self.global_rank == 0:
            prediction = prediction + 0.01 * self.extra(inputs)
        loss = nn.functional.mse_loss(prediction, targets)
        self.micro_batch_losses.append(loss.detach().item())
        return loss


def unused_body(stage: int, mode: str) -> dict[str, Any]:
    from lightning.pytorch import seed_everything

    from tests.distributed.oracle import MODEL_SEED

    seed_everything(MODEL_SEED, verbose=False)
    module = UnusedBranchModule(mode)
    # Tiny buckets: the unused layer sits in a bucket of its own between used ones.
    strategy = ZeroStrategy(stage=stage, bucket_size_mb=0.0001)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=STEPS)
    trainer.fit(module)
    return {"parameters": float_state(module), "losses": module.micro_batch_losses}


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("mode", ["everywhere", "rank_zero_only"])
def test_parameters_without_gradient_neither_hang_nor_desynchronise(rank_pool_2, stage, mode):
    results = rank_pool_2.run(unused_body, stage, mode, timeout=60)
    torch.testing.assert_close(results[0]["parameters"], results[1]["parameters"], rtol=0, atol=0)
    if mode == "everywhere":
        # The used parameters train exactly like the oracle (the unused layer does not touch them).
        oracle = oracle_train(world_size=2, steps=STEPS)
        used = {name: tensor for name, tensor in results[0]["parameters"].items() if not name.startswith("extra.")}
        torch.testing.assert_close(used, oracle.parameters, rtol=1e-5, atol=1e-6)


def tied_gpt_body(strategy_name: str, stage: int) -> dict[str, torch.Tensor]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal import ColossalDDPStrategy
    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    module = GPTLightningModule(
        vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=32, tie_weights=True, warmup_steps=2
    )
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=5), batch_size=4)
    strategy = ColossalDDPStrategy() if strategy_name == "ddp" else ZeroStrategy(stage=stage)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=6)
    trainer.fit(module, train_dataloaders=loader)
    assert module.model is not None
    assert module.model.lm_head.weight is module.model.token_embedding.weight
    return float_state(module)


@pytest.mark.parametrize("stage", [1, 2])
def test_tied_weights_train_like_ddp(rank_pool_2, stage):
    # The tied embedding/LM-head weight is one parameter with two names: sharded once, gradient from both uses.
    reference = rank_pool_2.run(tied_gpt_body, "ddp", 0)[0]
    results = rank_pool_2.run(tied_gpt_body, "zero", stage)
    torch.testing.assert_close(results[0], reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1], results[0], rtol=0, atol=0)
