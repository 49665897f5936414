"""The engines still offer what ``engine_protocol.py`` says the strategies drive them through (names and parameter
names of each method), so an engine that drifts fails here rather than inside ``EngineStrategy``."""

from __future__ import annotations

import inspect

import pytest

from lightning_colossal.engine_protocol import MemoryReporting, NameKeyedOptimizerState, SkipsGradientSync, StepEngine
from lightning_colossal.gemini import GeminiEngine
from lightning_colossal.parallel import HybridEngine
from lightning_colossal.zero import ZeroEngine

# The table in engine_protocol.py's docstring.
CONFORMS = {
    ZeroEngine: (StepEngine, SkipsGradientSync, NameKeyedOptimizerState, MemoryReporting),
    GeminiEngine: (StepEngine, NameKeyedOptimizerState, MemoryReporting),
    HybridEngine: (StepEngine, SkipsGradientSync, NameKeyedOptimizerState),
}
PROTOCOLS = (StepEngine, SkipsGradientSync, NameKeyedOptimizerState, MemoryReporting)


def _methods(protocol: type) -> dict[str, list[str]]:
    """Method name -> parameter names (without self) of a protocol or class."""
    members = {name: member for name, member in vars(protocol).items() if callable(member) and not name.startswith("_")}
    return {name: list(inspect.signature(member).parameters)[1:] for name, member in members.items()}


@pytest.mark.parametrize(
    ("engine", "protocol"),
    [(engine, protocol) for engine, protocols in CONFORMS.items() for protocol in protocols],
    ids=lambda value: value.__name__,
)
def test_engine_offers_the_protocol(engine, protocol):
    for name, parameters in _methods(protocol).items():
        method = getattr(engine, name, None)
        assert callable(method), f"{engine.__name__} lacks {protocol.__name__}.{name}"
        assert list(inspect.signature(method).parameters)[1:] == parameters, (engine.__name__, name)


def test_the_table_is_complete():
    # An engine that gained a protocol's methods belongs in the table (and the docstring's).
    for engine, protocols in CONFORMS.items():
        for protocol in PROTOCOLS:
            offers = all(callable(getattr(engine, name, None)) for name in _methods(protocol))
            assert offers == (protocol in protocols), (engine.__name__, protocol.__name__)
