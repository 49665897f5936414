"""Lightning's weight-averaging callbacks under every strategy.

``EMAWeightAveraging`` and ``WeightAveraging`` (the SWA average) train, validate, end and checkpoint exactly as the
same callback under one process with Lightning's own strategy (``"ddp"``, whose sampler order the strategies share),
with plain SGD so a wrong
gradient scale shows: the validation loss of the averaged weights, the weights after ``fit`` (the average) and the
checkpoint's average and current weights. Under the sharding strategies each rank keeps only its part of the average
(``strategies/weight_averaging.py``). ``StochasticWeightAveraging`` is refused where ranks hold pieces, naming
``WeightAveraging``. ``BackboneFinetuning`` trains like one process under colossal_ddp, colossal_fsdp and ZeRO (which
rebuilds its engine when the backbone joins) and is refused by Gemini and hybrid parallelism.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch.callbacks as lightning_callbacks
import pytest
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging
from torch.utils.data import DataLoader

from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec
from tests.distributed.hybrid_bodies import TinyGPTModule
from tests.distributed.oracle import RegressionModule, float_state, make_dataset, new_module, quiet_trainer
from tests.distributed.test_workflow_rows import _strategy

pytestmark = pytest.mark.skipif(
    not hasattr(lightning_callbacks, "EMAWeightAveraging"), reason="EMAWeightAveraging arrived in Lightning 2.6"
)

DECAY = 0.5
GLOBAL_BATCH = 8
ORACLE: StrategySpec = ("lightning_ddp", {})  # Lightning's own strategy and its own callback code
STRATEGIES: dict[str, StrategySpec] = {
    "ddp": DDP,
    "zero1": ZERO1,
    "zero2": ZERO2,
    "zero2_offload": ("zero", {"stage": 2, "cpu_offload": True}),
    "gemini": GEMINI,
    "fsdp": FSDP,
    "hybrid_dp": ("hybrid", {"zero_stage": 1}),
}
#: Where each rank keeps about half of the average at 2 ranks (masters sharded).
HALVED = {"zero1", "zero2", "zero2_offload", "gemini", "fsdp"}
PIECES: dict[str, StrategySpec] = {"gemini": GEMINI, "fsdp": FSDP, "hybrid_tp2": ("hybrid", {"tp_size": 2})}


class AveragedRegression(RegressionModule):
    """Plain SGD (a wrong gradient scale or a wrong average shows) and a validation set the average is judged on."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def validation_step(self, batch: Any, batch_index: int) -> None:
        inputs, targets = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.model(inputs), targets), sync_dist=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(make_dataset(16), batch_size=self.batch_size)


class ValidationLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["val_loss"]))


class SaveAtStep(Callback):
    def __init__(self, path: str, step: int) -> None:
        self.path, self.step = path, step

    def on_train_batch_end(self, trainer: Any, *arguments: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def _trainer_strategy(spec: StrategySpec) -> Any:
    return "ddp" if spec == ORACLE else _strategy(spec)


def _averaging_callback(kind: str) -> Any:
    if kind == "ema":
        return lightning_callbacks.EMAWeightAveraging(decay=DECAY)
    return lightning_callbacks.WeightAveraging()  # the SWA average, updated after every step


def _module() -> AveragedRegression:
    new_module()  # the oracle's seed, so every world size starts from the same weights
    return AveragedRegression(batch_size=GLOBAL_BATCH // torch.distributed.get_world_size())


def _average_numel(callback: Any) -> int:
    from lightning_colossal.engine_parts.weight_average import local_part

    unique = {id(value): value for value in callback._average_model.state.values()}
    return sum(local_part(value).numel() for value in unique.values())


def averaging_body(spec: StrategySpec, kind: str, checkpoint: str | None = None) -> dict[str, Any]:
    module = _module()
    averaging, validation = _averaging_callback(kind), ValidationLosses()
    callbacks = [averaging, validation] + ([SaveAtStep(checkpoint, 3)] if checkpoint else [])
    trainer = quiet_trainer(
        strategy=_trainer_strategy(spec),
        devices=torch.distributed.get_world_size(),
        max_steps=5,
        val_check_interval=2,
        callbacks=callbacks,
    )
    trainer.fit(module)
    kept = _average_numel(averaging) if hasattr(averaging._average_model, "state") else None
    return {"weights": float_state(module), "validation": validation.losses, "average_numel": kept}


def resume_body(spec: StrategySpec, kind: str, checkpoint: str) -> dict[str, Any]:
    module = _module()
    validation = ValidationLosses()
    trainer = quiet_trainer(
        strategy=_trainer_strategy(spec),
        devices=torch.distributed.get_world_size(),
        max_steps=5,
        val_check_interval=2,
        callbacks=[_averaging_callback(kind), validation],
    )
    trainer.fit(module, ckpt_path=checkpoint)
    return {"weights": float_state(module), "validation": validation.losses}


def _assert_same(result: dict[str, Any], reference: dict[str, Any], label: str) -> None:
    assert len(result["validation"]) == len(reference["validation"]) > 0, label
    torch.testing.assert_close(result["validation"], reference["validation"], rtol=1e-5, atol=1e-7, msg=label)
    for name, value in reference["weights"].items():
        torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-7, msg=f"{label}: {name}")


@pytest.fixture(scope="module")
def oracle(rank_pools, tmp_path_factory) -> dict[str, Any]:
    """Lightning's own strategy and callback, one process on the global batch: a fit per averaging kind, and for EMA
    a checkpoint saved mid-fit and the fit resumed from it (what every checkpoint row is compared with)."""
    one = rank_pools.get(1)
    path = str(tmp_path_factory.mktemp("oracle") / "reference.ckpt")
    return {
        "ema": one.run(averaging_body, ORACLE, "ema", path, timeout=120)[0],
        "swa": one.run(averaging_body, ORACLE, "swa", timeout=120)[0],
        "checkpoint": path,
        "resumed": one.run(resume_body, ORACLE, "ema", path, timeout=120)[0],
    }


# EMA under every strategy; the SWA average (another arithmetic through the same code) under a row and a shard mode.
@pytest.mark.parametrize(
    ("strategy_name", "kind"), [(name, "ema") for name in STRATEGIES] + [("zero2", "swa"), ("gemini", "swa")]
)
def test_averaging_trains_validates_and_ends_like_one_process(rank_pools, oracle, strategy_name, kind):
    reference = oracle[kind]
    total = sum(value.numel() for value in reference["weights"].values())
    results = rank_pools.get(2).run(averaging_body, STRATEGIES[strategy_name], kind, timeout=120)
    for rank, result in enumerate(results):
        _assert_same(result, reference, f"{strategy_name} rank {rank}")
        if strategy_name in HALVED:
            # Each rank keeps its part of the average, not a whole copy of the model.
            assert result["average_numel"] <= 0.6 * total, (result["average_numel"], total)


def test_the_oracle_validates_and_ends_on_the_average(rank_pools, oracle):
    # Guards the comparison above: with the callback, validation and the weights after fit are not the trained ones.
    with_average = oracle["ema"]
    without = rank_pools.get(1).run(plain_body, timeout=120)[0]
    assert len(without["validation"]) == len(with_average["validation"]) == 2
    assert without["validation"][1] != with_average["validation"][1]
    assert not torch.equal(without["weights"]["model.input.weight"], with_average["weights"]["model.input.weight"])


def plain_body() -> dict[str, Any]:
    module = _module()
    validation = ValidationLosses()
    trainer = quiet_trainer(strategy="ddp", devices=1, max_steps=5, val_check_interval=2, callbacks=[validation])
    trainer.fit(module)
    return {"weights": float_state(module), "validation": validation.losses}


@pytest.mark.parametrize(
    ("saved_by", "saved_ranks", "resumed_by", "resumed_ranks"),
    [
        ("gemini", 2, "zero2", 1),
        ("zero2", 2, "gemini", 2),
        ("fsdp", 2, "hybrid_dp", 1),
        # Lightning's own single-file checkpoint resumed here (the other way Lightning reads the file's weights, not
        # the optimizer state in the shards: the file's entries are compared with Lightning's in every row).
        ("lightning_ddp", 1, "fsdp", 2),
    ],
)
def test_checkpoint_keeps_the_average_across_strategies_and_world_sizes(
    rank_pools, oracle, tmp_path, saved_by, saved_ranks, resumed_by, resumed_ranks
):
    # Both directions between these strategies' format and Lightning's own single file.
    specs = {**STRATEGIES, "lightning_ddp": ORACLE}
    reference_path, reference = oracle["checkpoint"], oracle["resumed"]
    path = reference_path if saved_by == "lightning_ddp" else str(tmp_path / "saved.ckpt")
    if path != reference_path:
        rank_pools.get(saved_ranks).run(averaging_body, specs[saved_by], "ema", path, timeout=120)
    # The file is a Lightning checkpoint: `state_dict` the average, `current_model_state` the weights trained.
    saved, expected = (torch.load(file, weights_only=False) for file in (path, reference_path))
    for key in ("state_dict", "current_model_state"):
        assert set(saved[key]) == set(expected[key]), key
        for name, value in expected[key].items():
            torch.testing.assert_close(saved[key][name].float(), value.float(), rtol=1e-5, atol=1e-7, msg=name)
    assert int(saved["averaging_state"]["n_averaged"]) == int(expected["averaging_state"]["n_averaged"]) == 3
    assert not torch.equal(
        saved["state_dict"]["model.input.weight"], saved["current_model_state"]["model.input.weight"]
    )
    for rank, result in enumerate(rank_pools.get(resumed_ranks).run(resume_body, specs[resumed_by], "ema", path)):
        _assert_same(result, reference, f"{saved_by} -> {resumed_by} rank {rank}")


def two_averages_body() -> str:
    trainer = quiet_trainer(
        strategy=_strategy(ZERO2),
        devices=2,
        max_steps=1,
        callbacks=[lightning_callbacks.EMAWeightAveraging(), lightning_callbacks.WeightAveraging()],
    )
    try:
        trainer.fit(_module())
    except ValueError as error:
        return str(error)
    return ""


def test_two_averaging_callbacks_are_refused_naming_both(rank_pool_2):
    for message in rank_pool_2.run(two_averages_body, timeout=120):
        assert "EMAWeightAveraging, WeightAveraging" in message and "keep one of them" in message, message


def refusal_body(spec: StrategySpec) -> str:
    trainer = quiet_trainer(
        strategy=_strategy(spec), devices=2, max_steps=2, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)]
    )
    # Tensor parallelism needs a model it can split: the tiny GPT (the regression model is refused for that).
    module = TinyGPTModule() if spec[1].get("tp_size", 1) > 1 else new_module()
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return ""


@pytest.mark.parametrize("strategy_name", list(PIECES))
def test_stochastic_weight_averaging_is_refused_where_ranks_hold_pieces_naming_weight_averaging(
    rank_pool_2, strategy_name
):
    for message in rank_pool_2.run(refusal_body, PIECES[strategy_name], timeout=120):
        assert message.startswith("ValueError: StochasticWeightAveraging"), message
        assert "Use `WeightAveraging()` instead" in message and "`colossal_zero2`" in message, message


def finetuning_body(spec: StrategySpec) -> str:
    from lightning.pytorch.callbacks import BackboneFinetuning

    module = new_module()
    module.backbone = module.model.input  # BackboneFinetuning freezes `backbone`, then adds it to the optimizer
    trainer = quiet_trainer(
        strategy=_strategy(spec), devices=2, max_epochs=2, callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1)]
    )
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return ""


@pytest.mark.parametrize("strategy_name", ["zero2", "gemini", "hybrid_dp"])
def test_engines_refuse_callbacks_that_add_parameters_to_the_optimizer_mid_run(rank_pool_2, strategy_name):
    spec = {**STRATEGIES, **PIECES}[strategy_name]
    for message in rank_pool_2.run(finetuning_body, spec, timeout=120):
        assert message.startswith("ValueError: BackboneFinetuning reads the optimizer's param groups"), message
        if strategy_name == "zero2":  # ZeRO takes the same unfreezing written by hand
            assert "Unfreeze by hand instead" in message and "add_param_group" in message, message
        else:
            assert "in its own param group with a lower learning rate" in message, message


def backbone_unfrozen_body(spec: StrategySpec, batch_size: int, by_hand: str | None = None) -> dict[str, Any]:
    """BackboneFinetuning with plain SGD (a wrong gradient scale shows): the backbone is frozen when the strategy wraps
    the model and joins the optimizer in epoch 1. Returns the whole weights and the backbone's weights at unfreezing."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    from tests.distributed.oracle import RegressionModule

    class SGDRegression(RegressionModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    class UnfreezeByHand(Callback):
        """At epoch 1 the frozen backbone is made trainable: held by the optimizer from the start (``"requires_grad"``),
        or added to it as a group, as ``BackboneFinetuning`` does (``"add_group"``)."""

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.current_epoch != 1:
                return
            pl_module.model.input.requires_grad_(True)
            if by_hand == "add_group":
                group = {"params": list(pl_module.model.input.parameters()), "lr": 0.05}
                trainer.optimizers[0].add_param_group(group)

    class SGDWithoutFrozen(SGDRegression):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)

    new_module()  # the oracle's seed, so every world size starts from the same weights
    module_class = SGDWithoutFrozen if by_hand == "add_group" else SGDRegression
    module = module_class(batch_size=batch_size, frozen=("input",) if by_hand else ())
    module.backbone = module.model.input  # BackboneFinetuning freezes `backbone`, then adds it to the optimizer
    initial_backbone = {name: value.clone() for name, value in module.backbone.state_dict().items()}
    unfreezing = (
        UnfreezeByHand() if by_hand else BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.05)
    )
    trainer = quiet_trainer(
        strategy=_trainer_strategy(spec),
        devices=torch.distributed.get_world_size(),
        max_epochs=2,
        callbacks=[unfreezing],
    )
    trainer.fit(module)
    return {"weights": float_state(module), "initial_backbone": initial_backbone}


def test_a_backbone_unfrozen_mid_run_trains_like_one_process(rank_pools):
    # torch DDP hooks only the parameters trainable when it wraps the model: without the strategy averaging the late
    # ones, each rank trained its own backbone (ddp.py [Note: parameters that become trainable after wrapping]).
    # FSDP failed at setup on the `backbone` alias of a submodule (fsdp/wrap.py, parameter_holding_children).
    reference = rank_pools.get(1).run(backbone_unfrozen_body, DDP, 8, timeout=120)[0]
    assert not torch.equal(reference["weights"]["model.input.weight"], reference["initial_backbone"]["weight"])
    for spec in (DDP, FSDP):
        for result in rank_pools.get(2).run(backbone_unfrozen_body, spec, 4, timeout=120):
            for name, value in reference["weights"].items():
                torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6, msg=f"{spec}: {name}")


def model_parallel_averaging_body(strategy: StrategySpec | str) -> dict[str, Any]:
    from lightning import seed_everything

    from tests.distributed.hybrid_bodies import MODEL_SEED, full_weights

    seed_everything(MODEL_SEED, verbose=False)
    module = TinyGPTModule()
    validation = ValidationLosses()
    trainer = quiet_trainer(
        strategy=_trainer_strategy(strategy) if isinstance(strategy, tuple) else strategy,
        devices=torch.distributed.get_world_size(),
        max_steps=4,
        val_check_interval=2,
        limit_val_batches=2,
        callbacks=[lightning_callbacks.EMAWeightAveraging(decay=DECAY), validation],
    )
    trainer.fit(module)
    weights = full_weights(module, trainer.strategy) if isinstance(strategy, tuple) else float_state(module)
    return {"weights": weights, "validation": validation.losses}


@pytest.mark.parametrize("layout", [{"tp_size": 2}, {"pp_size": 2, "num_microbatches": 2}], ids=["tp2", "pp2"])
def test_averaging_under_model_parallelism_averages_each_ranks_pieces_like_one_process(rank_pools, layout):
    reference = rank_pools.get(1).run(model_parallel_averaging_body, "ddp", timeout=120)[0]
    for rank, result in enumerate(rank_pools.get(2).run(model_parallel_averaging_body, ("hybrid", layout))):
        assert len(result["validation"]) == len(reference["validation"]) == 2
        torch.testing.assert_close(result["validation"], reference["validation"], rtol=1e-4, atol=1e-6)
        for name, value in result["weights"].items():  # a pipeline stage holds its own layers
            # AdamW turns the tensor-parallel sums' last-bit differences into ~1e-5 differences of the weights.
            torch.testing.assert_close(value, reference["weights"][name], rtol=1e-4, atol=2e-4, msg=f"{rank}: {name}")


@pytest.mark.parametrize("by_hand", ["requires_grad", "add_group"])
@pytest.mark.parametrize(
    "spec", [ZERO1, ZERO2, ("zero", {"stage": 2, "cpu_offload": True})], ids=["zero1", "zero2", "zero2_offload"]
)
def test_a_backbone_unfrozen_by_hand_trains_like_one_process(rank_pools, spec, by_hand):
    # "requires_grad": the optimizer was built over every parameter, the backbone frozen; `requires_grad_(True)` alone
    # unfreezes it, as in plain torch (the engine had dropped it at takeover, so it never trained). "add_group": the
    # backbone joins as a new param group. ZeRO rebuilds its engine over the optimizer (zero/engine.py [Note:
    # parameters that join the optimizer]); with offload the masters are separate fp32 copies, which carry over.
    reference = rank_pools.get(1).run(backbone_unfrozen_body, DDP, 8, by_hand, timeout=120)[0]
    assert not torch.equal(reference["weights"]["model.input.weight"], reference["initial_backbone"]["weight"])
    for result in rank_pools.get(2).run(backbone_unfrozen_body, spec, 4, by_hand, timeout=120):
        for name, value in reference["weights"].items():
            torch.testing.assert_close(result["weights"][name], value, rtol=1e-5, atol=1e-6, msg=name)


def group_added_body(spec: StrategySpec, by_hand: str) -> str:
    try:
        backbone_unfrozen_body(spec, 4, by_hand)
    except ValueError as error:
        return str(error)
    return ""


@pytest.mark.parametrize("by_hand", ["requires_grad", "add_group"])
@pytest.mark.parametrize("strategy_name", ["gemini", "hybrid_dp"])
def test_unfreezing_by_hand_is_refused_where_the_engine_cannot_take_it(rank_pool_2, strategy_name, by_hand):
    expected = {
        "requires_grad": "A parameter the optimizer held frozen was made trainable",
        "add_group": "A param group was added to the optimizer during training",
    }[by_hand]
    for message in rank_pool_2.run(group_added_body, {**STRATEGIES, **PIECES}[strategy_name], by_hand, timeout=120):
        assert message.startswith(expected), message
        assert "`colossal_zero1` / `colossal_zero2`" in message, message
