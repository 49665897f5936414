"""Where Gemini keeps bytes: per-rank model state from the real chunk storage, placement accounting, automatic
eviction under a budget, and models built on the meta device."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_colossal import AutoPlacement, GeminiStrategy, StaticPlacement
from tests.distributed.oracle import assert_matches_oracle, new_module, oracle_train, quiet_trainer
from tests.distributed.test_gemini_oracle import FP32, STEPS
from tests.distributed.test_zero_memory import owned_numel


class ReportProbe(Callback):
    """Keeps the engine's memory report and placement after the latest optimizer step."""

    def __init__(self) -> None:
        self.report: Any = None
        self.placement: Any = None

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        self.report = trainer.strategy.engine.memory_report()
        self.placement = trainer.strategy.engine.placement_summary()


def report_body(strategy: Any, with_oracle_losses: bool = False) -> dict[str, Any]:
    from tests.distributed.oracle import float_state

    world_size, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    module = new_module()
    probe = ReportProbe()
    strategy = GeminiStrategy(**strategy) if isinstance(strategy, dict) else strategy
    trainer = quiet_trainer(strategy=strategy, devices=world_size, max_steps=STEPS, callbacks=[probe])
    trainer.fit(module)
    shapes = [parameter.shape for parameter in module.parameters()]
    return {
        "report": probe.report._asdict(),
        "chunks": probe.report.chunks._asdict(),
        "placement": probe.placement,
        "owned_numel": sum(owned_numel(shape, world_size, rank) for shape in shapes),
        "num_parameters": len(shapes),
        "losses": module.micro_batch_losses,
        "parameters": float_state(module),
    }


def test_per_rank_model_state_is_16_bytes_per_owned_element(rank_pool_2):
    results = rank_pool_2.run(report_body, "colossal_gemini")
    for result in results:
        chunks, owned = result["chunks"], result["owned_numel"]
        assert chunks["shard"] == 4 * owned, "fp32 rows of every parameter, once"
        assert chunks["master"] == 0, "an fp32 shard on the compute device is its own master"
        assert chunks["gradient"] == 4 * owned
        # exp_avg + exp_avg_sq per owned element, plus AdamW's 4-byte step counter per parameter.
        assert chunks["optimizer_state"] == 8 * owned + 4 * result["num_parameters"]
        assert chunks["gathered"] == 0, "after the step nothing stays gathered"
        assert result["report"]["replicated_bytes"] == 0
    # Together the ranks hold each element exactly once: 16 bytes per parameter element over both ranks.
    total = sum(result["owned_numel"] for result in results)
    assert total == sum(p.numel() for p in new_module().parameters())


def test_offload_accounts_optimizer_bytes_off_the_compute_device(rank_pool_2):
    for result in rank_pool_2.run(report_body, "colossal_gemini_offload"):
        chunks = result["chunks"]
        assert result["placement"]["optimizer_offloaded"] == list(range(result["report"]["num_chunks"]))
        assert chunks["compute"] == chunks["shard"], "only the working shards stay on the compute device"
        assert chunks["offload"] == chunks["gradient"] + chunks["optimizer_state"] + chunks["master"]


def test_working_set_is_a_few_chunks_not_the_model(rank_pool_2):
    # The GPT is ~45k elements in chunks of 4200: at most the chunks one module needs, the one being reduced and the
    # prefetched one may be gathered at once, far below the whole model.
    results = rank_pool_2.run(gpt_report_body, {"chunk_numel": 4200, "max_prefetch": 1})
    for result in results:
        capacity_bytes = 4200 * 4
        assert result["peak_working_set"] <= 6 * capacity_bytes, result
        assert result["peak_working_set"] < 0.5 * result["model_bytes"], result


def gpt_report_body(strategy_kwargs: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    module = GPTLightningModule(
        vocab_size=64, block_size=16, num_layers=4, num_heads=2, embed_dim=32, tie_weights=True, warmup_steps=2
    )
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=5), batch_size=4)
    probe = ReportProbe()
    strategy = GeminiStrategy(**strategy_kwargs)
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=3, callbacks=[probe]
    )
    trainer.fit(module, train_dataloaders=loader)
    return {
        "peak_working_set": probe.report.peak_working_set_bytes,
        "model_bytes": 4 * probe.report.num_parameters,
        "evictions": probe.report.evictions,
    }


@pytest.mark.parametrize("budget", [20_000, 30_000])
def test_auto_placement_evicts_under_a_budget_and_still_matches_the_oracle(rank_pool_2, budget):
    strategy = {"chunk_numel": 1100, "placement": AutoPlacement(compute_memory_budget=budget)}
    results = rank_pool_2.run(report_body, strategy)
    assert all(result["report"]["evictions"] > 0 for result in results), [r["report"] for r in results]
    assert_matches_oracle(results, oracle_train(world_size=2, steps=STEPS), accumulate=1, **FP32)


def test_auto_placement_without_budget_evicts_nothing(rank_pool_2):
    results = rank_pool_2.run(report_body, {"chunk_numel": 1100, "placement": AutoPlacement()})
    assert all(result["report"]["evictions"] == 0 for result in results)


def too_small_budget_body() -> str:
    try:
        report_body({"chunk_numel": 1100, "placement": AutoPlacement(compute_memory_budget=2_000)})
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_budget_too_small_for_the_working_set_says_how_much_is_needed(rank_pool_2):
    for message in rank_pool_2.run(too_small_budget_body, timeout=60):
        assert "compute_memory_budget=2000" in message, message
        assert "needs at least" in message and "Raise AutoPlacement(compute_memory_budget=...)" in message, message


def static_keep_body() -> dict[str, Any]:
    return report_body({"chunk_numel": 1100, "placement": StaticPlacement(shard_param_frac=0.0)})


def test_keep_gathered_trades_memory_for_gathers(rank_pool_2):
    kept = rank_pool_2.run(static_keep_body)[0]
    sharded = rank_pool_2.run(report_body, {"chunk_numel": 1100})[0]
    assert kept["placement"]["kept_gathered"] == list(range(kept["report"]["num_chunks"]))
    assert sharded["placement"]["kept_gathered"] == []
    assert kept["report"]["peak_working_set_bytes"] > sharded["report"]["peak_working_set_bytes"]


def meta_init_body(window_bytes: int) -> dict[str, torch.Tensor]:
    """Build the demo GPT on the meta device and let the engine materialise it; return the whole weights."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_colossal import GeminiConfig
    from lightning_colossal.demo.model import GPT, GPTConfig
    from lightning_colossal.gemini import GeminiEngine

    config = GPTConfig(vocab_size=64, block_size=16, num_layers=3, num_heads=2, embed_dim=32, tie_weights=True)
    with torch.device("meta"):
        model = GPT(config)
    torch.manual_seed(21)
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("dp",))
    gemini = GeminiConfig(chunk_numel=4200, init_window_bytes=window_bytes)
    engine = GeminiEngine(model, None, gemini, mesh, torch.device("cpu"))
    windows = engine.manager.chunks  # every chunk got values
    state = engine.full_state_dict()
    engine.restore_full_parameters()
    assert model.lm_head.weight is model.token_embedding.weight
    assert len(windows) > 3
    return state


def eager_reference() -> dict[str, torch.Tensor]:
    from lightning_colossal.demo.model import GPT, GPTConfig

    config = GPTConfig(vocab_size=64, block_size=16, num_layers=3, num_heads=2, embed_dim=32, tie_weights=True)
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    torch.manual_seed(21)
    model.reset_parameters()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("window_bytes", [2**30, 20_000], ids=["one-pass", "many-windows"])
def test_meta_built_model_gets_exactly_the_eager_initialisation(rank_pool_2, rank_pool_1, window_bytes):
    reference = eager_reference()
    for pool in (rank_pool_1, rank_pool_2):
        for state in pool.run(meta_init_body, window_bytes):
            assert set(state) >= set(reference)
            for name, tensor in reference.items():
                torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def traced_activations_body() -> dict[str, int]:
    """Gemini auto's warm-up trace of saved activations, next to the same count in an eager forward of one batch."""
    module = new_module(batch_size=4)
    inputs, _ = next(iter(module.train_dataloader()))
    eager = new_module(batch_size=4)
    parameters = {parameter.untyped_storage().data_ptr() for parameter in eager.parameters()}
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in parameters:
            saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    # The model's forward only: the trace is read at module boundaries, so the loss's own saves come after its last
    # record.
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        eager.model(inputs)
    strategy = GeminiStrategy(placement=AutoPlacement(), chunk_numel=1100)
    trainer = quiet_trainer(strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=2)
    trainer.fit(module)
    return {"traced": strategy.engine.tracer.peak_non_model_bytes, "eager": saved[0]}


def test_auto_placement_traces_activations_without_the_gathered_weights(rank_pool_2):
    # The tracer recognises a saved weight by its storage when it is saved (a gathered chunk's buffer); a check
    # against the placeholders before the forward charged every saved weight as an activation (~4 bytes/parameter).
    for result in rank_pool_2.run(traced_activations_body):
        assert result["eager"] > 0
        assert result["traced"] == result["eager"], result


class DeviceBytesProbe(Callback):
    """The most model bytes the engine places on the compute device, sampled around every module of every step."""

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self.losses: list[float] = []
        self.shard_bytes = 0
        #: Samples where the quick figure automatic placement decides with differed from the whole account.
        self.quick_figure_differs: list[tuple[int, int]] = []

    def sample(self, engine: Any) -> None:
        compute = engine.memory_report().chunks.compute
        self.peaks[-1] = max(self.peaks[-1], compute)
        quick = engine.manager.compute_bytes(engine.optimizer.state if engine.optimizer is not None else None)
        if quick != compute:
            self.quick_figure_differs.append((quick, compute))

    def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        engine = trainer.strategy.engine
        if not self.peaks:
            self.shard_bytes = engine.memory_report().chunks.shard
            for submodule in pl_module.modules():
                submodule.register_forward_pre_hook(lambda *_: self.sample(engine))
                submodule.register_forward_hook(lambda *_: self.sample(engine))
                # In backward too, while gradients of whole chunks are held.
                submodule.register_full_backward_pre_hook(lambda *_: self.sample(engine))
        self.peaks.append(0)
        self.sample(engine)

    def on_before_optimizer_step(self, trainer: Any, *args: Any) -> None:
        self.sample(trainer.strategy.engine)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


def budgeted_gpt_body(budget: int | None) -> dict[str, Any]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    # Wide and short, so that the weights outweigh the activations (which automatic placement budgets for too).
    module = GPTLightningModule(vocab_size=64, block_size=8, num_layers=8, num_heads=4, embed_dim=128, warmup_steps=2)
    loader = DataLoader(RandomTokenDataset(num_samples=8, block_size=8, vocab_size=64, seed=5), batch_size=1)
    probe = DeviceBytesProbe()
    strategy = GeminiStrategy(placement=AutoPlacement(compute_memory_budget=budget), chunk_numel=65536)
    trainer = quiet_trainer(
        strategy=strategy, devices=torch.distributed.get_world_size(), max_steps=3, callbacks=[probe]
    )
    trainer.fit(module, train_dataloaders=loader)
    return {
        "peaks": probe.peaks,
        "shard_bytes": probe.shard_bytes,
        "losses": probe.losses,
        "quick_figure_differs": probe.quick_figure_differs,
    }


def test_auto_placement_keeps_the_first_step_within_a_budget_smaller_than_the_shards(rank_pool_2):
    # Every shard on the device before the first eviction would already exceed this budget (the model's 4 bytes per
    # element per rank are ~1.6x it), so the shards start on the CPU and come onto the device as modules need them.
    budget = 2_000_000
    budgeted = rank_pool_2.run(budgeted_gpt_body, budget)
    unbounded = rank_pool_2.run(budgeted_gpt_body, None)
    for result, reference in zip(budgeted, unbounded, strict=True):
        assert result["shard_bytes"] > 1.5 * budget, result
        assert 0 < max(result["peaks"]) <= budget, result["peaks"]
        assert result["quick_figure_differs"] == [] == reference["quick_figure_differs"]
        assert reference["peaks"][0] >= result["shard_bytes"], "without a budget the shards stay on the device"
        assert result["losses"] == reference["losses"]


class ReinstateProbe(Callback):
    """Counts, per step, the gathers served by buffers autograd kept, and what is kept after a forward without
    gradients (manager.py [Note: weights autograd saved])."""

    def __init__(self) -> None:
        self.reinstated_per_step: list[int] = []
        self.kept_after_no_grad_forward: int | None = None
        self._before = 0

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        manager = trainer.strategy.engine.manager
        self.reinstated_per_step.append(manager.reinstated - self._before)
        self._before = manager.reinstated
        if batch_idx == 1:
            with torch.no_grad():
                module(batch[0])
            trainer.strategy.engine.finish_phase()
            self.kept_after_no_grad_forward = sum(chunk.released_full is not None for chunk in manager.chunks)


def reinstate_body() -> dict[str, Any]:
    from lightning.pytorch import seed_everything
    from torch.utils.data import DataLoader

    from lightning_colossal.demo.data import RandomTokenDataset
    from lightning_colossal.demo.module import GPTLightningModule

    seed_everything(3, verbose=False)
    module = GPTLightningModule(
        vocab_size=64, block_size=16, num_layers=4, num_heads=2, embed_dim=32, tie_weights=True, warmup_steps=2
    )
    loader = DataLoader(RandomTokenDataset(num_samples=32, block_size=16, vocab_size=64, seed=5), batch_size=4)
    probe = ReinstateProbe()
    trainer = quiet_trainer(
        strategy=GeminiStrategy(chunk_numel=4200), devices=torch.distributed.get_world_size(), max_steps=3,
        callbacks=[probe],
    )  # fmt: skip
    trainer.fit(module, train_dataloaders=loader)
    return {
        "reinstated_per_step": probe.reinstated_per_step,
        "kept_after_no_grad_forward": probe.kept_after_no_grad_forward,
        "num_chunks": len(trainer.strategy.engine.manager.chunks) if trainer.strategy.engine else None,
    }


def test_backward_takes_back_the_buffers_autograd_kept_instead_of_gathering_again(rank_pool_2):
    # Values are the oracle tests' business (they run with this on); here: it happens in every step, and a forward
    # without gradients keeps nothing.
    for result in rank_pool_2.run(reinstate_body):
        assert all(count > 0 for count in result["reinstated_per_step"]), result
        assert result["kept_after_no_grad_forward"] == 0, result
