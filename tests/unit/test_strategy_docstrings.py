"""Every strategy documents every constructor argument in a form LightningCLI reads (Google style, one argument per
line): `--trainer.strategy.help GeminiStrategy` prints these descriptions, and a docstring the parser cannot read
silently drops all of them."""

import inspect

import docstring_parser
import pytest

import lightning_colossal as lc

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
    lc.StaticPlacement,
    lc.AutoPlacement,
    lc.LossScalerConfig,
]


@pytest.mark.parametrize("documented", DOCUMENTED, ids=lambda cls: cls.__name__)
def test_every_argument_has_a_description_the_cli_can_read(documented):
    parsed = docstring_parser.parse(inspect.getdoc(documented), docstring_parser.DocstringStyle.GOOGLE)
    described = {parameter.arg_name: parameter.description for parameter in parsed.params}
    arguments = set(inspect.signature(documented.__init__).parameters) - {"self"}
    assert sorted(arguments - set(described)) == []
    assert all(described[name] for name in arguments)


def test_lightning_cli_help_shows_the_descriptions(capsys):
    from lightning_colossal.demo.cli import main

    with pytest.raises(SystemExit):
        main(["fit", "--trainer.strategy.help", "lightning_colossal.GeminiStrategy"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "elements per chunk" in help_text
    assert "how long a collective may wait" in help_text
