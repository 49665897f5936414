"""Two models in one step (DPO): a trained policy and a frozen reference in one LightningModule (issue 43).

The LightningModule is the example's (``examples/huggingface/dpo.py``): a tiny Llama policy, a frozen deep copy of
it as the reference (``requires_grad_(False)``, left out of the optimizer, run under ``torch.no_grad()``), the DPO
loss over chosen/rejected completions of a synthetic preference set. Each row trains it through the real Trainer at
2 gloo ranks and compares with the same LightningModule trained by plain Lightning in one process on the same global
batch (the oracle): the loss of every step, the policy's weights after the last step (SGD too, so a wrong gradient
scale shows), the reference's weights bit for bit unchanged. The engines' own accounting says that the reference
costs no gradient and no optimizer state: Gemini's chunk specs and memory report (the reference in frozen chunks of
its own, this rank's rows only), ZeRO's masters and memory report (the policy's rows only, the reference whole).
"""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "huggingface" / "dpo.py"
HIDDEN_SIZE = 32
BATCH_SIZE = 2  # pairs per rank and step; the one-process oracle takes both ranks' pairs at once
WORLD_SIZE = 2
STEPS = 3
NUM_PAIRS = WORLD_SIZE * BATCH_SIZE * STEPS
LEARNING_RATE = {"sgd": 2.0, "adamw": 1e-2}
CHUNK_NUMEL = 4096  # several chunks of each kind for the 19,616-element tiny Llama
# Losses to 1e-6 (measured: within 6e-8). Weights: SGD's to 1e-6 (measured: within 6e-8, of updates up to 0.26), so
# a gradient off by any factor fails; AdamW divides by the gradient's own size, which turns float reassociation in
# near-zero gradients into differences of up to 7e-6 (measured), still 500 times less than one step's 1e-2.
RTOL = 1e-5
LOSS_ATOL = 1e-6
WEIGHT_ATOL = {"sgd": 1e-6, "adamw": 2e-5}
CLIP = 0.01  # below the gradient norms of these steps, so clipping scales every step


def load_example() -> Any:
    """The example as a module (it is a script, not a package), loaded once per process."""
    name = "examples_huggingface_dpo"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def interleaved_loss(self: Any, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The example's loss with four forwards, reference and policy taking turns: chosen, then rejected."""
    example = load_example()
    log_probs = {}
    for name in ("chosen", "rejected"):
        arguments = (batch[f"{name}_ids"], batch[f"{name}_completion"], batch.get(f"{name}_attention"))
        with torch.no_grad():
            log_probs[f"reference_{name}"] = example.completion_log_probs(self.reference, *arguments)
        log_probs[f"policy_{name}"] = example.completion_log_probs(self.policy, *arguments)
    return example.dpo_loss(
        log_probs["policy_chosen"],
        log_probs["policy_rejected"],
        log_probs["reference_chosen"],
        log_probs["reference_rejected"],
        self.hparams["beta"],
    )


def checkpointed_policy(self: Any) -> None:
    """The example's models, with activation checkpointing on the policy (recomputed in backward)."""
    load_example().DPOModule.configure_model(self)
    self.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


VARIANTS: dict[str, dict[str, Any]] = {
    "interleaved": {"_loss": interleaved_loss},
    "checkpointed": {"configure_model": checkpointed_policy},
}


def new_module(optimizer: str, padded: bool, batch_size: int, variant: str = "") -> Any:
    """The example's module; ``variant`` (a key of ``VARIANTS``) overrides one of its methods."""
    example = load_example()
    module_class = example.DPOModule
    if variant:
        module_class = type(f"{variant.title()}DPOModule", (example.DPOModule,), VARIANTS[variant])
    return module_class(
        optimizer=optimizer,
        learning_rate=LEARNING_RATE[optimizer],
        padded=padded,
        batch_size=batch_size,
        num_pairs=NUM_PAIRS,
        shuffle=False,  # the oracle takes the same pairs without knowing the sampler's seed
        hidden_size=HIDDEN_SIZE,
    )


def initial_state() -> dict[str, torch.Tensor]:
    """Both models' starting weights, by LightningModule name (the reference is a copy of the policy)."""
    policy = load_example().tiny_llama(HIDDEN_SIZE).state_dict()
    return {f"{prefix}.{name}": tensor for prefix in ("policy", "reference") for name, tensor in policy.items()}


def make_strategy(name: str) -> Any:
    from lightning_colossal import (
        AutoPlacement,
        ColossalDDPStrategy,
        ColossalFSDPStrategy,
        GeminiStrategy,
        StaticPlacement,
        ZeroStrategy,
    )

    if name == "gemini":
        return GeminiStrategy(chunk_numel=CHUNK_NUMEL)
    if name == "gemini_offloaded":  # every shard, master and optimizer state in host memory
        placement = StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)
        return GeminiStrategy(chunk_numel=CHUNK_NUMEL, placement=placement)
    if name == "gemini_auto_prefetch":  # a budget small enough to evict chunks every step (asserted below)
        automatic = AutoPlacement(compute_memory_budget=400_000)
        return GeminiStrategy(chunk_numel=CHUNK_NUMEL, placement=automatic, max_prefetch=2)
    if name == "gemini_whole_reference":
        return GeminiStrategy(chunk_numel=CHUNK_NUMEL, shard_frozen_parameters=False)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(stage=1 if name == "zero1" else 2)
    if name == "fsdp":
        return ColossalFSDPStrategy()
    return ColossalDDPStrategy()


# ------------------------------------------------------------------------------------------------- accounting
def own_numel(shape: torch.Size, world_size: int, rank: int) -> int:
    """Elements of the dim-0 rows ``rank`` owns (ceil(rows / world_size) per rank), as ZeRO and Gemini split."""
    rows_per_rank = math.ceil(shape[0] / world_size)
    rows = max(0, min(shape[0], (rank + 1) * rows_per_rank) - rank * rows_per_rank)
    return rows * math.prod(shape[1:])


def _state_bytes(optimizer: torch.optim.Optimizer, key: str | None = None) -> int:
    return sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for name, value in state.items()
        if isinstance(value, torch.Tensor) and (key is None or name == key)
    )


def engine_accounting(trainer: Any, module: Any) -> dict[str, Any]:
    """Just before an optimizer step: what the engine holds for each model, from its own specs and reports."""
    engine: Any = getattr(trainer.strategy, "engine", None)
    optimizer = trainer.optimizers[0]
    facts: dict[str, Any] = {
        "reference_trainable": sorted(n for n, p in module.reference.named_parameters() if p.requires_grad),
        "reference_with_gradient": sorted(n for n, p in module.reference.named_parameters() if p.grad is not None),
        "step_state_bytes": _state_bytes(optimizer, "step"),
    }
    if hasattr(engine, "manager"):  # Gemini
        report = engine.memory_report()
        chunks = engine.manager.chunks
        by_chunk = engine.memory_by_chunk()
        facts["gemini"] = {
            "trainable_names": sorted(m.name for c in chunks if not c.frozen for m in c.spec.members),
            "frozen_names": sorted(m.name for c in chunks if c.frozen for m in c.spec.members),
            "frozen_chunk_costs": [
                (b.master, b.gradient, b.optimizer_state, c.gradient is None, c.full_gradient is None)
                for c, b in zip(chunks, by_chunk, strict=True)
                if c.frozen
            ],
            "trainable_shard_numel": sum(c.spec.shard_numel for c in chunks if not c.frozen),
            "frozen_shard_bytes": report.frozen_shard_bytes,
            "replicated_bytes": report.replicated_bytes,
            "shard_bytes": report.chunks.shard,
            "gradient_bytes": report.chunks.gradient,
            "optimizer_state_bytes": report.chunks.optimizer_state,
            "optimizer_holds": sum(len(group["params"]) for group in optimizer.param_groups),
            "evictions": engine.evictions,
        }
    elif type(trainer.strategy).__name__ == "ColossalFSDPStrategy":
        from torch.distributed.tensor import DTensor

        reference = dict(module.reference.named_parameters())
        facts["fsdp"] = {
            "reference_sharded": all(isinstance(p, DTensor) for p in reference.values()),
            "reference_local_numel": sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel() for p in reference.values()
            ),
        }
    elif hasattr(engine, "masters_by_name"):  # ZeRO
        report = engine.memory_report()
        facts["zero"] = {
            "master_names": sorted(master.name for master in engine.sharded_masters),
            "master_numel": sum(master.spec.local_numel for master in engine.sharded_masters),
            "parameter_bytes": report.parameter_bytes,
            "gradient_bytes": report.gradient_bytes,
            "master_bytes": report.master_bytes,
            "optimizer_state_bytes": report.optimizer_state_bytes,
        }
    return facts


def check_accounting(strategy: str, optimizer: str, facts: dict[str, Any], rank: int) -> None:
    state = initial_state()
    policy = {name: tensor.shape for name, tensor in state.items() if name.startswith("policy.")}
    reference = {name: tensor.shape for name, tensor in state.items() if name.startswith("reference.")}
    # One name per tensor: the tied head is the embedding.
    policy = {name: shape for name, shape in policy.items() if not name.endswith("lm_head.weight")}
    reference = {name: shape for name, shape in reference.items() if not name.endswith("lm_head.weight")}
    policy_own = sum(own_numel(shape, WORLD_SIZE, rank) for shape in policy.values())
    reference_own = sum(own_numel(shape, WORLD_SIZE, rank) for shape in reference.values())
    moments = 2 * 4 * policy_own if optimizer == "adamw" else 0  # AdamW's two fp32 moments of the policy's rows
    assert facts["reference_trainable"] == facts["reference_with_gradient"] == []
    if strategy.startswith("gemini") and strategy != "gemini_whole_reference":
        gemini = facts["gemini"]
        assert gemini["trainable_names"] == sorted(policy)
        assert gemini["frozen_names"] == sorted(reference)
        assert gemini["trainable_shard_numel"] == policy_own
        # Frozen chunks: no master copy, no gradient buffer (shard or full), no optimizer state.
        assert gemini["frozen_chunk_costs"], "the reference must be in chunks of its own"
        assert set(gemini["frozen_chunk_costs"]) == {(0, 0, 0, True, True)}, gemini["frozen_chunk_costs"]
        assert gemini["frozen_shard_bytes"] == 4 * reference_own  # this rank's rows of the reference, nothing whole
        assert gemini["replicated_bytes"] == 0
        assert gemini["shard_bytes"] == 4 * (policy_own + reference_own)
        assert gemini["gradient_bytes"] == 4 * policy_own  # the policy's rows only
        assert gemini["optimizer_state_bytes"] == moments + facts["step_state_bytes"]
        assert gemini["optimizer_holds"] == len(policy)
    elif strategy == "gemini_whole_reference":
        gemini = facts["gemini"]
        assert gemini["trainable_names"] == sorted(policy)
        assert gemini["frozen_names"] == [] and gemini["frozen_shard_bytes"] == 0
        assert gemini["replicated_bytes"] == 4 * sum(math.prod(shape) for shape in reference.values())  # whole
        assert gemini["gradient_bytes"] == 4 * policy_own
        assert gemini["optimizer_state_bytes"] == moments + facts["step_state_bytes"]
    elif strategy == "fsdp":  # the reference sharded like the policy: this rank's rows of each tensor
        assert facts["fsdp"] == {"reference_sharded": True, "reference_local_numel": reference_own}
    elif strategy in ("zero1", "zero2"):
        zero = facts["zero"]
        assert zero["master_names"] == sorted(policy)
        assert zero["master_numel"] == policy_own
        whole = sum(math.prod(shape) for shape in [*policy.values(), *reference.values()])
        assert zero["parameter_bytes"] == 4 * whole  # both models whole on every rank
        assert zero["master_bytes"] == 0  # fp32 parameters are their own masters
        policy_whole = sum(math.prod(shape) for shape in policy.values())
        assert zero["gradient_bytes"] == 4 * (policy_own if strategy == "zero2" else policy_whole)
        assert zero["optimizer_state_bytes"] == moments + facts["step_state_bytes"]


# ------------------------------------------------------------------------------------------------- bodies
def global_batches(module: Any) -> Any:
    """A loader of the global batches: step ``k`` holds the ``k``-th batch of every rank of ``WORLD_SIZE``."""
    from torch.utils.data import DataLoader, DistributedSampler

    dataset = module.train_dataloader().dataset
    samplers: list[list[int]] = [
        list(DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=0))
        for rank in range(WORLD_SIZE)
    ]
    batches = [
        [index for indices in samplers for index in indices[start : start + BATCH_SIZE]]
        for start in range(0, len(samplers[0]), BATCH_SIZE)
    ]
    return DataLoader(dataset, batch_sampler=batches)


def train_body(
    strategy: str | None,
    optimizer: str,
    padded: bool,
    epochs: int | None = None,
    save_to: str | None = None,
    resume_from: str | None = None,
    variant: str = "",
    clip: float | None = None,
) -> dict[str, Any]:
    """Train the example's DPO module for ``STEPS`` steps (or ``epochs`` epochs of ``STEPS`` steps), optionally
    resuming from and saving a checkpoint; ``strategy=None`` is the oracle: plain Lightning, one process, both ranks'
    pairs in each batch."""
    from lightning.pytorch import Callback, seed_everything

    from tests.distributed.oracle import quiet_trainer

    class Probe(Callback):
        facts: dict[str, Any] = {}

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            if trainer.global_step == STEPS - 1:  # gradients in, optimizer state from the earlier steps
                Probe.facts = engine_accounting(trainer, module)

    seed_everything(0, verbose=False)
    world_size = 1 if strategy is None else torch.distributed.get_world_size()
    module = new_module(optimizer, padded, BATCH_SIZE * (WORLD_SIZE // world_size), variant)
    trainer = quiet_trainer(
        strategy="auto" if strategy is None else make_strategy(strategy),
        devices=world_size,
        max_steps=STEPS if epochs is None else -1,
        max_epochs=epochs,
        callbacks=[Probe()],
        limit_val_batches=0,
        gradient_clip_val=clip,
    )
    # The oracle's batches: at each step every rank's pairs, as Lightning's DistributedSampler (shuffled with the
    # seed of seed_everything) hands them to the ranks.
    trainer.fit(module, train_dataloaders=global_batches(module) if strategy is None else None, ckpt_path=resume_from)
    assert trainer.global_step == STEPS * (epochs or 1)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    if strategy is None:
        full = module.state_dict()
    else:
        strategy_object: Any = trainer.strategy
        full = strategy_object.full_model_state_dict()  # a collective: whole weights on every rank
    return {
        "losses": list(module.step_losses),
        "state": {name: tensor.detach().float().cpu().clone() for name, tensor in full.items()},
        "facts": Probe.facts,
    }


# ------------------------------------------------------------------------------------------------- tests
ORACLES: dict[tuple[str, bool, str, float | None], dict[str, Any]] = {}


def oracle(
    rank_pools: Any, optimizer: str, padded: bool, variant: str = "", clip: float | None = None
) -> dict[str, Any]:
    variant = "interleaved" if variant == "interleaved" else ""  # the only variant with other arithmetic
    key = (optimizer, padded, variant, clip)
    if key not in ORACLES:
        run = rank_pools.get(1).run
        ORACLES[key] = run(train_body, None, optimizer, padded, None, None, None, variant, clip, timeout=120)[0]
    return ORACLES[key]


def assert_trained_like_one_process(results: list[dict[str, Any]], expected: dict[str, Any], optimizer: str) -> None:
    initial = initial_state()
    # Losses: each rank's is the mean over its pairs, the oracle's the mean over both ranks' pairs.
    losses = [sum(result["losses"][step] for result in results) / len(results) for step in range(STEPS)]
    assert expected["losses"][0] == pytest.approx(math.log(2), abs=1e-6), "policy == reference at the start"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected["losses"]), rtol=RTOL, atol=LOSS_ATOL)
    state = results[0]["state"]
    assert set(state) == set(expected["state"]) == set(initial)
    policy = sorted(name for name in state if name.startswith("policy."))
    reference = sorted(name for name in state if name.startswith("reference."))
    moved = [name for name in policy if not torch.equal(expected["state"][name], initial[name])]
    assert moved == policy, "every policy tensor trains, or the comparison below would miss some"
    torch.testing.assert_close(
        {n: state[n] for n in policy}, {n: expected["state"][n] for n in policy}, rtol=RTOL, atol=WEIGHT_ATOL[optimizer]
    )
    # The reference never changes, bit for bit.
    torch.testing.assert_close({n: state[n] for n in reference}, {n: initial[n] for n in reference}, rtol=0, atol=0)
    for result in results[1:]:
        torch.testing.assert_close(result["state"], state, rtol=0, atol=0)


ROWS = [
    ("gemini", "adamw", True),
    ("gemini", "sgd", False),
    ("zero2", "sgd", True),
    ("zero2", "adamw", False),
]


@pytest.mark.parametrize(
    ("strategy", "optimizer", "padded"),
    ROWS,
    ids=[f"{s}-{o}-{'padded' if p else 'unpadded'}" for s, o, p in ROWS],
)
def test_dpo_trains_like_one_process_and_the_reference_costs_no_state(
    rank_pool_2, rank_pools, strategy, optimizer, padded
):
    results = rank_pool_2.run(train_body, strategy, optimizer, padded, timeout=180)
    assert_trained_like_one_process(results, oracle(rank_pools, optimizer, padded), optimizer)
    for rank, result in enumerate(results):
        check_accounting(strategy, optimizer, result["facts"], rank)


#: SGD with padding, each strategy or setting once: (strategy, module variant, gradient clipping). Variants:
#: reference and policy forwards taking turns (``interleaved``), activation checkpointing on the policy
#: (``checkpointed``: Gemini regathers the policy's chunks for the recomputation, the reference's stay released).
#: Clipping: the norm is the policy's alone, so a frozen parameter counted in it would change every step.
SGD_ROWS = {
    "zero1": ("zero1", "", None),
    "fsdp": ("fsdp", "", None),
    "ddp": ("ddp", "", None),
    "gemini-whole-reference": ("gemini_whole_reference", "", None),
    "gemini-offloaded": ("gemini_offloaded", "", None),
    "gemini-auto-prefetch": ("gemini_auto_prefetch", "", None),
    "gemini-interleaved": ("gemini", "interleaved", None),
    "zero2-interleaved": ("zero2", "interleaved", None),
    "gemini-checkpointed": ("gemini", "checkpointed", None),
    "gemini-clipped": ("gemini", "", CLIP),
    "zero2-clipped": ("zero2", "", CLIP),
}


@pytest.mark.parametrize(("strategy", "variant", "clip"), list(SGD_ROWS.values()), ids=list(SGD_ROWS))
def test_dpo_under_other_strategies_and_settings(rank_pool_2, rank_pools, strategy, variant, clip):
    results = rank_pool_2.run(train_body, strategy, "sgd", True, None, None, None, variant, clip, timeout=180)
    assert_trained_like_one_process(results, oracle(rank_pools, "sgd", True, variant, clip), "sgd")
    for rank, result in enumerate(results):
        check_accounting(strategy, "sgd", result["facts"], rank)
        if strategy == "gemini_auto_prefetch":
            assert result["facts"]["gemini"]["evictions"] > 0


def example_body(strategy: str, root: str, *extra: str) -> dict[str, Any]:
    world_size = str(torch.distributed.get_world_size())
    arguments = ["--strategy", strategy, "--devices", world_size, "--accelerator", "cpu", "--root", root]
    return load_example().main([*arguments, "--max-steps", "2", "--batch-size", "2", *extra])


@pytest.mark.parametrize("strategy", ["colossal_gemini", "colossal_zero2"])
def test_dpo_example_runs(rank_pool_2, tmp_path, strategy):
    """The example's main, two steps: from the tiny Llama in memory, and from it saved as a from_pretrained
    directory that both models read through ``pretrained_on_meta`` (Gemini reads each rank's rows into its chunks,
    the reference's into frozen ones): the same losses."""
    results = rank_pool_2.run(example_body, strategy, str(tmp_path), timeout=180)
    for result in results:
        assert result["steps"] == 2
        assert 0 < result["train_loss"] < 1  # ln 2 = 0.69 at the start
        assert "val_reward_accuracy" in result
        assert result["memory"]["optimizer state"] > 0
    if strategy == "colossal_gemini":
        memory = results[0]["memory"]
        assert memory["reference shards (frozen)"] == memory["policy shards"] > 0
    directory = tmp_path / "tiny_llama"
    load_example().tiny_llama().save_pretrained(directory)
    from_files = rank_pool_2.run(example_body, strategy, str(tmp_path), "--model", str(directory), timeout=180)
    for result, in_memory in zip(from_files, results, strict=True):
        assert result["memory"] == in_memory["memory"]
        for name in ("train_loss", "val_loss", "train_reward_accuracy"):
            assert result[name] == pytest.approx(in_memory[name], rel=1e-6, abs=1e-7), name


@pytest.mark.parametrize("strategy", ["gemini", "zero2"])
def test_dpo_resumes_with_the_frozen_reference(rank_pool_2, tmp_path, strategy):
    """A checkpoint holds both models (Gemini: the reference's frozen chunks too); resumed at an epoch boundary, the
    run lands where an uninterrupted one does, and the checkpoint file alone rebuilds the module."""
    checkpoint = str(tmp_path / "epoch1.ckpt")
    saved = rank_pool_2.run(train_body, strategy, "adamw", True, 1, checkpoint, timeout=180)[0]["state"]
    resumed = rank_pool_2.run(train_body, strategy, "adamw", True, 2, None, checkpoint, timeout=180)
    uninterrupted = rank_pool_2.run(train_body, strategy, "adamw", True, 2, timeout=180)
    torch.testing.assert_close(resumed[0]["state"], uninterrupted[0]["state"], rtol=0, atol=0)
    torch.testing.assert_close(resumed[1]["state"], resumed[0]["state"], rtol=0, atol=0)
    initial = initial_state()
    reference = {name: tensor for name, tensor in initial.items() if name.startswith("reference.")}
    torch.testing.assert_close({n: resumed[0]["state"][n] for n in reference}, reference, rtol=0, atol=0)
    # Strict: a checkpoint without the reference's (or the policy's) weights would be refused here.
    loaded = load_example().DPOModule.load_from_checkpoint(checkpoint, weights_only=False)
    torch.testing.assert_close(
        {name: tensor.float() for name, tensor in loaded.state_dict().items()}, saved, rtol=0, atol=0
    )
