"""The planted bugs of ``tests/mutation/plant_bugs.py`` still apply to the code: each replacement's text occurs
exactly once in its file. Code that moved on silently turns a planted bug into "nothing planted" (three had drifted
when this check was added)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[2]


def _plant_bugs_module():
    spec = importlib.util.spec_from_file_location("plant_bugs", REPOSITORY / "tests/mutation/plant_bugs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("plant_bugs", module)  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


BUGS = _plant_bugs_module().BUGS


@pytest.mark.parametrize("bug", BUGS, ids=[bug.name for bug in BUGS])
def test_every_planted_bug_still_finds_its_text_once(bug):
    for file, old, _ in bug.replacements:
        count = (REPOSITORY / file).read_text().count(old)
        assert count == 1, f"{bug.name}: {old!r} occurs {count} times in {file}; update the bug to the current code"
