"""``ColossalFSDPStrategy`` (torch FSDP2 ``fully_shard`` on CPU/gloo) against the oracle, DDP and ZeRO-2.

Every body runs on each rank of a rank pool (see ``tests/harness/rank_pool.py``). FSDP keeps the parameters sharded
as ``DTensor``s after training, so the bodies gather full tensors (``full_state``, a collective every rank runs in the
same order) before returning them; for ordinary tensors it is ``float_state``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_colossal import ColossalDDPStrategy, ColossalFSDPStrategy
from lightning_colossal.checkpoint import consolidate, read_sharded
from lightning_colossal.checkpoint.sharded import saved_keys, shard_directory
from tests.distributed.checkpoint_bodies import (
    FSDP,
    ZERO2,
    resume_body,
    save_after_one_epoch_body,
    uninterrupted_body,
)
from tests.distributed.oracle import (
    OracleResult,
    RegressionModule,
    _rank_micro_batches,
    assert_matches_oracle,
    build_optimizer,
    float_state,
    make_dataset,
    new_module,
    oracle_train,
    quiet_trainer,
    step_losses_from_ranks,
    train_and_record,
)

STEPS = 4
FP32 = {"rtol": 1e-5, "atol": 1e-6}
BF16 = {"rtol": 2e-2, "atol": 2e-3}


def sharding_facts(module: nn.Module) -> dict[str, Any]:
    """Which parameters FSDP turned into DTensors, and over which mesh and placements."""
    sharded = {name: parameter for name, parameter in module.named_parameters() if isinstance(parameter, DTensor)}
    first = next(iter(sharded.values()), None)
    return {
        "sharded": sorted(sharded),
        "mesh_shape": None if first is None else tuple(first.device_mesh.shape),
        "placements": None if first is None else [type(placement).__name__ for placement in first.placements],
    }


def train_fsdp_body(
    steps: int,
    accumulate: int = 1,
    clip: float | None = None,
    clip_algorithm: str = "norm",
    precision: str = "32-true",
    strategy_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    # keep_weights_sharded: sharding_facts inspects the shards after fit (by default fit gives back plain tensors).
    strategy = ColossalFSDPStrategy(keep_weights_sharded=True, **(strategy_kwargs or {}))
    return train_and_record(strategy, steps, accumulate, clip, clip_algorithm, precision, facts=sharding_facts)


def _assert_trained(parameters: dict[str, torch.Tensor]) -> None:
    initial = {name: tensor.float() for name, tensor in new_module().state_dict().items()}
    moved = max((parameters[name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-3, "the parameters did not train: the comparison would prove nothing"


def _assert_sharded(results: list[dict[str, Any]]) -> None:
    """Every parameter of the module is a DTensor: FSDP really sharded it (not a plain DDP fallback)."""
    for result in results:
        assert set(result["sharded"]) == set(result["parameters"]), result["sharded"]


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "no-reshard"])
def test_fp32_matches_oracle(rank_pool_2, reshard_after_forward):
    kwargs = {"reshard_after_forward": reshard_after_forward}
    results = rank_pool_2.run(train_fsdp_body, STEPS, 1, None, "norm", "32-true", kwargs)
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), 1, **FP32)
    _assert_trained(results[0]["parameters"])
    _assert_sharded(results)


def test_accumulation_with_clip_by_norm_matches_oracle(rank_pool_2):
    results = rank_pool_2.run(train_fsdp_body, STEPS, 2, 0.05, "norm", "32-true", {})
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_norm=0.05)
    assert_matches_oracle(results, oracle, 2, **FP32)
    # The clipped oracle differs from the unclipped one, so a strategy that ignores clipping cannot pass.
    unclipped = oracle_train(world_size=2, steps=STEPS, accumulate=2).parameters
    assert max((oracle.parameters[n] - unclipped[n]).abs().max().item() for n in unclipped) > 1e-3


def test_clip_by_value_matches_oracle(rank_pool_2):
    results = rank_pool_2.run(train_fsdp_body, STEPS, 2, 0.01, "value", "32-true", {})
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_value=0.01)
    assert_matches_oracle(results, oracle, 2, **FP32)
    unclipped = oracle_train(world_size=2, steps=STEPS, accumulate=2).parameters
    assert max((oracle.parameters[n] - unclipped[n]).abs().max().item() for n in unclipped) > 1e-3


def test_four_ranks_with_accumulation(rank_pool_4):
    # model.output.weight (1 x 32) and model.output.bias (1,) have one row: ranks 1-3 hold empty shards of them.
    results = rank_pool_4.run(train_fsdp_body, 2, 2, 0.05, "norm", "32-true", {})
    assert_matches_oracle(results, oracle_train(world_size=4, steps=2, accumulate=2, clip_norm=0.05), 2, **FP32)
    _assert_sharded(results)
    assert all(result["mesh_shape"] == (4,) for result in results), results[0]["mesh_shape"]


def test_hybrid_sharding_on_four_ranks_matches_oracle(rank_pool_4):
    # HSDP: 2 replicas x 2 shards; gradients are reduce-scattered within a replica, then all-reduced across replicas.
    results = rank_pool_4.run(train_fsdp_body, 2, 2, 0.05, "norm", "32-true", {"replicate_size": 2})
    assert_matches_oracle(results, oracle_train(world_size=4, steps=2, accumulate=2, clip_norm=0.05), 2, **FP32)
    _assert_sharded(results)
    for result in results:
        assert result["mesh_shape"] == (2, 2), result["mesh_shape"]
        assert result["placements"] == ["Replicate", "Shard"], result["placements"]


def mixed_precision_oracle(
    world_size: int, steps: int, accumulate: int = 1, dtype: torch.dtype = torch.bfloat16
) -> OracleResult:
    """The oracle under FSDP2's ``MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`` plus autocast.

    Unlike plain autocast (``oracle_train(autocast_dtype=...)``), FSDP gathers *every* parameter in ``dtype``
    (LayerNorm weights and biases too) and casts the root's inputs; each rank's per-micro-batch gradient comes out
    in ``dtype`` and is accumulated and averaged over ranks in fp32. AdamW then steps the fp32 shards.
    """
    learning_rate = 0.02
    module = new_module(learning_rate=learning_rate)
    model = module.model
    optimizer = build_optimizer(module, learning_rate)
    dataset = make_dataset()
    inputs, targets = dataset.tensors
    micro_batches = _rank_micro_batches(dataset, world_size, batch_size=4)
    parameters = dict(model.named_parameters())
    result = OracleResult()
    for _ in range(steps):
        rank_grads = [{name: torch.zeros_like(p) for name, p in parameters.items()} for _ in range(world_size)]
        losses = []
        for _ in range(accumulate):
            for rank, chosen in enumerate(next(micro_batches)):
                low = {name: p.detach().to(dtype).requires_grad_() for name, p in parameters.items()}
                with torch.autocast("cpu", dtype=dtype):
                    prediction = torch.func.functional_call(model, low, (inputs[chosen].to(dtype),))
                loss = nn.functional.mse_loss(prediction.float(), targets[chosen].float())
                losses.append(loss.detach())
                (loss / accumulate).backward()
                for name, p in low.items():
                    rank_grads[rank][name] += p.grad.float()
        for name, p in parameters.items():
            p.grad = torch.stack([grads[name] for grads in rank_grads]).sum(0) / world_size
        result.step_losses.append(torch.stack(losses).mean().item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result.parameters = float_state(module)
    return result


def test_bf16_mixed_matches_oracle_loosely(rank_pool_2):
    results = rank_pool_2.run(train_fsdp_body, STEPS, 2, None, "norm", "bf16-mixed", {})
    assert_matches_oracle(results, mixed_precision_oracle(world_size=2, steps=STEPS, accumulate=2), 2, **BF16)
    _assert_trained(results[0]["parameters"])
    # The losses also follow plain autocast. Its weights do not, to this tolerance: AdamW's first steps move each
    # weight by about +-lr whatever its gradient's size, so a near-zero gradient whose sign bf16 rounding flips (LayerNorm
    # weights rounded to bf16 or not) lands 2 * lr = 0.04 away; the FSDP-specific oracle rounds as FSDP does.
    autocast = oracle_train(world_size=2, steps=STEPS, accumulate=2, autocast_dtype=torch.bfloat16)
    losses = step_losses_from_ranks([result["losses"] for result in results], 2)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(autocast.step_losses), **BF16)


def test_cpu_offload_matches_oracle(rank_pool_2):
    results = rank_pool_2.run(train_fsdp_body, STEPS, 2, 0.05, "norm", "32-true", {"cpu_offload": True})
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS, accumulate=2, clip_norm=0.05), 2, **FP32)


class MLPCallCounter(Callback):
    """Counts the calls of the first block's MLP: activation checkpointing runs it again in backward.

    A pre-hook, because recomputation stops early, once the last tensor backward needs (inside the MLP) is rebuilt.
    """

    def __init__(self) -> None:
        self.calls = 0

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from lightning_colossal.demo.model import MLP

        mlp = next(module for module in pl_module.modules() if isinstance(module, MLP))
        mlp.register_forward_pre_hook(self._count)

    def _count(self, *args: Any) -> None:
        self.calls += 1


def gpt_body(strategy_name: str, activation_checkpointing: bool) -> dict[str, Any]:
    from lightning.pytorch import seed_everything
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    module = GPTLightningModule(
        vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=32, tie_weights=False, warmup_steps=2
    )
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=5), batch_size=4)
    if strategy_name == "ddp":
        strategy: Any = ColossalDDPStrategy()
    else:
        # keep_weights_sharded: the FSDP units are inspected after fit.
        strategy = ColossalFSDPStrategy(activation_checkpointing=activation_checkpointing, keep_weights_sharded=True)
    counter = MLPCallCounter()
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=6, callbacks=[counter]
    )
    trainer.fit(module, train_dataloaders=loader)
    return {
        "parameters": float_state(module),
        "fsdp_modules": sorted(name for name, child in module.named_modules() if isinstance(child, FSDPModule)),
        "mlp_calls": counter.calls,
        "printed_block": repr(module.model.blocks[0]).splitlines(),
    }


def pooled_gpt_body() -> dict[str, Any]:
    """``gpt_body`` under FSDP with every exchange buffer pooled however small ([Note: reusing large host buffers]);
    the test GPT's units are far below the pool's usual floor."""
    from lightning_colossal.engine_parts import buffer_pool
    from lightning_colossal.fsdp import exchange

    floor = buffer_pool.SMALLEST_POOLED_BYTES
    buffer_pool.SMALLEST_POOLED_BYTES = 0
    exchange._BUFFERS.reused = 0
    try:
        result = gpt_body("fsdp", False)
        result["reused"] = exchange._BUFFERS.reused
    finally:
        buffer_pool.SMALLEST_POOLED_BYTES = floor
    return result


def test_reused_exchange_buffers_train_like_ddp(rank_pool_2):
    # FSDP2 keeps a gathered unit's buffer until its copy-out and the reduce-scatter input until the exchange ends;
    # a buffer handed out again before then would mix two units' values.
    reference = rank_pool_2.run(gpt_body, "ddp", False)[0]
    for result in rank_pool_2.run(pooled_gpt_body):
        assert result["reused"] > 10, "the exchanges must actually reuse buffers"
        torch.testing.assert_close(result["parameters"], reference["parameters"], rtol=1e-5, atol=1e-6)


def test_activation_checkpointing_on_auto_detected_blocks_trains_like_ddp(rank_pool_2):
    reference = rank_pool_2.run(gpt_body, "ddp", False)[0]
    assert reference["mlp_calls"] == 6
    results = rank_pool_2.run(gpt_body, "fsdp", True)
    for result in results:
        # The demo GPT's ``Block``s were found without a policy and sharded one by one, and the model as a root.
        assert {"model", "model.blocks.0", "model.blocks.1"} <= set(result["fsdp_modules"]), result["fsdp_modules"]
        assert result["mlp_calls"] == 12, "each block's forward must run again in backward (recomputation)"
        # print(model) shows FSDP's class and the checkpointing attached to the block.
        assert result["printed_block"][:2] == ["FSDPBlock(", "  attached: activation checkpointing"]
        assert set(result["parameters"]) == set(reference["parameters"]), "the wrappers must not rename parameters"
        torch.testing.assert_close(result["parameters"], reference["parameters"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1]["parameters"], results[0]["parameters"], rtol=0, atol=0)


class LooseParameterModule(RegressionModule):
    """A parameter registered on the LightningModule itself, outside any child module."""

    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))

    def training_step(self, batch: Any, batch_index: int) -> torch.Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs) * self.temperature, targets)


def error_body(case: str) -> str:
    world_size = torch.distributed.get_world_size()
    try:
        if case == "loose_parameter":
            module: Any = LooseParameterModule()
            strategy = ColossalFSDPStrategy()
        elif case == "scalar_parameter":
            module = new_module()
            module.model.hidden.register_parameter("temperature", nn.Parameter(torch.tensor(1.0)))
            strategy = ColossalFSDPStrategy()
        else:
            module = new_module()
            strategy = ColossalFSDPStrategy(replicate_size=3)
        trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=1)
        trainer.fit(module)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_parameter_on_the_lightning_module_is_rejected_with_the_fix(rank_pool_2):
    for message in rank_pool_2.run(error_body, "loose_parameter", timeout=60):
        assert message.startswith("ValueError"), message
        assert "submodule" in message.lower(), message


def test_zero_dimensional_parameter_is_named_with_the_fix(rank_pool_2):
    for message in rank_pool_2.run(error_body, "scalar_parameter", timeout=60):
        assert message.startswith("ValueError"), message
        assert "model.hidden.temperature" in message and "shape (1,)" in message, message


def test_replicate_size_must_divide_the_world_size(rank_pool_2):
    for message in rank_pool_2.run(error_body, "replicate_size", timeout=60):
        assert message.startswith("ValueError"), message
        assert "replicate_size" in message, message


# --- checkpoints ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fsdp_checkpoint(rank_pool_2, tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """An FSDP checkpoint after one epoch at 2 ranks (dropout off) and the weights it was saved with."""
    path = str(tmp_path_factory.mktemp("fsdp") / "epoch1.ckpt")
    saved = rank_pool_2.run(save_after_one_epoch_body, FSDP, path, 0.0)
    torch.testing.assert_close(saved[1], saved[0], rtol=0, atol=0)
    return path, saved[0]


@pytest.fixture(scope="module")
def fsdp_reference(rank_pool_2) -> list[dict[str, torch.Tensor]]:
    """Per-rank weights of an uninterrupted 2-epoch FSDP run at 2 ranks (dropout off)."""
    return rank_pool_2.run(uninterrupted_body, FSDP, 0.0)


def test_resume_at_same_world_size_continues_identically(rank_pool_2, tmp_path):
    reference = rank_pool_2.run(uninterrupted_body, FSDP, 0.1)
    path = str(tmp_path / "epoch1.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, FSDP, path, 0.1)
    resumed = rank_pool_2.run(resume_body, FSDP, path, 4, 0.1)
    for rank in range(2):
        # Weights, sharded optimizer state, RNG, sampler epoch and LR schedule restored: bit for bit.
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=0, atol=0)


def test_checkpoint_is_portable_keyed_by_name_with_whole_tensors(fsdp_checkpoint):
    path, saved = fsdp_checkpoint
    assert len(list(shard_directory(path).glob("*.distcp"))) == 2, "each rank writes its own piece"
    keys = saved_keys(path)
    for name in ("model.input.weight", "model.output.bias", "model.norm.weight"):
        assert f"model.{name}" in keys, sorted(keys)
        for state in ("exp_avg", "exp_avg_sq"):
            assert f"optimizer_0.state.{name}.{state}" in keys, sorted(keys)
    assert not any(key.startswith("optimizer_0.state.0.") for key in keys), "state must be keyed by name, not position"
    loaded = read_sharded(path, keys={"model", "optimizer_0"})
    torch.testing.assert_close(loaded["model"], saved, rtol=0, atol=0)
    state = loaded["optimizer_0"]["state"]["model.input.weight"]
    assert state["exp_avg"].shape == (32, 8), "whole tensors, not one rank's shard"
    assert float(state["step"]) == 8.0


def test_resume_at_one_rank_continues_the_same_training(rank_pool_1, fsdp_checkpoint, fsdp_reference):
    path, _ = fsdp_checkpoint
    # One rank with twice the per-rank batch sees the same global batches.
    resumed = rank_pool_1.run(resume_body, FSDP, path, 8, 0.0)[0]
    torch.testing.assert_close(resumed, fsdp_reference[0], rtol=1e-5, atol=1e-6)


def test_fsdp_checkpoint_resumes_in_zero2(rank_pool_2, fsdp_checkpoint):
    path, _ = fsdp_checkpoint
    reference = rank_pool_2.run(uninterrupted_body, ZERO2, 0.0)
    resumed = rank_pool_2.run(resume_body, ZERO2, path, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], reference[rank], rtol=1e-5, atol=1e-6)


def test_zero2_checkpoint_resumes_in_fsdp(rank_pool_2, fsdp_reference, tmp_path):
    path = str(tmp_path / "zero2.ckpt")
    rank_pool_2.run(save_after_one_epoch_body, ZERO2, path, 0.0)
    resumed = rank_pool_2.run(resume_body, FSDP, path, 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], fsdp_reference[rank], rtol=1e-5, atol=1e-6)


def test_consolidate_gives_the_trained_weights_and_resumes_in_fsdp(
    rank_pool_2, fsdp_checkpoint, fsdp_reference, tmp_path
):
    from safetensors.torch import load_file

    path, saved = fsdp_checkpoint
    weights = load_file(str(consolidate(path, tmp_path / "model.safetensors")))
    torch.testing.assert_close(weights, saved, rtol=0, atol=0)
    # A single-file checkpoint holds whole tensors (optimizer state too); FSDP cuts its own shards out of them.
    full = torch.load(consolidate(path, tmp_path / "full.ckpt"), weights_only=False)
    assert full["optimizer_states"][0]["state"][0]["exp_avg"].shape == (32, 8)
    resumed = rank_pool_2.run(resume_body, FSDP, str(tmp_path / "full.ckpt"), 4, 0.0)
    for rank in range(2):
        torch.testing.assert_close(resumed[rank], fsdp_reference[rank], rtol=1e-5, atol=1e-6)


class InitialWeights(Callback):
    """The whole weights as training starts (after FSDP materialised a meta model): a collective on every rank."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.weights = float_state(pl_module)


def meta_init_body() -> dict[str, Any]:
    from lightning.pytorch import seed_everything

    from lightning_colossal import ColossalFSDPStrategy

    seed_everything(5, verbose=False)
    eager = float_state(RegressionModule())  # the same model built eagerly from the same seed
    seed_everything(5, verbose=False)
    # A model built on the meta device is one too large for a rank: it keeps its shards after fit.
    strategy = ColossalFSDPStrategy(keep_weights_sharded=True)
    initial = InitialWeights()
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=2, callbacks=[initial]
    )
    with trainer.init_module(empty_init=True):
        module = RegressionModule()
    built_on_meta = all(parameter.is_meta for parameter in module.parameters())
    trainer.fit(module)
    local_numels = {name: parameter.to_local().numel() for name, parameter in module.named_parameters()}
    state = float_state(module)
    return {
        "built_on_meta": built_on_meta,
        "any_meta_after": any(parameter.is_meta for parameter in module.parameters()),
        "local_numels": local_numels,
        "full_numels": {name: tensor.numel() for name, tensor in state.items()},
        "finite": all(torch.isfinite(tensor).all().item() for tensor in state.values()),
        "losses": module.micro_batch_losses,
        "eager": eager,
        "materialised": initial.weights,
    }


@pytest.fixture(scope="module")
def meta_init_results(rank_pool_2) -> list[dict[str, Any]]:
    return rank_pool_2.run(meta_init_body)


def _assert_initialised_like_torch(weights: dict[str, torch.Tensor]) -> None:
    """By value, as far as it is seed-independent: torch's Linear and LayerNorm initialisations, not zeros or junk."""
    for name, tensor in weights.items():
        if ".norm." in name:
            expected = torch.ones_like(tensor) if name.endswith("weight") else torch.zeros_like(tensor)
            torch.testing.assert_close(tensor, expected, rtol=0, atol=0, msg=name)
            continue
        layer = name.rsplit(".", 1)[0]
        bound = 1 / weights[f"{layer}.weight"].shape[1] ** 0.5  # kaiming_uniform(a=sqrt(5)) and the bias: U(+-bound)
        assert tensor.abs().max().item() <= bound, (name, tensor.abs().max().item(), bound)
        assert (tensor != 0).all(), f"{name}: zeros (a zero-filled initialisation?)"
        if tensor.numel() >= 256:  # the uniform's standard deviation, bound / sqrt(3), within 15%
            assert abs(tensor.std().item() * 3**0.5 / bound - 1) < 0.15, (name, tensor.std().item(), bound)


def test_meta_device_model_is_materialised_per_shard_and_trains(meta_init_results):
    results = meta_init_results
    for result in results:
        assert result["built_on_meta"], "Trainer.init_module(empty_init=True) must build on the meta device"
        assert not result["any_meta_after"]
        assert result["finite"] and all(loss == loss for loss in result["losses"])
        _assert_initialised_like_torch(result["materialised"])
        # Each rank holds only its rows: the two local shards of a 32-row weight add up to the whole.
        name = "model.input.weight"
        assert result["local_numels"][name] < result["full_numels"][name]
    torch.testing.assert_close(results[1]["materialised"], results[0]["materialised"], rtol=0, atol=0)
    assert (
        results[0]["local_numels"]["model.input.weight"] + results[1]["local_numels"]["model.input.weight"]
        == (results[0]["full_numels"]["model.input.weight"])
    )


def test_meta_device_model_is_initialised_like_the_eager_build_of_the_same_seed(meta_init_results):
    for result in meta_init_results:
        torch.testing.assert_close(result["materialised"], result["eager"], rtol=0, atol=0)


def sharded_units_body(policy_kind: str) -> list[str]:
    from torch.distributed.fsdp import FSDPModule

    from lightning_colossal import ColossalFSDPStrategy

    policy = (lambda module: isinstance(module, torch.nn.LayerNorm)) if policy_kind == "predicate" else ["Linear"]
    module = new_module()
    # keep_weights_sharded: the FSDP units are inspected after fit.
    strategy = ColossalFSDPStrategy(wrap_policy=policy, keep_weights_sharded=True)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=1)
    trainer.fit(module)
    return sorted(name for name, submodule in module.named_modules() if isinstance(submodule, FSDPModule))


def test_wrap_policy_by_class_names_or_predicate(rank_pool_2):
    assert rank_pool_2.run(sharded_units_body, "predicate")[0] == ["model", "model.norm"]
    assert rank_pool_2.run(sharded_units_body, "names")[0] == ["model", "model.hidden", "model.input", "model.output"]


def reduce_scatter_count_body(accumulate: int) -> int:
    import torch.distributed as dist

    from lightning_colossal import ColossalFSDPStrategy
    from lightning_colossal.distributed import collectives

    calls = [0]
    # FSDP2 reduces gradients with one of these, depending on the torch version, or on gloo with ours
    # (fsdp/exchange.py); count whichever exist.
    names = [name for name in ("reduce_scatter_tensor", "reduce_scatter_single") if hasattr(dist, name)]
    originals = {(dist, name): getattr(dist, name) for name in names}
    originals[(collectives, "reduce_scatter_async")] = collectives.reduce_scatter_async

    def counting(original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(*args, **kwargs)

        return call

    for (owner, name), original in originals.items():
        setattr(owner, name, counting(original))
    try:
        train_and_record(ColossalFSDPStrategy(), 2, accumulate)
    finally:
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    return calls[0]


def test_accumulation_reduces_only_on_the_last_micro_batch(rank_pool_2):
    single = rank_pool_2.run(reduce_scatter_count_body, 1)[0]
    accumulated = rank_pool_2.run(reduce_scatter_count_body, 2)[0]
    assert single > 0, "the counter saw no reduce-scatter at all: it measures nothing"
    assert accumulated == single, f"{accumulated} reduce-scatters for 2 steps of 2 micro-batches, {single} without"


def direct_exchange_count_body() -> dict[str, int]:
    from torch.distributed.fsdp import FSDPModule

    from lightning_colossal import ColossalFSDPStrategy
    from lightning_colossal.distributed import direct_exchange

    calls = {"all_gather": 0, "reduce_scatter": 0}
    originals = {name: getattr(direct_exchange, name) for name in calls}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    for name in calls:
        setattr(direct_exchange, name, counting(name))
    try:
        train_and_record(ColossalFSDPStrategy(), 2, 1)
    finally:
        for name, original in originals.items():
            setattr(direct_exchange, name, original)
    return {**calls, "torch_takes_custom_comms": int(hasattr(FSDPModule, "set_custom_all_gather"))}


def test_on_gloo_fsdp2_gathers_and_reduces_through_the_point_to_point_exchanges(rank_pool_2):
    # Faster than gloo's own collectives ([Note: direct exchanges on gloo]); the oracle tests above check the values.
    for result in rank_pool_2.run(direct_exchange_count_body):
        if not result["torch_takes_custom_comms"]:
            pytest.skip("this torch has no FSDPModule.set_custom_all_gather")
        assert result["all_gather"] > 0 and result["reduce_scatter"] > 0, result


class NestedBlocksModule(RegressionModule):
    """Blocks inside blocks, both declared in `_no_split_modules` (as Hugging Face's ConvNext declares its stages and
    their layers), and a policy naming the root's own class: each unit must be sharded once, innermost first."""

    def __init__(self) -> None:
        super().__init__()
        stage = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        stage._no_split_modules = ["Linear", "Sequential"]  # type: ignore[assignment]
        self.model = nn.Sequential(stage, nn.Sequential(nn.Linear(8, 1)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def new_nested_blocks_module() -> NestedBlocksModule:
    from lightning.pytorch import seed_everything

    seed_everything(1, verbose=False)
    return NestedBlocksModule()


def nested_blocks_body(strategy_name: str) -> dict[str, Any]:
    from torch.distributed.fsdp import FSDPModule

    module = new_nested_blocks_module()
    if strategy_name == "fsdp":
        strategy: Any = ColossalFSDPStrategy(keep_weights_sharded=True)
    else:
        strategy = ColossalDDPStrategy()
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=4)
    trainer.fit(module)
    units = sorted(name for name, submodule in module.named_modules() if isinstance(submodule, FSDPModule))
    return {"units": units, "parameters": float_state(module)}


def test_blocks_nested_in_blocks_are_sharded_innermost_first_and_train_like_ddp(rank_pool_2):
    sharded = rank_pool_2.run(nested_blocks_body, "fsdp")[0]
    replicated = rank_pool_2.run(nested_blocks_body, "ddp")[0]
    assert sharded["units"] == ["model", "model.0", "model.0.0", "model.0.2", "model.1", "model.1.0"]
    initial = new_nested_blocks_module().state_dict()
    assert any(not torch.equal(initial[name], value) for name, value in replicated["parameters"].items())
    for name, value in replicated["parameters"].items():
        torch.testing.assert_close(sharded["parameters"][name], value, **FP32, msg=name)


def offload_meta_seam_body(cpu_offload: bool) -> dict[str, Any]:
    """What the strategy hands ``initialise_shards`` for a meta model, and where the parameters end up."""
    from unittest import mock

    from lightning.pytorch import seed_everything

    import lightning_colossal.strategies.fsdp as fsdp_strategy

    handed: dict[str, Any] = {}
    original = fsdp_strategy.initialise_shards

    def spy(module: Any, template: Any, device: torch.device, window: int, parameter_device: Any = None) -> None:
        handed["parameter_device"] = parameter_device
        original(module, template, device, window, parameter_device)

    seed_everything(5, verbose=False)
    trainer = quiet_trainer(
        strategy=ColossalFSDPStrategy(cpu_offload=cpu_offload), devices=torch.distributed.get_world_size(), max_steps=1
    )
    with trainer.init_module(empty_init=True):
        module = RegressionModule()
    with mock.patch.object(fsdp_strategy, "initialise_shards", spy):
        trainer.fit(module)
    return handed


@pytest.mark.parametrize("cpu_offload", [True, False], ids=["offload", "on-device"])
def test_offload_materialises_a_meta_model_on_the_host(rank_pool_2, cpu_offload):
    """FSDP2 with CPUOffloadPolicy refuses parameters materialised anywhere but the host (on a GPU the compute
    device is not the host, so the strategy must say where, not rely on the two being the same as on CPU)."""
    for handed in rank_pool_2.run(offload_meta_seam_body, cpu_offload):
        assert handed["parameter_device"] == (torch.device("cpu") if cpu_offload else None), handed
