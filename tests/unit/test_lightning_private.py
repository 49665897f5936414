"""Private Lightning names: each one the package uses exists in the installed Lightning, and only
``strategies/_lightning_private.py`` imports them.

A Lightning upgrade that renames or moves one fails here naming the symbol, not somewhere inside a training run; a new
private import elsewhere fails the scan, so the list in ``_lightning_private.py`` (with its reasons) stays complete.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_colossal"
THE_MODULE = PACKAGE / "strategies" / "_lightning_private.py"
LIGHTNING_DISTRIBUTIONS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities")

# (module, name) of every private Lightning name the package uses, as `_lightning_private.py` imports them.
PRIVATE_NAMES = [
    ("lightning.fabric.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_SubprocessScriptLauncher"),
    ("lightning.fabric.strategies.strategy", "_BackwardSyncControl"),
    ("lightning.fabric.strategies.launchers.subprocess_script", "_ChildProcessObserver"),
    ("lightning.fabric.utilities.cloud_io", "_load"),
    ("lightning.fabric.utilities.distributed", "_get_default_process_group_backend_for_device"),
    ("lightning.fabric.utilities.distributed", "_init_dist_connection"),
    ("lightning.fabric.utilities.optimizer", "_optimizers_to_device"),
    ("lightning.fabric.utilities.seed", "_collect_rng_states"),
    ("lightning.fabric.utilities.seed", "_set_rng_states"),
    ("lightning.pytorch.overrides.distributed", "_sync_module_states"),
    ("lightning.pytorch.strategies.launchers", "_SubprocessScriptLauncher"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_MultiProcessingLauncher"),
    ("lightning.pytorch.strategies.launchers.multiprocessing", "_WorkerOutput"),
    ("lightning.pytorch.strategies.strategy", "_ForwardRedirection"),
]


@pytest.mark.parametrize(("module", "name"), PRIVATE_NAMES, ids=[name for _, name in PRIVATE_NAMES])
def test_the_installed_lightning_has_the_name(module, name):
    assert hasattr(importlib.import_module(module), name), (
        f"The installed Lightning has no {module}.{name}: find its new place or replacement and update"
        " lightning_colossal/strategies/_lightning_private.py."
    )


def _private_lightning_imports(tree: ast.Module) -> list[str]:
    """``module.name`` of every private Lightning name (or name from a private Lightning module) ``tree`` imports."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules, names = [node.module], [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            modules, names = [alias.name for alias in node.names], [""]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            if parts[0] not in LIGHTNING_DISTRIBUTIONS:
                continue
            private_module = any(part.startswith("_") for part in parts)
            found.extend(f"{module}.{name}".rstrip(".") for name in names if private_module or name.startswith("_"))
    return found


def test_the_list_matches_what_the_module_imports():
    tree = ast.parse(THE_MODULE.read_text())
    assert sorted(_private_lightning_imports(tree)) == sorted(f"{module}.{name}" for module, name in PRIVATE_NAMES)


def test_no_other_module_imports_a_private_lightning_name():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == THE_MODULE:
            continue
        found = _private_lightning_imports(ast.parse(path.read_text(), filename=str(path)))
        if found:
            offenders[str(path.relative_to(PACKAGE))] = found
    assert offenders == {}, (
        "Import private Lightning names from lightning_colossal.strategies._lightning_private (add them there, with"
        f" the reason and the versions checked): {offenders}"
    )


def test_the_scan_sees_private_imports():
    source = (
        "from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher\n"
        "from lightning.fabric.utilities._private_module import public\n"
        "import lightning.pytorch._internal\n"
        "from lightning.pytorch import Trainer\n"
        "from lightning_colossal.strategies._lightning_private import _sync_module_states\n"
    )
    assert _private_lightning_imports(ast.parse(source)) == [
        "lightning.pytorch.strategies.launchers._SubprocessScriptLauncher",
        "lightning.fabric.utilities._private_module.public",
        "lightning.pytorch._internal",
    ]
