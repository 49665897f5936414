"""The engines on the route GPUs take: the backend's own reduce-scatter and all-gather instead of gloo's point-to-point
exchanges ([Note: the native route on gloo] in ``distributed/collectives.py``), checked against the oracle.

On gloo the engines send rows point to point, so without this the code every NCCL run executes (ZeRO-2's and
Gemini's reduce-scatter and all-gather, FSDP2's own collectives) would never run on CPU. Each body first checks that
the route really changed (``sends_directly`` is false), then trains as the ordinary oracle tests do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, seed_everything
from torch import nn
from torch.utils.data import DataLoader

from lightning_colossal import StaticPlacement, ZeroStrategy
from lightning_colossal.distributed import collectives
from tests.distributed.oracle import assert_matches_oracle, oracle_train, quiet_trainer
from tests.distributed.test_fsdp import train_fsdp_body
from tests.distributed.test_gemini_oracle import PLACEMENTS, train_gemini_body
from tests.distributed.test_zero_oracle import train_zero_body

STEPS = 4
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BODIES: dict[str, Callable[..., dict[str, Any]]] = {
    "zero": train_zero_body,
    "gemini": train_gemini_body,
    "fsdp": train_fsdp_body,
}


def on_native_route(body_name: str, *arguments: Any) -> dict[str, Any]:
    with collectives.native_route():
        assert not collectives.sends_directly(None), "the native route did not take effect"
        return BODIES[body_name](*arguments)


CASES = {
    "zero2": ("zero", 1, None, {"stage": 2}),
    "zero2-offload-clip-acc2": ("zero", 2, 0.05, {"stage": 2, "cpu_offload": True}),
    # Tiny buckets: the step goes bucket by bucket with NCCL's all-gathers of rank-major buffers in flight beside it.
    "zero2-scatter-gather-overlapped": (
        "zero",
        1,
        None,
        {"stage": 2, "communication": "scatter_gather", "bucket_size_mb": 0.0001},
    ),
    "gemini-static": ("gemini", 1, None, {"placement": PLACEMENTS["static"]}),
    "gemini-offload-params-clip": (
        "gemini",
        1,
        0.05,
        {"placement": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)},
    ),
    "gemini-auto-acc2": ("gemini", 2, None, {"placement": PLACEMENTS["auto"]}),
    "fsdp": ("fsdp", 1, None, {}),
    "fsdp-offload-clip-acc2": ("fsdp", 2, 0.05, {"cpu_offload": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_native_route_matches_oracle(rank_pool_2, case):
    body_name, accumulate, clip, strategy_kwargs = CASES[case]
    results = rank_pool_2.run(
        on_native_route, body_name, STEPS, accumulate, clip, "norm", "32-true", strategy_kwargs, timeout=180
    )
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=accumulate, clip_norm=clip)
    assert_matches_oracle(results, oracle, accumulate, **FP32)


# ------------------------------------------------------------------------ replicated (zero-dimensional) parameters
class ScaledRegression(nn.Module):
    """A learnable zero-dimensional temperature (as CLIP's logit_scale) beside ordinary weights."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs) * self.temperature


class ScaledModule(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        seed_everything(11, verbose=False)
        self.model = ScaledRegression()

    def training_step(self, batch: torch.Tensor, batch_index: int) -> torch.Tensor:
        return (self.model(batch) - batch.flip(-1)).square().mean() * 1e3

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(5)
        return DataLoader(torch.randn(64, 16, generator=generator), batch_size=4)


def replicated_body(native: bool) -> dict[str, Any]:
    module = ScaledModule()
    trainer = quiet_trainer(strategy=ZeroStrategy(stage=2), devices=4, max_steps=6)
    if native:
        with collectives.native_route():
            trainer.fit(module)
    else:
        trainer.fit(module)
    return {"temperature": module.model.temperature.detach().clone()}


@pytest.mark.parametrize("native", [True, False], ids=["native", "direct"])
def test_replicated_parameters_stay_identical_on_every_rank(rank_pool_4, native):
    """Four ranks: a ring reduce-scatter adds each rank's slot in a different order, so replicated slots can differ in
    their last bits; every rank must still hold the same temperature, bit for bit ([Note: replicated parameters follow
    rank 0] in ``zero/engine.py``)."""
    results = rank_pool_4.run(replicated_body, native, timeout=180)
    first = results[0]["temperature"]
    assert first.item() != pytest.approx(0.7, abs=1e-6), "the temperature did not train: the check proves nothing"
    for result in results[1:]:
        assert torch.equal(result["temperature"], first), [result["temperature"].item() for result in results]


# ------------------------------------------------------------------- one order over Gemini's two groups (NCCL-like)
def gemini_collective_sequence_body() -> list[tuple[str, str, tuple[int, ...]]]:
    """Train the mixture of experts whose experts get tokens on some ranks only, under Gemini on the native route,
    and return this rank's collectives over both of Gemini's groups in the order it issued them."""
    from unittest import mock

    import torch.distributed as dist

    from lightning_colossal import GeminiStrategy
    from tests.distributed.test_unused_and_tied_parameters import WORLD_SIZE, MoEModule

    issued: list[tuple[str, int, tuple[int, ...]]] = []
    names = ("all_reduce", "broadcast", "reduce_scatter_tensor", "reduce_scatter_single")
    names += ("all_gather_into_tensor", "all_gather_single")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def recording(name: str) -> Any:
        def call(*args: Any, group: Any = None, **kwargs: Any) -> Any:
            issued.append((name, id(group if group is not None else dist.group.WORLD), tuple(args[0].shape)))
            return originals[name](*args, group=group, **kwargs)

        return call

    roles: dict[int, str] = {}

    class GroupRoles(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            engine = trainer.strategy.engine
            roles.update({id(engine.process_group): "gathers", id(engine.reduce_group): "reductions"})

    strategy = GeminiStrategy(chunk_numel=80)  # every expert in chunks of its own
    trainer = quiet_trainer(
        strategy=strategy, devices=WORLD_SIZE, max_steps=3, use_distributed_sampler=False, callbacks=[GroupRoles()]
    )
    with collectives.native_route(), mock.patch.multiple(dist, **{name: recording(name) for name in originals}):
        trainer.fit(MoEModule("sgd"))
    return [(name, roles[group], shape) for name, group, shape in issued if group in roles]


def test_gemini_issues_one_order_over_both_groups_when_ranks_reach_different_chunks(rank_pool_2):
    """NCCL's rule for communicators that can block each other ([Note: reductions launched at agreed points] in
    ``gemini/hooks.py``): with experts that get tokens on one rank only, each rank still issues the same sequence of
    collectives over Gemini's two groups, reductions interleaved with gathers at the same places."""
    first, second = rank_pool_2.run(gemini_collective_sequence_body, timeout=180)
    assert {role for _, role, _ in first} == {"gathers", "reductions"}
    assert first == second
