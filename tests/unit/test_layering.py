"""The layering rules of docs/architecture.md, checked by scanning imports and calls with `ast`.

- engines (zero/, gemini/, parallel/, fsdp/) never import lightning and never each other (parallel/ may use
  zero's public package API);
- only strategies/, precision.py, callbacks/, checkpoint/ and demo/ (plus the package root that registers names)
  may import lightning;
- only distributed/ calls torch.distributed collectives.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_colossal"
ENGINES = ("zero", "gemini", "parallel", "fsdp")
MAY_IMPORT_LIGHTNING = ("strategies", "precision.py", "callbacks", "checkpoint", "demo", "__init__.py")
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
    "reduce",
    "gather",
    "scatter",
    "batch_isend_irecv",
    "monitored_barrier",
}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        yield relative, ast.parse(path.read_text(), filename=str(path))


def _imported_names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


def _distributed_aliases(tree):
    """Names bound to torch.distributed in this module (`import torch.distributed as dist` and friends)."""
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed":
                    aliases.add(alias.asname or "torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            aliases.update(alias.asname or alias.name for alias in node.names if alias.name == "distributed")
    return aliases


def _collective_calls(tree):
    aliases = _distributed_aliases(tree) | {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            owner = ast.unparse(node.func.value)
            if owner in aliases:
                yield f"{owner}.{node.func.attr} (line {node.lineno})"
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for alias in node.names:
                if alias.name in COLLECTIVES:
                    yield f"from torch.distributed import {alias.name} (line {node.lineno})"


def test_only_allowed_layers_import_lightning():
    offenders = []
    for relative, tree in _modules():
        top = relative.parts[0]
        if top in MAY_IMPORT_LIGHTNING:
            continue
        for name in _imported_names(tree):
            if name.split(".")[0] in ("lightning", "pytorch_lightning"):
                offenders.append(f"{relative}: imports {name}")
    assert not offenders, (
        "only strategies/, precision.py, callbacks/, checkpoint/, demo/ may import lightning:\n" + "\n".join(offenders)
    )


def test_engines_do_not_import_each_other():
    offenders = []
    for relative, tree in _modules():
        engine = relative.parts[0]
        if engine not in ENGINES:
            continue
        for name in _imported_names(tree):
            parts = name.split(".")
            # docs/architecture.md: colossal_hybrid is parallel/ + zero/, so parallel/ may use zero's public package API
            # (never its modules).
            composes_zero = engine == "parallel" and name == "lightning_colossal.zero"
            if (
                parts[0] == "lightning_colossal"
                and len(parts) > 1
                and parts[1] in ENGINES
                and parts[1] != engine
                and not composes_zero
            ):
                offenders.append(f"{relative}: imports {name}")
    assert not offenders, "engines must not import each other's internals:\n" + "\n".join(offenders)


def test_only_distributed_calls_collectives():
    offenders = []
    for relative, tree in _modules():
        if relative.parts[0] == "distributed":
            continue
        offenders.extend(f"{relative}: {call}" for call in _collective_calls(tree))
    assert not offenders, "call collectives through lightning_colossal.distributed.collectives:\n" + "\n".join(
        offenders
    )


def test_the_scan_sees_violations():
    # Guard against a scan that can never fail: feed it code that breaks each rule.
    bad = ast.parse("import torch.distributed as dist\nimport lightning.pytorch\ndist.all_reduce(x)\n")
    assert list(_collective_calls(bad))
    assert any(name.startswith("lightning") for name in _imported_names(bad))
    assert list(_modules()), "found no modules: the package path is wrong"
