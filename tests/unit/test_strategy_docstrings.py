"""Every strategy documents every constructor argument in a form LightningCLI reads (Google style, one argument per
line): `--trainer.strategy.help GeminiStrategy` prints these descriptions, and a docstring the parser cannot read
silently drops all of them.

A strategy takes its own arguments and forwards ``**kwargs`` to the base constructor; jsonargparse follows that call,
so the arguments checked here are those LightningCLI offers, every base argument included."""

import inspect
from datetime import timedelta

import docstring_parser
import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch.strategies import Strategy

import lightning_colossal as lc
from lightning_colossal.config import AllToAll, FSDPConfig, GradientAveraging, PipelineConfig
from lightning_colossal.strategies.docstrings import constructor_arguments

STRATEGIES = [
    lc.ColossalDDPStrategy,
    lc.ZeroStrategy,
    lc.GeminiStrategy,
    lc.ColossalFSDPStrategy,
    lc.HybridParallelStrategy,
]
BASE_ARGUMENTS = [name for name in inspect.signature(lc.ColossalStrategy.__init__).parameters if name != "self"]

DOCUMENTED = [
    lc.ColossalDDPStrategy,
    lc.ZeroStrategy,
    lc.GeminiStrategy,
    lc.ColossalFSDPStrategy,
    lc.HybridParallelStrategy,
    lc.DDPConfig,
    lc.ZeroConfig,
    lc.GeminiConfig,
    lc.HybridConfig,
    PipelineConfig,
    GradientAveraging,
    AllToAll,
    FSDPConfig,
    lc.StaticPlacement,
    lc.AutoPlacement,
    lc.LossScalerConfig,
]


@pytest.mark.parametrize("documented", DOCUMENTED, ids=lambda cls: cls.__name__)
def test_every_argument_has_a_description_the_cli_can_read(documented):
    parsed = docstring_parser.parse(inspect.getdoc(documented), docstring_parser.DocstringStyle.GOOGLE)
    described = {parameter.arg_name: parameter.description for parameter in parsed.params}
    signature = inspect.signature(documented.__init__).parameters.values()
    named = {parameter.name for parameter in signature if parameter.kind is not parameter.VAR_KEYWORD} - {"self"}
    arguments = named | _arguments_the_cli_offers(documented)
    assert sorted(arguments - set(described)) == []
    assert all(described[name] for name in arguments)
    # The docstring completion follows `**kwargs` as jsonargparse does: both see the same arguments.
    assert set(constructor_arguments(documented)) == arguments


def _arguments_the_cli_offers(documented: type) -> set[str]:
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(documented, "init")
    return set(vars(parser.get_defaults().init))


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda cls: cls.__name__)
def test_every_strategy_takes_the_base_arguments(strategy):
    assert set(BASE_ARGUMENTS) <= _arguments_the_cli_offers(strategy)


def test_lightning_cli_help_shows_the_descriptions(capsys):
    from lightning_colossal.demo.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "lightning_colossal.GeminiStrategy"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "elements per chunk" in help_text
    assert "how long a collective may wait" in help_text


def test_lightning_cli_help_lists_the_base_arguments_with_their_descriptions(capsys):
    from lightning_colossal.demo.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "lightning_colossal.ColossalDDPStrategy"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in BASE_ARGUMENTS:
        assert f"--trainer.strategy.{name}" in help_text, name
    assert "gradient bucket size in MiB" in help_text
    assert "how long a collective may wait" in help_text
    assert "how ranks are found" in help_text


def test_a_config_sets_base_and_own_arguments():
    """`strategy: {class_path: ..., init_args: {...}}` in a LightningCLI YAML reaches both constructors."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    config = parser.parse_object(
        {
            "strategy": {
                "class_path": "lightning_colossal.ZeroStrategy",
                "init_args": {"timeout": "0:05:00", "stage": 2, "heartbeat_timeout": None, "start_method": "fork"},
            }
        }
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    strategy = instantiate(config).strategy
    assert isinstance(strategy, lc.ZeroStrategy)
    assert strategy.zero_config.stage == 2
    assert strategy._timeout == timedelta(minutes=5)
    assert strategy.heartbeat_timeout is None
    assert strategy._start_method == "fork"


def test_a_config_sets_the_hybrid_zero_arguments():
    """The flat `zero_stage` / `bucket_size_mb` (and ZeRO's `communication`) of a LightningCLI YAML reach the one
    ZeroConfig that `colossal_hybrid` hands its ZeRO engine."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    config = parser.parse_object(
        {
            "strategy": {
                "class_path": "lightning_colossal.HybridParallelStrategy",
                "init_args": {"tp_size": 2, "zero_stage": 1, "bucket_size_mb": 4.0, "communication": "all_reduce"},
            }
        }
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    strategy = instantiate(config).strategy
    assert isinstance(strategy, lc.HybridParallelStrategy)
    assert strategy.hybrid_config.tp_size == 2
    assert strategy.hybrid_config.data_parallel == lc.ZeroConfig(
        stage=1, bucket_size_mb=4.0, communication="all_reduce"
    )


def test_a_config_sets_the_hybrid_zero_settings_as_one_zero_config():
    """`zero: {stage: ..., <any ZeroConfig field>}` in a LightningCLI YAML becomes the ZeroConfig the hybrid engine
    runs with: a ZeRO option added to ZeroConfig reaches colossal_hybrid without a new argument of its own."""
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--strategy", type=Strategy)
    config = parser.parse_object(
        {
            "strategy": {
                "class_path": "lightning_colossal.HybridParallelStrategy",
                "init_args": {"tp_size": 2, "zero": {"stage": 2, "overlap_communication": False}},
            }
        }
    )
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    strategy = instantiate(config).strategy
    assert strategy.hybrid_config.data_parallel == lc.ZeroConfig(stage=2, overlap_communication=False)
    assert strategy.hybrid_config.zero_stage == 2


def test_hybrid_refuses_zero_settings_given_twice():
    with pytest.raises(ValueError, match="both configure ZeRO"):
        lc.HybridParallelStrategy(zero=lc.ZeroConfig(stage=1), bucket_size_mb=50.0)
    with pytest.raises(TypeError, match="pass a ZeroConfig"):
        lc.HybridParallelStrategy(zero={"stage": 1})
