"""The Fabric strategies through a real Fabric loop at 2 CPU ranks, against one process on the same global batch.

Each body builds ``Fabric(strategy=...)`` inside a rank-pool worker (the pool's environment makes Fabric's popen
launcher start nothing) and trains ``RegressionModel`` by hand: ``fabric.setup``, ``no_backward_sync`` on the
non-final micro-batches of accumulation, ``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``. The
one-process reference (``one_process``) runs the same loop in plain PyTorch on the global batch, inside the worker so
that both sides run the same kernels.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric
from lightning.pytorch import seed_everything
from torch import nn

import lightning_colossal  # noqa: F401  (registers the Fabric strategy names)
from lightning_colossal.fabric import FabricHybridStrategy, FabricPrecision, FabricZeroStrategy
from tests.distributed.oracle import MODEL_SEED, RegressionModel, _rank_micro_batches, build_optimizer, make_dataset
from tests.harness.rank_pool import current_rank, current_world_size

STEPS = 3
FP32 = {"rtol": 1e-5, "atol": 1e-6}
MODES = [
    "colossal_ddp",
    "colossal_zero1",
    "colossal_zero2",
    "colossal_zero2_offload",
    "colossal_gemini",
    "colossal_gemini_offload",
    "colossal_gemini_auto",
    "colossal_fsdp",
    "colossal_fsdp_offload",
]


def _model() -> nn.Module:
    seed_everything(MODEL_SEED, verbose=False)
    return RegressionModel()


def _optimizer(model: nn.Module, kind: str) -> torch.optim.Optimizer:
    if kind == "adamw":
        return build_optimizer(model, 0.02)  # two groups, one with weight decay, one at half the learning rate
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: value.detach().float().cpu().clone() for name, value in state.items()}


def one_process(
    world_size: int,
    steps: int,
    accumulate: int,
    optimizer_kind: str,
    clip_norm: float | None = None,
    clip_value: float | None = None,
) -> dict[str, Any]:
    """The loop below in one process on the global batch: per step the mean of every rank's micro-batch losses."""
    model = _model()
    optimizer = _optimizer(model, optimizer_kind)
    inputs, targets = make_dataset().tensors
    batches = _rank_micro_batches(make_dataset(), world_size, 4)
    losses = []
    for _ in range(steps):
        step_losses = []
        for _ in range(accumulate):
            for indices in next(batches):
                step_losses.append(nn.functional.mse_loss(model(inputs[indices]), targets[indices]))
        loss = torch.stack(step_losses).mean()
        loss.backward()
        losses.append(loss.item())
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        if clip_value is not None:
            torch.nn.utils.clip_grad_value_(model.parameters(), clip_value)
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "parameters": _whole(model.state_dict())}


def _fabric(strategy: Any, precision: str = "32-true") -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=current_world_size(), strategy=strategy, precision=precision)
    fabric.launch()
    return fabric


def _data_parallel(fabric: Fabric) -> tuple[int, int]:
    """How many data-parallel replicas read different batches, and which this rank is (tensor-parallel peers read the
    same)."""
    sampling = fabric.strategy.distributed_sampler_kwargs
    return sampling["num_replicas"], sampling["rank"]


def _train(
    fabric: Fabric,
    model: Any,
    optimizer: Any,
    steps: int,
    accumulate: int,
    clip_norm: float | None,
    clip_value: float | None = None,
) -> list:
    """The hand-written loop: returns each step's loss, averaged over this rank's micro-batches."""
    inputs, targets = make_dataset().tensors
    replicas, rank = _data_parallel(fabric)
    batches = _rank_micro_batches(make_dataset(), replicas, 4)
    losses = []
    for _ in range(steps):
        total = 0.0
        for micro in range(accumulate):
            indices = next(batches)[rank]
            with fabric.no_backward_sync(model, enabled=micro < accumulate - 1):
                loss = nn.functional.mse_loss(model(inputs[indices]).float(), targets[indices])
                fabric.backward(loss / accumulate)
            total += loss.item() / accumulate
        if clip_norm is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip_norm)
        if clip_value is not None:
            fabric.clip_gradients(model, optimizer, clip_val=clip_value)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses


def _strategy(strategy: str | tuple[str, dict[str, Any]]) -> Any:
    """A registered name, or (name, arguments) for a class built here (the pool pickles arguments, not strategies)."""
    if isinstance(strategy, str):
        return strategy
    name, arguments = strategy
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    entry = STRATEGY_REGISTRY[name]
    return entry["strategy"](**{**entry["init_params"], **arguments})


def fabric_loop_body(
    strategy: str | tuple[str, dict[str, Any]],
    accumulate: int,
    optimizer_kind: str,
    clip_norm: float | None,
    separate_setup: bool,
    clip_value: float | None = None,
) -> dict[str, Any]:
    fabric = _fabric(_strategy(strategy))
    model = _model()
    if separate_setup:  # litgpt's order: the module first, the optimizer over the set-up module's parameters
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(_optimizer(model, optimizer_kind))
    else:
        model, optimizer = fabric.setup(model, _optimizer(model, optimizer_kind))
    losses = _train(fabric, model, optimizer, STEPS, accumulate, clip_norm, clip_value)
    result = {"losses": losses, "parameters": _whole(fabric.strategy.get_module_state_dict(model))}
    if current_rank() == 0:
        replicas = _data_parallel(fabric)[0]
        result["oracle"] = one_process(replicas, STEPS, accumulate, optimizer_kind, clip_norm, clip_value)
    return result


def _assert_matches(results: list[dict[str, Any]]) -> None:
    oracle = results[0]["oracle"]
    mean_losses = [sum(step) / len(results) for step in zip(*(result["losses"] for result in results), strict=True)]
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(oracle["losses"]), **FP32)
    for result in results:
        torch.testing.assert_close(result["parameters"], oracle["parameters"], **FP32)
    moved = max(
        (results[0]["parameters"][name] - _whole(_model().state_dict())[name]).abs().max()
        for name in oracle["parameters"]
    )
    assert moved > 1e-3, "the weights did not train: the comparison would prove nothing"


@pytest.mark.parametrize("strategy", MODES)
def test_sgd_with_accumulation_and_a_clip_that_does_not_trigger_matches_one_process(rank_pool_2, strategy):
    # SGD and a clip far above the norm: a wrong gradient scale (a sum for a mean, an accumulation counted twice) shows.
    _assert_matches(rank_pool_2.run(fabric_loop_body, strategy, 2, "sgd", 100.0, False))


@pytest.mark.parametrize("strategy", ["colossal_zero2", "colossal_gemini", "colossal_fsdp", "colossal_ddp"])
def test_adamw_with_two_groups_and_a_clip_that_triggers_matches_one_process(rank_pool_2, strategy):
    _assert_matches(rank_pool_2.run(fabric_loop_body, strategy, 1, "adamw", 0.05, False))


@pytest.mark.parametrize("strategy", ["colossal_zero2", "colossal_gemini", "colossal_fsdp"])
def test_clipping_by_value_matches_one_process(rank_pool_2, strategy):
    # 0.01 clamps most elements: a clamp skipped, or applied to scaled or partial gradients, shows.
    _assert_matches(rank_pool_2.run(fabric_loop_body, strategy, 2, "sgd", None, False, 0.01))


@pytest.mark.parametrize(
    ("strategy", "optimizer_kind"),
    [
        ("colossal_zero2", "adamw"),
        ("colossal_fsdp", "adamw"),
        # SGD: one group. The AdamW groups here go by `parameter.ndim`, and a set-up Gemini parameter is an empty 1-D
        # placeholder (docs/fabric.md: make such groups before `fabric.setup`, or by name).
        ("colossal_gemini", "sgd"),
        ("colossal_gemini_offload", "sgd"),
    ],
)
def test_module_and_optimizer_set_up_separately_match_one_process(rank_pool_2, strategy, optimizer_kind):
    _assert_matches(rank_pool_2.run(fabric_loop_body, strategy, 1, optimizer_kind, None, True))


def save_then_resume_body(save_strategy: str, path: str) -> dict[str, Any]:
    """Train 2 steps and save: every rank of this pool."""
    fabric = _fabric(save_strategy)
    model = _model()
    model, optimizer = fabric.setup(model, _optimizer(model, "adamw"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    _train(fabric, model, optimizer, 2, 1, None)
    scheduler.step()
    fabric.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 2})
    return {}


def resume_body(load_strategy: str, path: str, save_world_size: int) -> dict[str, Any]:
    """Load at this pool's world size under ``load_strategy`` and take a third step."""
    fabric = _fabric(load_strategy)
    model = _model()
    model, optimizer = fabric.setup(model, _optimizer(model, "adamw"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    remainder = fabric.load(path, state)
    # Continue with the batches the saving run would have read next, on this world size's split of them.
    inputs, targets = make_dataset().tensors
    batch = next(iter(_skip(_rank_micro_batches(make_dataset(), save_world_size, 4), 2)))
    indices = [index for rank_indices in batch for index in rank_indices]
    share = len(indices) // current_world_size()
    mine = indices[current_rank() * share : (current_rank() + 1) * share]
    loss = nn.functional.mse_loss(model(inputs[mine]), targets[mine])
    fabric.backward(loss)
    optimizer.step()
    result = {
        "step": state["step"],
        "learning_rate": optimizer.param_groups[0]["lr"],
        "remainder": sorted(remainder),
        "parameters": _whole(fabric.strategy.get_module_state_dict(model)),
    }
    if current_rank() == 0:
        result["oracle"] = _continued_oracle(save_world_size)
    return result


def _skip(iterator: Any, count: int) -> Any:
    for _ in range(count):
        next(iterator)
    return iterator


def _continued_oracle(world_size: int) -> dict[str, torch.Tensor]:
    """One process: two steps, the scheduler's step, a third step on the next global batch."""
    model = _model()
    optimizer = _optimizer(model, "adamw")
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    inputs, targets = make_dataset().tensors
    batches = _rank_micro_batches(make_dataset(), world_size, 4)
    for step in range(3):
        indices = [index for rank_indices in next(batches) for index in rank_indices]
        nn.functional.mse_loss(model(inputs[indices]), targets[indices]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            scheduler.step()
    return _whole(model.state_dict())


@pytest.mark.parametrize(
    ("save_strategy", "load_strategy", "load_ranks"),
    [
        ("colossal_zero2", "colossal_gemini", 1),
        ("colossal_gemini", "colossal_fsdp", 2),
        ("colossal_fsdp", "colossal_zero1", 1),
    ],
    ids=["zero2-to-gemini-1-rank", "gemini-to-fsdp", "fsdp-to-zero1-1-rank"],
)
def test_save_and_resume_at_another_world_size_and_strategy(
    rank_pool_2, rank_pool_1, tmp_path, save_strategy, load_strategy, load_ranks
):
    path = str(tmp_path / "step-2" / "lit_model.pth")
    rank_pool_2.run(save_then_resume_body, save_strategy, path)
    # The file holds the whole weights under the user's key too, for tools that read it without this package.
    plain = torch.load(path, map_location="cpu", weights_only=False)
    assert set(plain["model"]) == set(_model().state_dict())
    pool = rank_pool_1 if load_ranks == 1 else rank_pool_2
    results = pool.run(resume_body, load_strategy, path, 2)
    for result in results:
        assert result["step"] == 2 and result["learning_rate"] == pytest.approx(0.01)
        assert result["remainder"] == []
        torch.testing.assert_close(result["parameters"], results[0]["oracle"], **FP32)


def load_after_setup_body(strategy: str, precision: str, path: str) -> dict[str, Any]:
    """litgpt's order: set up, then `model.load_state_dict(pretrained)`, then train; the engine's copy follows."""
    seed_everything(123, verbose=False)
    pretrained = RegressionModel().state_dict()
    fabric = _fabric(strategy, precision)
    model = _model()
    model, optimizer = fabric.setup(model, _optimizer(model, "sgd"))
    model.load_state_dict(pretrained)
    fabric.save(path, {"model": model})  # written from the engine's copy: fp32 masters, Gemini's chunks
    return {"pretrained": _whole(pretrained)}


@pytest.mark.parametrize(
    ("strategy", "precision"),
    [("colossal_zero2", "bf16-true"), ("colossal_gemini", "32-true")],
    ids=["zero2-bf16", "gemini"],
)
def test_weights_loaded_after_setup_reach_the_engine(rank_pool_2, tmp_path, strategy, precision):
    path = str(tmp_path / "loaded.pth")
    results = rank_pool_2.run(load_after_setup_body, strategy, precision, path)
    saved = torch.load(path, map_location="cpu", weights_only=False)["model"]
    # Unrounded: bf16 parameters would differ from the fp32 weights in the 3rd decimal.
    torch.testing.assert_close(_whole(saved), results[0]["pretrained"], rtol=0, atol=0)


def trainer_checkpoint_body(path: str) -> dict[str, Any]:
    """A Trainer checkpoint (colossal_zero2) loaded into a Fabric loop (colossal_gemini) over the same module."""
    from tests.distributed.oracle import new_module, quiet_trainer

    module = new_module()
    trainer = quiet_trainer(strategy="colossal_zero2", devices=current_world_size(), max_steps=2)
    trainer.fit(module)
    trainer.save_checkpoint(path)
    trained = _whole(module.state_dict())
    fabric = _fabric("colossal_gemini")
    fresh = new_module()
    model, optimizer = fabric.setup(fresh, build_optimizer(fresh, 0.02))
    remainder = fabric.load(path, {"model": model, "optimizer": optimizer})
    return {
        "trained": trained,
        "loaded": _whole(fabric.strategy.get_module_state_dict(model)),
        "keys": sorted(remainder),
    }


def test_a_trainer_checkpoint_loads_into_a_fabric_loop(rank_pool_2, tmp_path):
    results = rank_pool_2.run(trainer_checkpoint_body, str(tmp_path / "trainer.ckpt"))
    for result in results:
        torch.testing.assert_close(result["loaded"], result["trained"], rtol=0, atol=0)
        assert "global_step" in result["keys"] and "loops" in result["keys"]  # Lightning's entries, handed back


@pytest.mark.parametrize("name", ["colossal_zero2_offload_notebook", "colossal_fsdp_offload", "colossal_gemini_auto"])
def test_every_registered_name_builds_a_fabric_strategy(name):
    fabric = Fabric(accelerator="cpu", devices=1, strategy=name)
    assert type(fabric.strategy).__module__ == "lightning_colossal.fabric.modes"


# RegressionModel's layers split by a plan: `hidden` by columns, `output` by rows (its result is whole again).
TENSOR_PARALLEL_PLAN = {"input": "replicate", "norm": "replicate", "hidden": "colwise", "output": "rowwise"}


@pytest.mark.parametrize(
    "arguments",
    [
        {"tp_size": 2, "policy": TENSOR_PARALLEL_PLAN},
        {"zero_stage": 2},
        {"tp_size": 2, "policy": TENSOR_PARALLEL_PLAN, "zero_stage": 1},
    ],
    ids=["tp2", "dp2-zero2", "tp2-zero1"],
)
@pytest.mark.parametrize("optimizer_kind", ["sgd", "adamw"])
def test_hybrid_matches_one_process(rank_pool_2, arguments, optimizer_kind):
    accumulate, clip = (2, 100.0) if optimizer_kind == "sgd" else (1, 0.05)
    _assert_matches(
        rank_pool_2.run(fabric_loop_body, ("colossal_hybrid", arguments), accumulate, optimizer_kind, clip, False)
    )


def test_hybrid_pipelines_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="pipeline schedule replaces the training step"):
        Fabric(accelerator="cpu", devices=1, strategy=FabricHybridStrategy(pp_size=2, num_microbatches=2))


def test_fabric_precision_plugins_are_translated_not_dropped():
    fabric = Fabric(accelerator="cpu", devices=1, strategy=FabricZeroStrategy(stage=2), precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, FabricPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"


def test_background_saves_are_refused_under_fabric():
    with pytest.raises(ValueError, match="async_checkpoint"):
        FabricZeroStrategy(stage=2, async_checkpoint=True)


def meta_init_body(strategy: str, separate_setup: bool = False) -> dict[str, Any]:
    """`fabric.init_module(empty_init=True)`: built on the meta device, each rank's shards materialised at set-up
    (with `separate_setup`, litgpt's order: the optimizer made from the set-up model)."""
    fabric = _fabric(strategy)
    seed_everything(MODEL_SEED, verbose=False)
    with fabric.init_module(empty_init=True):
        model = RegressionModel()
    on_meta = all(parameter.is_meta for parameter in model.parameters())
    if separate_setup:
        model = fabric.setup(model)
        optimizer = fabric.setup_optimizers(_optimizer(model, "adamw"))
    else:
        model, optimizer = fabric.setup(model, _optimizer(model, "adamw"))
    losses = _train(fabric, model, optimizer, STEPS, 1, 1.0)
    return {"on_meta": on_meta, "losses": losses, "parameters": _whole(fabric.strategy.get_module_state_dict(model))}


@pytest.mark.parametrize(
    ("strategy", "separate_setup"), [("colossal_gemini", False), ("colossal_gemini", True), ("colossal_fsdp", True)]
)
def test_a_model_built_on_the_meta_device_trains(rank_pool_2, strategy, separate_setup):
    results = rank_pool_2.run(meta_init_body, strategy, separate_setup)
    assert all(result["on_meta"] for result in results)
    for result in results:
        assert all(torch.isfinite(torch.tensor(result["losses"])))
        assert all(torch.isfinite(value).all() for value in result["parameters"].values())
        torch.testing.assert_close(result["parameters"], results[0]["parameters"], rtol=0, atol=0)
    # Initialised, not left at zero or uninitialised memory: the weight matrices have spread.
    assert results[0]["parameters"]["hidden.weight"].std() > 1e-3


def filtered_and_raw_body(strategy: str, directory: str) -> dict[str, Any]:
    fabric = _fabric(strategy)
    model = _model()
    model, optimizer = fabric.setup(model, _optimizer(model, "sgd"))
    _train(fabric, model, optimizer, 1, 1, None)
    trained = _whole(fabric.strategy.get_module_state_dict(model))
    fabric.save(f"{directory}/full.ckpt", {"model": model, "optimizer": optimizer, "step": 1})
    fabric.save(
        f"{directory}/hidden.ckpt", {"model": model, "step": 1}, filter={"model": lambda name, _: "hidden" in name}
    )
    everything = fabric.load(f"{directory}/full.ckpt")
    raw = torch.load(f"{directory}/hidden.ckpt", map_location="cpu", weights_only=False)
    return {
        "trained": trained,
        "everything_keys": sorted(everything),
        "everything_model": _whole(everything["model"]),
        "filtered_keys": sorted(raw["model"]),
    }


def load_raw_body(strategy: str, directory: str) -> dict[str, Any]:
    fabric = _fabric(strategy)
    model = _model()
    model, optimizer = fabric.setup(model, _optimizer(model, "sgd"))
    fabric.load_raw(f"{directory}/full.ckpt", model)
    torch.save({name: value for name, value in _model().state_dict().items()}, f"{directory}/plain.pth")
    from_full = _whole(fabric.strategy.get_module_state_dict(model))
    fabric.load_raw(f"{directory}/plain.pth", model)
    return {"from_full": from_full, "from_plain": _whole(fabric.strategy.get_module_state_dict(model))}


def test_filter_load_raw_and_the_whole_checkpoint(rank_pool_2, tmp_path):
    results = rank_pool_2.run(filtered_and_raw_body, "colossal_zero2", str(tmp_path))
    result = results[0]
    assert result["everything_keys"] == ["model", "step"]
    torch.testing.assert_close(result["everything_model"], result["trained"], rtol=0, atol=0)
    assert result["filtered_keys"] == ["hidden.weight"]
    loaded = rank_pool_2.run(load_raw_body, "colossal_gemini", str(tmp_path))
    for each in loaded:
        torch.testing.assert_close(each["from_full"], result["trained"], rtol=0, atol=0)
        torch.testing.assert_close(each["from_plain"], _whole(_model().state_dict()), rtol=0, atol=0)


def fabric_to_trainer_body(path: str) -> dict[str, Any]:
    """A Fabric checkpoint of a LightningModule resumed by the Trainer (another strategy): weights and optimizer."""
    from tests.distributed.oracle import new_module, quiet_trainer

    fabric = _fabric("colossal_gemini")
    module = new_module()
    model, optimizer = fabric.setup(module, build_optimizer(module, 0.02))
    fabric.save(path, {"model": model, "optimizer": optimizer})
    saved = _whole(fabric.strategy.get_module_state_dict(model))
    fabric.strategy.teardown()
    resumed = new_module()
    trainer = quiet_trainer(strategy="colossal_zero2", devices=current_world_size(), max_steps=1)
    trainer.fit(resumed, ckpt_path=path)
    return {"saved": saved, "steps": trainer.global_step}


def test_the_trainer_resumes_from_a_fabric_checkpoint(rank_pool_2, tmp_path):
    results = rank_pool_2.run(fabric_to_trainer_body, str(tmp_path / "fabric.ckpt"))
    assert all(result["steps"] == 1 for result in results)


def _gpt() -> nn.Module:
    from lightning_colossal.demo.model import GPT, GPTConfig

    seed_everything(MODEL_SEED, verbose=False)
    return GPT(GPTConfig(vocab_size=64, block_size=16, num_layers=2, num_heads=2, embed_dim=32, tie_weights=False))


def _gpt_tokens() -> torch.Tensor:
    return torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))


def gpt_tensor_parallel_body(sharded_loss: bool) -> dict[str, Any]:
    """The demo GPT (a vocabulary-parallel head) under tp2: the loss from whole logits by default, or from sharded
    logits inside `loss_parallel()`."""
    fabric = _fabric(FabricHybridStrategy(tp_size=2))
    model = _gpt()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    tokens = _gpt_tokens()
    losses = []
    for _ in range(2):
        context = fabric.strategy.loss_parallel() if sharded_loss else nullcontext()
        with context:
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss))
    result: dict[str, Any] = {"losses": losses, "logits": type(logits).__name__}
    if current_rank() == 0:
        reference = _gpt()
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        expected = []
        for _ in range(2):
            logits = reference(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            reference_optimizer.step()
            reference_optimizer.zero_grad()
            expected.append(loss.item())
        result["expected"] = expected
    return result


@pytest.mark.parametrize("sharded_loss", [False, True], ids=["whole-logits", "loss-parallel"])
def test_a_vocabulary_parallel_head_trains_like_one_process_either_way(rank_pool_2, sharded_loss):
    results = rank_pool_2.run(gpt_tensor_parallel_body, sharded_loss)
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(results[0]["expected"]), **FP32)
        assert result["logits"] == ("DTensor" if sharded_loss else "Tensor")  # sharded only where asked


def bf16_body(strategy: str) -> dict[str, Any]:
    fabric = _fabric(strategy, "bf16-mixed")
    model = _model()
    # SGD: a difference in the gradients shows in proportion (Adam's normalised steps would amplify bf16 noise).
    model, optimizer = fabric.setup(model, _optimizer(model, "sgd"))
    losses = _train(fabric, model, optimizer, STEPS, 1, None)
    result = {"losses": losses, "parameters": _whole(fabric.strategy.get_module_state_dict(model))}
    if current_rank() == 0:
        result["oracle"] = one_process(current_world_size(), STEPS, 1, "sgd")
    return result


@pytest.mark.parametrize("strategy", ["colossal_zero2", "colossal_gemini"])
def test_bf16_mixed_trains_close_to_fp32_one_process(rank_pool_2, strategy):
    results = rank_pool_2.run(bf16_body, strategy)
    oracle = results[0]["oracle"]
    mean_losses = [sum(step) / len(results) for step in zip(*(result["losses"] for result in results), strict=True)]
    # bf16 matmuls: within bf16's rounding of the fp32 run, and every replica the same.
    torch.testing.assert_close(torch.tensor(mean_losses), torch.tensor(oracle["losses"]), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(results[0]["parameters"], oracle["parameters"], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(results[1]["parameters"], results[0]["parameters"], rtol=0, atol=0)


def test_the_disk_tier_under_a_fabric_loop_matches_one_process(rank_pool_2, tmp_path):
    arguments = {"offload_dir": str(tmp_path), "disk_fraction": 0.5}
    _assert_matches(rank_pool_2.run(fabric_loop_body, ("colossal_zero2_offload", arguments), 2, "sgd", 100.0, False))


class _Wrapped(nn.Module):
    """A linear layer one level down that loads its old flat keys (``weight`` for ``linear.weight``), as litgpt's LoRA
    layers do in their own ``_load_from_state_dict``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.linear(inputs)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any) -> None:
        for name in ("weight", "bias"):
            if prefix + name in state_dict:
                state_dict[prefix + "linear." + name] = state_dict.pop(prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def gemini_state_dict_body() -> dict[str, Any]:
    fabric = _fabric("colossal_gemini")
    seed_everything(MODEL_SEED, verbose=False)
    model = nn.Sequential(_Wrapped(), nn.Linear(8, 1))
    old_keys = {
        "0.weight": torch.randn(8, 8),
        "0.bias": torch.randn(8),
        "1.weight": torch.randn(1, 8),
        "1.bias": torch.randn(1),
    }
    model = fabric.setup(model)
    model.load_state_dict(old_keys)  # below the root, the wrapped layer renames its keys
    whole = _whole(fabric.strategy.get_module_state_dict(model))
    # state_dict() gives each chunked parameter's whole value (a DTensor, as under FSDP2), not the empty placeholder.
    from_state_dict = {name: value.full_tensor() for name, value in model.state_dict().items()}
    return {"expected": old_keys, "whole": whole, "state_dict": _whole(from_state_dict)}


def test_gemini_takes_weights_a_submodule_renames_and_state_dict_gives_whole_values(rank_pool_2):
    for result in rank_pool_2.run(gemini_state_dict_body):
        renamed = {
            key.replace("0.", "0.linear.", 1) if key.startswith("0.") else key: value
            for key, value in result["expected"].items()
        }
        torch.testing.assert_close(result["whole"], renamed, rtol=0, atol=0)
        torch.testing.assert_close(result["state_dict"], renamed, rtol=0, atol=0)


def teardown_body(strategy: str | tuple[str, dict[str, Any]]) -> dict[str, Any]:
    fabric = _fabric(_strategy(strategy))
    original = _model()
    model, optimizer = fabric.setup(original, _optimizer(original, "sgd"))
    _train(fabric, model, optimizer, 1, 1, None)
    trained = _whole(fabric.strategy.get_module_state_dict(model))
    fabric.strategy.teardown()  # Fabric never calls it; a loop may, to release the engine before the process ends
    # The module the loop built holds plain whole tensors again, as after a Trainer run.
    assert all(type(value) is torch.Tensor for value in original.state_dict().values())
    return {"trained": trained, "after": _whole(original.state_dict())}


@pytest.mark.parametrize(
    "strategy",
    ["colossal_ddp", "colossal_zero2", "colossal_gemini", "colossal_fsdp", ("colossal_hybrid", {"tp_size": 1})],
    ids=["ddp", "zero2", "gemini", "fsdp", "hybrid"],
)
def test_teardown_by_hand_leaves_the_module_whole(rank_pool_2, strategy):
    for result in rank_pool_2.run(teardown_body, strategy):
        torch.testing.assert_close(result["after"], result["trained"], rtol=0, atol=0)


def watchdog_threads_body() -> int:
    import threading

    for _ in range(3):  # three loops in one long-lived process (a notebook, this worker), none torn down
        _fabric("colossal_zero2")
    return sum(thread.name.startswith("lightning-colossal-watchdog-rank") for thread in threading.enumerate())


def test_loops_that_are_never_torn_down_leave_one_watchdog_running(rank_pool_2):
    assert rank_pool_2.run(watchdog_threads_body) == [1, 1]
