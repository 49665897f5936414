"""Lightning's weight-averaging callbacks under every strategy.

Where every rank holds every parameter whole (colossal_ddp, ZeRO-1/2, hybrid with data parallelism only) the model
after ``fit`` is the exponential moving average of the weights after each step, computed here by hand from those
weights. Where ranks hold pieces (Gemini, FSDP, hybrid tensor parallelism) the strategy refuses at setup with an
error naming the strategies that work, instead of torch's shape or DTensor error from inside the callback
(``strategies/callback_refusals.py``). ``BackboneFinetuning`` is refused by the engines that own the optimizer and
trains like one process under colossal_ddp and colossal_fsdp.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch.callbacks as lightning_callbacks
import pytest
import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging

from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec
from tests.distributed.hybrid_bodies import TinyGPTModule
from tests.distributed.oracle import float_state, new_module, quiet_trainer
from tests.distributed.test_workflow_rows import _strategy

pytestmark = pytest.mark.skipif(
    not hasattr(lightning_callbacks, "EMAWeightAveraging"), reason="EMAWeightAveraging arrived in Lightning 2.6"
)

DECAY = 0.5
WHOLE_PARAMETERS: dict[str, StrategySpec] = {
    "ddp": DDP,
    "zero1": ZERO1,
    "zero2": ZERO2,
    "hybrid_dp": ("hybrid", {"zero_stage": 1}),
}
PIECES: dict[str, StrategySpec] = {"gemini": GEMINI, "fsdp": FSDP, "hybrid_tp2": ("hybrid", {"tp_size": 2})}


class WeightsAfterEachStep(Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *arguments: Any) -> None:
        self.states.append(float_state(pl_module))


def exponential_average_body(spec: StrategySpec) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    module = new_module()
    recorder = WeightsAfterEachStep()
    averaging = lightning_callbacks.EMAWeightAveraging(decay=DECAY)
    trainer = quiet_trainer(strategy=_strategy(spec), devices=2, max_steps=4, callbacks=[recorder, averaging])
    trainer.fit(module)
    return float_state(module), recorder.states


@pytest.mark.parametrize("strategy_name", list(WHOLE_PARAMETERS))
def test_exponential_average_of_the_weights_after_each_step(rank_pool_2, strategy_name):
    final, states = rank_pool_2.run(exponential_average_body, WHOLE_PARAMETERS[strategy_name], timeout=120)[0]
    assert len(states) == 4
    # AveragedModel's first update copies the weights; each later one moves the average towards them by 1 - decay.
    expected = dict(states[0])
    for state in states[1:]:
        expected = {name: DECAY * expected[name] + (1 - DECAY) * state[name] for name in expected}
    assert set(final) == set(expected)
    for name in expected:
        torch.testing.assert_close(final[name], expected[name], rtol=1e-6, atol=1e-7, msg=name)
    # The average is not just the last weights: the callback did average.
    assert max((final[name] - states[-1][name]).abs().max().item() for name in final) > 1e-4


def refusal_body(spec: StrategySpec, callback_name: str) -> str:
    callback = (
        lightning_callbacks.EMAWeightAveraging(decay=DECAY)
        if callback_name == "ema"
        else StochasticWeightAveraging(swa_lrs=0.01)
    )
    trainer = quiet_trainer(strategy=_strategy(spec), devices=2, max_steps=2, callbacks=[callback])
    # Tensor parallelism needs a model it can split: the tiny GPT (the regression model is refused for that).
    module = TinyGPTModule() if spec[1].get("tp_size", 1) > 1 else new_module()
    try:
        trainer.fit(module)
    except Exception as error:  # noqa: BLE001 - the message is the result
        return f"{type(error).__name__}: {error}"
    return ""


@pytest.mark.parametrize(
    ("strategy_name", "callback_name"),
    [("gemini", "ema"), ("gemini", "swa"), ("fsdp", "ema"), ("hybrid_tp2", "ema")],
)
def test_strategies_holding_pieces_refuse_averaging_naming_the_strategies_that_work(
    rank_pool_2, strategy_name, callback_name
):
    messages = rank_pool_2.run(refusal_body, PIECES[strategy_name], callback_name, timeout=120)
    for message in messages:
        assert message.startswith("ValueError"), message
        expected_callback = "EMAWeightAveraging" if callback_name == "ema" else "StochasticWeightAveraging"
        assert expected_callback in message, message
        assert "`colossal_zero2`" in message and "`colossal_ddp`" in message, message


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
    spec = {**WHOLE_PARAMETERS, **PIECES}[strategy_name]
    for message in rank_pool_2.run(finetuning_body, spec, timeout=120):
        assert message.startswith("ValueError: BackboneFinetuning adds parameters to the optimizer"), message
        assert "in its own param group with a lower learning rate" in message, message


def backbone_unfrozen_body(spec: StrategySpec, batch_size: int) -> dict[str, Any]:
    """BackboneFinetuning with plain SGD (a wrong gradient scale shows): the backbone is frozen when the strategy wraps
    the model and joins the optimizer in epoch 1. Returns the whole weights and the backbone's weights at unfreezing."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    from tests.distributed.oracle import RegressionModule

    class SGDRegression(RegressionModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    new_module()  # the oracle's seed, so every world size starts from the same weights
    module = SGDRegression(batch_size=batch_size)
    module.backbone = module.model.input  # BackboneFinetuning freezes `backbone`, then adds it to the optimizer
    initial_backbone = {name: value.clone() for name, value in module.backbone.state_dict().items()}
    trainer = quiet_trainer(
        strategy=_strategy(spec),
        devices=torch.distributed.get_world_size(),
        max_epochs=2,
        callbacks=[BackboneFinetuning(unfreeze_backbone_at_epoch=1, backbone_initial_lr=0.05)],
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
