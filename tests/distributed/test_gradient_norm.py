"""``trainer.strategy.gradient_norm()``: the norm of the whole gradient, the same under every strategy.

Lightning's ``grad_norm(module)`` reads ``parameter.grad``. Under ZeRO-2 and Gemini the reduced gradient lives in
shards the engine owns and ``.grad`` is empty, so it silently logs nothing; under FSDP ``.grad`` is a DTensor shard
and it fails. The strategy method asks the engine, which knows where every piece of the gradient is. Checked against
single-process PyTorch at every step, before clipping, for the 1-, 2- and max-norm, with accumulation and a clip that
triggers (the norm must be the one before clipping).
"""

from __future__ import annotations

from typing import Any

import pytest
from lightning.pytorch import seed_everything

from lightning_colossal import StaticPlacement, ZeroStrategy
from tests.distributed.checkpoint_bodies import DDP, FSDP, GEMINI, ZERO1, ZERO2, StrategySpec
from tests.distributed.hybrid_bodies import TinyGPTModule
from tests.distributed.hybrid_bodies import oracle as hybrid_oracle
from tests.distributed.oracle import MODEL_SEED, NORM_TYPES, RegressionModule, oracle_train, quiet_trainer
from tests.distributed.test_workflow_rows import _strategy

STEPS = 3
ACCUMULATE = 2
CLIP_NORM = 0.05
STRATEGIES: dict[str, StrategySpec] = {
    "ddp": DDP,
    "zero1": ZERO1,
    "zero2": ZERO2,
    "gemini": GEMINI,
    "gemini_offload": (
        "gemini",
        {"chunk_numel": 1100, "placement": StaticPlacement(offload_optim_frac=1.0, offload_param_frac=1.0)},
    ),
    "fsdp": FSDP,
    "hybrid_dp": ("hybrid", {"zero_stage": 1}),
}


class RecordsGradientNorms:
    """Mixin for a LightningModule: ``norms`` gets every norm type of ``strategy.gradient_norm`` before each step."""

    norms: list[dict[float, float]]

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        strategy = self.trainer.strategy  # type: ignore[attr-defined]
        measured = {norm_type: strategy.gradient_norm(norm_type).item() for norm_type in NORM_TYPES}
        self.__dict__.setdefault("norms", []).append(measured)


class NormRecordingModule(RecordsGradientNorms, RegressionModule):
    pass


def assert_norms_match(results: list[list[dict[float, float]]], expected: list[dict[float, float]], rel: float) -> None:
    for norms in results:
        assert len(norms) == STEPS
        for step, (got, want) in enumerate(zip(norms, expected, strict=True)):
            for norm_type in NORM_TYPES:
                assert got[norm_type] == pytest.approx(want[norm_type], rel=rel), (step, norm_type)


def gradient_norm_body(spec: StrategySpec) -> list[dict[float, float]]:
    seed_everything(MODEL_SEED, verbose=False)  # the oracle's initial weights and sampler seed
    module = NormRecordingModule()
    trainer = quiet_trainer(
        strategy=_strategy(spec),
        devices=2,
        max_steps=STEPS,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=CLIP_NORM,
    )
    trainer.fit(module)
    return module.norms


@pytest.fixture(scope="module")
def expected() -> list[dict[float, float]]:
    oracle = oracle_train(world_size=2, steps=STEPS, accumulate=ACCUMULATE, clip_norm=CLIP_NORM)
    assert min(norms[2.0] for norms in oracle.gradient_norms) > CLIP_NORM, "the clip must trigger"
    return oracle.gradient_norms


@pytest.mark.parametrize("strategy_name", list(STRATEGIES))
def test_gradient_norm_equals_single_process(rank_pool_2, expected, strategy_name):
    assert_norms_match(rank_pool_2.run(gradient_norm_body, STRATEGIES[strategy_name], timeout=120), expected, 1e-5)


def refusal_body() -> list[str]:
    messages = []
    strategy = ZeroStrategy(stage=2)
    for call in (lambda: strategy.gradient_norm(0.5), lambda: strategy.gradient_norm()):
        try:
            call()
        except (ValueError, RuntimeError) as error:
            messages.append(str(error))
    return messages


def test_gradient_norm_refuses_what_it_cannot_measure() -> None:
    messages = refusal_body()
    assert len(messages) == 2
    assert "norm_type=0.5 is not a norm" in messages[0]
    assert "no optimizer yet" in messages[1] and "on_before_optimizer_step" in messages[1]


# ---------------------------------------------------------------------------------- Lightning's grad_norm(module)
class LogsLightningGradNorm(RegressionModule):
    """Lightning's documented way: ``grad_norm(self)`` in ``on_before_optimizer_step``; keeps what it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.grad_norms: list[dict[str, float]] = []
        self.use_strategy = False  # log trainer.strategy.gradient_norm() instead

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        if self.use_strategy:
            self.grad_norms.append({"total": float(self.trainer.strategy.gradient_norm())})
            return
        self.grad_norms.append({name: float(value) for name, value in grad_norm(self, norm_type=2).items()})


def lightning_grad_norm_body(spec: StrategySpec, reader: str = "grad_norm") -> dict[str, Any]:
    import warnings

    seed_everything(MODEL_SEED, verbose=False)
    module = LogsLightningGradNorm()
    module.use_strategy = reader == "gradient_norm"
    trainer = quiet_trainer(strategy=_strategy(spec), devices=2, max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module)
            error = ""
        except Exception as exception:  # noqa: BLE001 - the message is the result
            error = f"{type(exception).__name__}: {exception}"  # the message alone, not notes under the traceback
    messages = [str(warning.message) for warning in caught if "grad_norm" in str(warning.message)]
    return {"norms": module.grad_norms, "error": error, "warnings": messages}


GRAD_NORM_WORKS = ("ddp", "zero1", "hybrid_dp")  # every parameter's .grad is whole there


@pytest.mark.parametrize("strategy_name", ["ddp", "zero1", "zero2", "gemini", "fsdp", "hybrid_dp"])
def test_lightning_grad_norm_logs_ddp_norms_or_warns_once_naming_gradient_norm(rank_pool_2, strategy_name):
    reference = rank_pool_2.run(lightning_grad_norm_body, DDP, timeout=120)[0]
    assert reference["error"] == "" and len(reference["norms"]) == STEPS and reference["warnings"] == []
    results = rank_pool_2.run(lightning_grad_norm_body, STRATEGIES[strategy_name], timeout=120)
    if strategy_name in GRAD_NORM_WORKS:
        for result in results:
            assert result["error"] == "" and result["warnings"] == []
            assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5)
        return
    rank_zero = results[0]
    if strategy_name == "fsdp":  # fails inside grad_norm; the error names the fix
        assert "trainer.strategy.gradient_norm(norm_type)" in rank_zero["error"], rank_zero
        assert "trainer.strategy.gradient_norms(self, norm_type)" in rank_zero["error"], rank_zero
        return
    assert rank_zero["error"] == "" and all(norms == {} for norms in rank_zero["norms"])
    assert len(rank_zero["warnings"]) == 1, rank_zero["warnings"]
    assert "trainer.strategy.gradient_norm(norm_type)" in rank_zero["warnings"][0]
    assert "trainer.strategy.gradient_norms(self, norm_type)" in rank_zero["warnings"][0]  # grad_norm's own dict


def test_no_grad_norm_warning_when_the_hook_asks_gradient_norm(rank_pool_2):
    results = rank_pool_2.run(lightning_grad_norm_body, ZERO2, "gradient_norm", timeout=120)
    assert results[0]["error"] == "" and results[0]["warnings"] == []


# ---------------------------------------------------------------------------------- tensor and pipeline parallelism
HYBRID_CASES = {
    "tp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "num_microbatches": 2},
}


class NormRecordingGPT(RecordsGradientNorms, TinyGPTModule):
    pass


def hybrid_gradient_norm_body(strategy_kwargs: dict[str, Any]) -> list[dict[float, float]]:
    from lightning_colossal import HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    module = NormRecordingGPT()
    trainer = quiet_trainer(strategy=HybridParallelStrategy(**strategy_kwargs), devices=2, max_steps=STEPS)
    trainer.fit(module)
    return module.norms


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_gradient_norm_under_tensor_and_pipeline_parallelism(rank_pool_2, case):
    expected = hybrid_oracle(dp_size=1, steps=STEPS)["gradient_norms"]
    assert_norms_match(rank_pool_2.run(hybrid_gradient_norm_body, HYBRID_CASES[case], timeout=300), expected, 1e-4)


# ---------------------------------------------------------------------------------- gradient_norms(module): grad_norm's dict
class LogsPerParameterNorms(RegressionModule):
    """Per step: ``grad_norm``'s dicts (``reader="grad_norm"``, meaningful where ``.grad`` is whole) or the strategy's
    ``gradient_norms`` (``reader="strategy"``), for the module and a submodule, at norm 2, 1 and inf."""

    def __init__(self, reader: str) -> None:
        super().__init__()
        self.reader = reader
        self.per_step: list[dict[str, float]] = []

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        from lightning.pytorch.utilities import grad_norm

        logged: dict[str, float] = {}
        for module, tag in ((self, "module"), (self.model.hidden, "submodule")):
            for norm_type in (2, 1, "inf"):
                if self.reader == "strategy":
                    norms = self.trainer.strategy.gradient_norms(module, norm_type)
                else:
                    norms = grad_norm(module, norm_type)
                logged.update({f"{tag}:{key}": float(value) for key, value in norms.items()})
        self.per_step.append(logged)


def per_parameter_norms_body(spec: StrategySpec, reader: str) -> dict[str, Any]:
    import warnings

    seed_everything(MODEL_SEED, verbose=False)
    module = LogsPerParameterNorms(reader)
    trainer = quiet_trainer(strategy=_strategy(spec), devices=2, max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)
    return {"norms": module.per_step, "warnings": [str(w.message) for w in caught if "grad_norm" in str(w.message)]}


@pytest.mark.parametrize(
    "strategy_name",
    [
        "zero2",
        "gemini",
        "fsdp",
        *(pytest.param(name, marks=pytest.mark.slow) for name in ("ddp", "zero1", "gemini_offload")),
    ],
)
def test_gradient_norms_give_grad_norm_s_dict_under_ddp(rank_pool_2, strategy_name):
    """The same keys and values as Lightning's ``grad_norm`` under ddp, for the module and a submodule, at three
    norms, computed from the shards; no warning about grad_norm (the hook asked the strategy)."""
    reference = rank_pool_2.run(per_parameter_norms_body, DDP, "grad_norm", timeout=120)[0]["norms"]
    assert len(reference) == STEPS and all(reference)
    assert any(key.startswith("submodule:grad_inf_norm/") for key in reference[0])
    for result in rank_pool_2.run(per_parameter_norms_body, STRATEGIES[strategy_name], "strategy", timeout=120):
        assert result["warnings"] == []
        for step, (got, expected) in enumerate(zip(result["norms"], reference, strict=True)):
            assert set(got) == set(expected), (step, sorted(set(got) ^ set(expected)))
            for key, value in expected.items():
                assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


class AsksPerParameterNormsGPT(TinyGPTModule):
    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.trainer.strategy.gradient_norms(self)


def hybrid_per_parameter_norms_body() -> str:
    from lightning_colossal import HybridParallelStrategy

    seed_everything(MODEL_SEED, verbose=False)
    trainer = quiet_trainer(strategy=HybridParallelStrategy(tp_size=2), devices=2, max_steps=1)
    try:
        trainer.fit(AsksPerParameterNormsGPT())
    except ValueError as error:
        return str(error)
    return ""


def test_gradient_norms_under_tensor_parallelism_is_refused_naming_gradient_norm(rank_pool_2):
    for message in rank_pool_2.run(hybrid_per_parameter_norms_body, timeout=300):
        assert "gradient_norms() is not available" in message and "gradient_norm()" in message, message
