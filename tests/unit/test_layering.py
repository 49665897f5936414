"""The layering rules of docs/architecture.md, checked by scanning imports and calls with `ast`, and by importing.

- engines (zero/, gemini/, parallel/, fsdp/) never import lightning, the demo or the Lightning layers, and never each
  other (parallel/ may use zero's public package API);
- only strategies/, fabric/, precision.py, callbacks/ and demo/ (plus the package root that registers names) may
  import lightning;
- the Lightning-free modules (the engines, distributed/, engine_parts/, checkpoint/, config.py, consolidate.py, ...)
  reach neither lightning nor demo/ through any chain of the project's own imports (an `ast` walk of the import
  graph), and importing them in a fresh interpreter loads neither (with the package root left out: it registers the
  strategy names, so it must import Lightning);
- nothing outside demo/ imports the demo, and importing the package (which registers the strategies) does not load
  it;
- only distributed/ calls torch.distributed collectives;
- the layers the engines build on import no engine: engine_parts/ (shared engine machinery) imports only itself and
  distributed/, and distributed/ (communication) only itself.
"""

import ast
import json
import textwrap
from pathlib import Path

from tests.fresh_interpreter import run_python

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_colossal"
ENGINES = ("zero", "gemini", "parallel", "fsdp")
# What the engines build on, and which of the project's packages each may import (itself included).
SHARED_LAYERS = {
    "distributed": ("distributed",),
    "engine_parts": ("engine_parts", "distributed"),
    "disk": ("disk", "engine_parts", "distributed"),
}
MAY_IMPORT_LIGHTNING = ("strategies", "fabric", "precision.py", "callbacks", "demo", "__init__.py")
# Lightning adapters and the demo: engines import none of them (they import lightning, and the demo is a workload).
FORBIDDEN_FOR_ENGINES = ("demo", "strategies", "fabric", "precision", "callbacks")
# The Lightning adapters, the demo and the package root; every other top-level module or package must work without
# Lightning (section 1 of docs/architecture.md), checkpoint/ included, so a new one is covered the day it is added.
LIGHTNING_LAYERS = ("strategies", "fabric", "precision", "callbacks", "demo", "__init__")
LIGHTNING_FREE = tuple(
    sorted(
        path.stem
        for path in PACKAGE.iterdir()
        if (path.suffix == ".py" or (path / "__init__.py").is_file()) and path.stem not in LIGHTNING_LAYERS
    )
)
LIGHTNING_DISTRIBUTIONS = ("lightning", "pytorch_lightning", "lightning_fabric")
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


def _module_name(relative):
    parts = [PACKAGE.name, *relative.with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
        "only strategies/, fabric/, precision.py, callbacks/, demo/ may import lightning:\n" + "\n".join(offenders)
    )


def _import_graph(trees):
    """``{module: (project modules its imports execute, outside top-level names it imports)}`` for the modules
    ``trees`` (``{dotted name: ast}``), imports inside functions included.

    Importing ``a.b.c`` executes the packages ``a`` and ``a.b`` first, and ``from a.b import c`` executes ``a.b.c``
    when that is a module: both count. The package root is left out: every import of a submodule executes it, and it
    imports Lightning to register the strategy names (the run-time tests below check the engines without it).
    """
    root = PACKAGE.name
    graph = {}
    for name, tree in trees.items():
        # The package relative imports start from (a package is a module with submodules here).
        package = name if any(other.startswith(name + ".") for other in trees) else name.rpartition(".")[0]
        targets, outside = set(), set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                dotted = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                dotted = [base, *(f"{base}.{alias.name}" for alias in node.names)]
            else:
                continue
            for imported in dotted:
                parts = imported.split(".")
                if parts[0] != root:
                    outside.add(parts[0])
                    continue
                targets.update(
                    ".".join(parts[:end]) for end in range(2, len(parts) + 1) if ".".join(parts[:end]) in trees
                )
        targets.discard(name)
        graph[name] = (targets, outside)
    return graph


def _chain_to_forbidden(graph, start):
    """The shortest import chain from ``start`` to a forbidden module (demo/, a Lightning layer, or a module that
    imports lightning), as ``"a -> b -> c"``; ``None`` if ``start`` reaches none."""
    parents, queue = {start: None}, [start]
    for current in queue:
        targets, outside = graph[current]
        forbidden_layer = "." in current and current.split(".")[1] in FORBIDDEN_FOR_ENGINES
        if forbidden_layer or outside & set(LIGHTNING_DISTRIBUTIONS):
            chain, step = [], current
            while step is not None:
                chain.append(step)
                step = parents[step]
            return " -> ".join(reversed(chain)) + ("" if forbidden_layer else " -> lightning")
        for target in sorted(targets):
            if target not in parents:
                parents[target] = current
                queue.append(target)
    return None


def _project_trees():
    return {_module_name(relative): tree for relative, tree in _modules()}


def test_lightning_free_modules_reach_neither_lightning_nor_the_demo_transitively():
    trees = _project_trees()
    graph = _import_graph(trees)
    offenders = []
    for name in sorted(trees):
        parts = name.split(".")
        chain = _chain_to_forbidden(graph, name) if len(parts) > 1 and parts[1] in LIGHTNING_FREE else None
        if chain is not None:
            offenders.append(chain)
    assert not offenders, (
        "engines, distributed/, engine_parts/, checkpoint/, config.py and consolidate.py must not import lightning or"
        " the demo, even through other modules of the package (let a model declare what engines need, as the demo GPT declares"
        " `_no_split_modules` and `parallel_policy()`):\n" + "\n".join(offenders)
    )


# Run in a fresh interpreter: a stand-in for the package root (whose __init__ imports Lightning to register the
# strategy names) lets the Lightning-free packages be imported on their own; an import hook records which module was
# executing when a forbidden one was first requested.
_IMPORT_WITHOUT_THE_ROOT = """
import importlib, json, sys, types

package, modules, forbidden = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
loaded = {}  # forbidden prefix -> the chain of project modules executing when it was first requested


class Recorder:
    def find_spec(self, name, path=None, target=None):
        prefix = next((p for p in forbidden if name == p or name.startswith(p + ".")), None)
        if prefix is not None and prefix not in loaded:
            frame, chain = sys._getframe(1), []
            while frame is not None:
                module = frame.f_globals.get("__name__", "")
                if module.startswith("lightning_colossal") and (not chain or chain[-1] != module):
                    chain.append(module)
                frame = frame.f_back
            loaded[prefix] = " -> ".join([*reversed(chain), name])
        return None


root = types.ModuleType("lightning_colossal")
root.__path__ = [package]
sys.modules["lightning_colossal"] = root
sys.meta_path.insert(0, Recorder())
for module in modules:
    importlib.import_module(module)
still = sorted(name for name in sys.modules if any(name == p or name.startswith(p + ".") for p in forbidden))
print(json.dumps({"loaded": sorted(loaded.values()), "in_sys_modules": still}))
"""


def _import_in_fresh_interpreter(tmp_path, source, *arguments):
    result = run_python(["-c", textwrap.dedent(source), *arguments], tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_importing_the_lightning_free_packages_loads_neither_lightning_nor_the_demo(tmp_path):
    modules = sorted(f"lightning_colossal.{name}" for name in LIGHTNING_FREE)
    forbidden = [*LIGHTNING_DISTRIBUTIONS, *(f"lightning_colossal.{layer}" for layer in FORBIDDEN_FOR_ENGINES)]
    report = _import_in_fresh_interpreter(
        tmp_path, _IMPORT_WITHOUT_THE_ROOT, str(PACKAGE), ",".join(modules), ",".join(forbidden)
    )
    assert report["loaded"] == [] and report["in_sys_modules"] == [], (
        "importing the Lightning-free packages loaded lightning or the demo; first requested through:\n"
        + "\n".join(report["loaded"] or report["in_sys_modules"])
    )


def test_importing_the_package_does_not_load_the_demo(tmp_path):
    # The package root imports Lightning (strategy registration), but the library never needs the demo workload.
    report = _import_in_fresh_interpreter(
        tmp_path,
        """
        import json, sys
        import lightning_colossal
        import lightning_colossal.parallel
        print(json.dumps(sorted(name for name in sys.modules if name.startswith("lightning_colossal.demo"))))
        """,
    )
    assert report == [], f"import lightning_colossal loaded the demo: {report}"


def test_only_the_demo_imports_the_demo():
    # The demo is a workload built on the library, never a part of it: library code (lazy imports inside functions
    # included) finds what it needs from the demo GPT through the model's declarations.
    offenders = []
    for relative, tree in _modules():
        if relative.parts[0] == "demo":
            continue
        offenders.extend(
            f"{relative}: imports {name}"
            for name in _imported_names(tree)
            if name == "lightning_colossal.demo" or name.startswith("lightning_colossal.demo.")
        )
    assert not offenders, "only demo/ may import lightning_colossal.demo:\n" + "\n".join(offenders)


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
            if parts[0] == "lightning_colossal" and len(parts) > 1 and parts[1] in FORBIDDEN_FOR_ENGINES:
                offenders.append(f"{relative}: imports {name} (the demo or a Lightning layer)")
    assert not offenders, "engines must not import each other's internals, the demo or the Lightning layers:\n" + (
        "\n".join(offenders)
    )


def test_the_shared_layers_import_no_engine():
    # Engines share code through engine_parts/, disk/ and distributed/, never through each other: those import no
    # engine, and communication (distributed/) does not import the engine machinery built on it.
    offenders = []
    for relative, tree in _modules():
        layer = relative.parts[0]
        if layer not in SHARED_LAYERS:
            continue
        for name in _imported_names(tree):
            parts = name.split(".")
            if parts[0] == "lightning_colossal" and (len(parts) == 1 or parts[1] not in SHARED_LAYERS[layer]):
                offenders.append(f"{relative}: imports {name}")
    assert not offenders, (
        "engine_parts/ may import only itself and distributed/, disk/ also engine_parts/, distributed/ only itself:\n"
        + "\n".join(offenders)
    )


def test_only_distributed_calls_collectives():
    offenders = []
    for relative, tree in _modules():
        if relative.parts[0] == "distributed":
            continue
        offenders.extend(f"{relative}: {call}" for call in _collective_calls(tree))
    assert not offenders, "call collectives through lightning_colossal.distributed.collectives:\n" + "\n".join(
        offenders
    )


DEVICE_MODULE = Path("distributed") / "device.py"


def _device_runtime_uses(tree):
    """``torch.cuda`` attributes, ``torch.get_device_module``, and ``pin_memory=`` / ``non_blocking=`` keywords
    (device.py [Note: copies between host and device])."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "torch":
            if node.attr in ("cuda", "get_device_module"):
                yield f"line {node.lineno}: torch.{node.attr}"
        if isinstance(node, ast.Call):
            for keyword in node.keywords:
                if keyword.arg in ("pin_memory", "non_blocking"):
                    yield f"line {node.lineno}: {keyword.arg}="


def test_only_the_device_module_calls_the_device_runtime():
    # FSDP2's CPUOffloadPolicy takes pin_memory= as its own setting, not a copy; it is the one exception.
    exceptions = {(Path("fsdp") / "wrap.py", "pin_memory=")}
    offenders = []
    for relative, tree in _modules():
        if relative == DEVICE_MODULE:
            continue
        offenders.extend(
            f"{relative}: {use}"
            for use in _device_runtime_uses(tree)
            if (relative, use.split(": ", 1)[1]) not in exceptions
        )
    assert not offenders, "call the device runtime through lightning_colossal.distributed.device:\n" + "\n".join(
        offenders
    )


def test_the_scan_sees_violations():
    # Guard against a scan that can never fail: feed it code that breaks each rule.
    bad = ast.parse("import torch.distributed as dist\nimport lightning.pytorch\ndist.all_reduce(x)\n")
    assert list(_collective_calls(bad))
    device_calls = ast.parse(
        "torch.cuda.synchronize()\nx.to('cpu', non_blocking=True)\ntorch.empty(3, pin_memory=True)\n"
    )
    assert len(list(_device_runtime_uses(device_calls))) == 3
    assert any(name.startswith("lightning") for name in _imported_names(bad))
    assert list(_modules()), "found no modules: the package path is wrong"
    # The transitive walk: an engine reaching the demo through a package __init__, then lightning.
    fake = {
        "lightning_colossal.parallel": "from lightning_colossal.parallel.policies import find_policy",
        "lightning_colossal.parallel.policies": "from lightning_colossal.parallel.gpt import GPTPolicy",
        "lightning_colossal.parallel.gpt": "def f():\n    from lightning_colossal.distributed.x import y",
        "lightning_colossal.distributed": "",
        "lightning_colossal.distributed.x": "from lightning_colossal.demo.model import GPT",
        "lightning_colossal.demo": "from lightning_colossal.demo.module import Module",
        "lightning_colossal.demo.model": "import torch",
        "lightning_colossal.demo.module": "import lightning.pytorch as pl",
        "lightning_colossal.zero": "from . import engine",
        "lightning_colossal.zero.engine": "from ..demo import model",
    }
    graph = _import_graph({name: ast.parse(source) for name, source in fake.items()})
    assert _chain_to_forbidden(graph, "lightning_colossal.parallel") == (
        "lightning_colossal.parallel -> lightning_colossal.parallel.policies -> lightning_colossal.parallel.gpt"
        " -> lightning_colossal.distributed.x -> lightning_colossal.demo"
    )
    assert _chain_to_forbidden(graph, "lightning_colossal.zero") == (
        "lightning_colossal.zero -> lightning_colossal.zero.engine -> lightning_colossal.demo"
    )
    assert _chain_to_forbidden(graph, "lightning_colossal.distributed") is None
    fake["lightning_colossal.distributed"] = "from lightning_colossal.checkpoint import save"
    fake["lightning_colossal.checkpoint"] = "import lightning_fabric"
    graph = _import_graph({name: ast.parse(source) for name, source in fake.items()})
    assert _chain_to_forbidden(graph, "lightning_colossal.distributed") == (
        "lightning_colossal.distributed -> lightning_colossal.checkpoint -> lightning"
    )


def test_the_engines_find_the_demo_gpt_by_its_declarations():
    # What replaced the engines' imports of the demo: the model names its block class and returns its policy.
    from torch import nn

    from lightning_colossal.demo.model import GPT, GPTConfig
    from lightning_colossal.demo.parallel_policy import GPTPolicy
    from lightning_colossal.fsdp import detect_block_classes
    from lightning_colossal.parallel import find_policy

    model = GPT(GPTConfig(vocab_size=32, block_size=8, num_layers=2, num_heads=2, embed_dim=16))
    root = nn.ModuleDict({"model": model})
    assert detect_block_classes(root) == {"Block"}
    found, policy = find_policy(root, None)
    assert found is model and isinstance(policy, GPTPolicy)
    # A policy passed by the user wins over the declared one.
    user_policy = GPTPolicy()
    assert find_policy(root, user_policy) == (model, user_policy)


def _forward_assignments(tree):
    """Lines that assign an attribute named ``forward``: ``x.forward = ...`` (any target that stores it: annotated,
    augmented, inside a tuple, a loop variable) and ``setattr(x, "forward", ...)``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "forward" and isinstance(node.ctx, ast.Store):
            yield node.lineno
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value == "forward"
        ):
            yield node.lineno


def test_no_module_forward_is_assigned():
    # parallel/attached.py [Note: techniques attach as hooks]: an assigned forward is invisible in print(model),
    # cannot be undone, and replaces a library's forward with our copy of it.
    found = [f"{relative}:{line}" for relative, tree in _modules() for line in _forward_assignments(tree)]
    assert not found, (
        f"{found} assign a module's forward. Attach the technique as forward hooks instead (AttachedTechniques in"
        " lightning_colossal/parallel/attached.py: before_forward, after_forward, recompute_in_backward)."
    )


def test_the_forward_scan_sees_assignments():
    planted = ast.parse(
        textwrap.dedent(
            """
            layer.forward = functools.partial(recomputed, layer.forward)
            setattr(block, "forward", attention)
            model.forward: Callable = wrapped
            first.forward, second = one, two
            forward = layer.forward  # reading it is fine
            table[layer.forward] = "also fine"
            """
        )
    )
    assert sorted(_forward_assignments(planted)) == [2, 3, 4, 5]
