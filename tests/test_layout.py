"""The shape of the package: a real package with a version and a public API, modules that import
downward only (no cycles, checked on every import statement, function-level ones included), and
functions short enough to read."""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import posttrain

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "posttrain"

# The pipeline, lowest layer first, one folder (subpackage) per layer: a module may import from its
# own folder and the folders of the layers below, never from a layer above (and never in a
# cycle, even within a folder). Each subpackage's __init__ says its layer first.
LAYERS = [
    ["util", "sandbox", "recipes"],   # plain Python
    ["losses", "logs"],               # formulas on tensors; what a run writes (metrics, trackers)
    ["config"],                       # typed configs
    ["data", "model"],                # tasks and rows; the model on its devices
    ["envs", "run", "view"],          # environments; one run's lifecycle; the viewer
    ["rollout"],                      # sampling, the forward over a rollout
    ["rewards"],                      # scores
    ["sampling"],                     # the Sampling service: sample, score, evaluate
    ["rl"],                           # the learner, the RL step pipeline and loop
    ["stages", "tinker"],             # the other commands; the Tinker API server
    ["experiments"],                  # the lecture's claims, measured
    ["cli", ""],                      # entry points
]
FOLDER_LAYER = {folder: i for i, layer in enumerate(LAYERS) for folder in layer}


def layer_of(module: str) -> int:
    """The layer of a module: its folder's (top-level modules are entry points)."""
    return FOLDER_LAYER[module.split(".")[0]]


def _modules() -> dict[str, Path]:
    mods = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the posttrain modules it imports anywhere in its file ('' is the package)."""
    mods = _modules()
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            edges[m] |= targets_of(m, names, mods)
    return edges


def targets_of(m: str, names: list[str], mods: dict[str, Path]) -> set[str]:
    """The posttrain modules that importing `names` from module `m` runs: each named module and
    the package inits above it (not `m` itself, nor `m`'s own package inits: they have run)."""
    out = set()
    for n in names:
        if n == "posttrain" or n.startswith("posttrain."):
            target = n[len("posttrain."):] if n != "posttrain" else ""
            if target in mods:
                out |= {t for t in (*package_inits(target, mods), target)
                        if t != m and not m.startswith(t + ".")}
    return out


def package_inits(target: str, mods: dict[str, Path]) -> list[str]:
    """The package inits importing `target` runs first: `rewards.pool` runs `rewards/__init__`.
    (posttrain's own `__init__` imports nothing at import time: its API is lazy.)"""
    parts = target.split(".")
    return [p for i in range(1, len(parts)) if (p := ".".join(parts[:i])) in mods
            and mods[p].name == "__init__.py"]


def test_every_module_sits_in_a_folder_with_a_layer():
    """Only the entry points at the top; every subpackage in LAYERS, its __init__ saying its layer."""
    mods = _modules()
    assert {m for m in mods if "." not in m and (not m or not (PACKAGE / m).is_dir())} == {"cli", ""}
    folders = {m.split(".")[0] for m in mods if m}
    assert folders == set(FOLDER_LAYER) - {""}, "add new subpackages to LAYERS (tests/test_layout.py)"
    for folder in folders - {"cli"}:
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text())) or ""
        assert doc.startswith(f"Layer {FOLDER_LAYER[folder]}"), (folder, doc[:40])


def test_no_module_grows_past_400_lines():
    long = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > 400}
    assert not long, f"modules over 400 lines (split them by idea): {long}"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    return [f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
            for m, targets in sorted(edges.items()) for t in sorted(targets)
            if layer_of(t) > layer_of(m)]


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every back edge of a depth-first search: each closes a cycle of imports."""
    state: dict[str, int] = {}
    found = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            if state.get(t) == 1:
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [m])
    return found


def test_modules_import_downward_only_and_never_in_a_cycle():
    edges = import_graph()
    assert not upward_imports(edges)
    assert not cycles(edges)


def test_the_checks_catch_a_planted_cycle():
    """Not vacuous: a function-level `from posttrain.stages.sft import ...` in rewards/model.py is
    an upward import, and closes the cycle rewards -> rewards.model -> stages.sft -> rewards."""
    edges = import_graph()
    edges["rewards.model"] |= targets_of("rewards.model", ["posttrain.stages.sft"], _modules())
    assert upward_imports(edges) == ["rewards.model (layer 6) imports stages (layer 9)",
                                     "rewards.model (layer 6) imports stages.sft (layer 9)"]
    assert any({"rewards.model", "stages.sft"} <= set(c) for c in cycles(edges))


def function_lengths() -> dict[str, int]:
    """Every function's length in lines, by 'module path::name'."""
    return {f"{f.relative_to(PACKAGE)}::{node.name}": node.end_lineno - node.lineno + 1
            for f in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_no_function_grows_past_50_lines():
    lengths = function_lengths()
    assert max(lengths.values()) > 40   # the walk sees the package's functions
    long = {k: v for k, v in lengths.items() if v > 50}
    assert not long, f"functions over 50 lines (split them where they hold two ideas): {long}"


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """What a caller must think about: positional parameters (defaults or not; `self` and `cls`
    aside) and keyword-only ones without a default. Keyword-only options with defaults are free."""
    a = node.args
    positional = [x for x in a.posonlyargs + a.args if x.arg not in ("self", "cls")]
    required_kw = [k for k, d in zip(a.kwonlyargs, a.kw_defaults) if d is None]
    return len(positional) + len(required_kw)


def parameter_counts() -> dict[str, int]:
    """Every function's parameter count (parameter_count), by 'module path::name'."""
    return {f"{f.relative_to(PACKAGE)}::{node.name}": parameter_count(node)
            for f in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_parameter_count_reads_positional_and_required_keyword_parameters():
    node = ast.parse("def f(self, a, b=1, /, c=2, *args, d, e=3, **kw): pass").body[0]
    assert parameter_count(node) == 4   # a, b, c, d: self, e (an option), *args, **kw aside


MAX_PARAMETERS = 6
# Methods whose signature another library fixes (it calls them positionally): not ours to shape.
FOREIGN_SIGNATURES = {"envs/verifiers_harness.py::launch"}   # verifiers' Harness.launch, 7 args


def test_no_function_takes_more_than_six_parameters():
    """Functions take the objects they work on, not their parts (options: keyword-only, with a
    default)."""
    counts = parameter_counts()
    assert max(counts.values()) >= 5   # the walk sees the package's functions
    over = {k: v for k, v in counts.items() if v > MAX_PARAMETERS and k not in FOREIGN_SIGNATURES}
    assert all(counts[k] > MAX_PARAMETERS for k in FOREIGN_SIGNATURES)   # (an exemption still needed)
    assert not over, f"functions over {MAX_PARAMETERS} parameters (pass the object): {over}"


def test_a_planted_upward_import_between_folders_is_caught():
    """The lowest folder importing the RL loop is refused, named with both layers."""
    edges = import_graph()
    edges["util.registry"] = edges["util.registry"] | {"rl.loop"}
    assert upward_imports(edges) == ["util.registry (layer 0) imports rl.loop (layer 8)"]


def test_a_real_package_with_one_version_and_a_public_api():
    assert (PACKAGE / "__init__.py").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project.get("dynamic", [])      # read from posttrain.__version__
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"posttrain {posttrain.__version__}"
    from posttrain.config.options import load_config
    from posttrain.rl.loop import train
    assert posttrain.train is train and posttrain.load_config is load_config
    assert "group" in posttrain.ADVANTAGES and "k3" in posttrain.KL_ESTIMATORS
    import importlib
    for name in posttrain.__all__[1:]:   # each public name is its defining module's own object
        module = importlib.import_module(posttrain._PUBLIC[name])
        obj = getattr(posttrain, name)
        assert obj is getattr(module, name)
        if isinstance(obj, type) or callable(obj) and hasattr(obj, "__code__"):
            assert obj.__module__ == module.__name__, name   # (not a re-export: where it is written)
    with pytest.raises(AttributeError, match="no attribute 'trian'"):
        posttrain.trian


def test_an_import_runs_the_package_inits_above_it():
    """Importing `posttrain.rewards.pool` runs `rewards/__init__` (and its imports) first: from a
    low module that is an upward import even though `rewards.pool` itself is low."""
    mods = _modules()
    assert targets_of("envs", ["posttrain.rewards.pool"], mods) == {"rewards", "rewards.pool"}
    assert targets_of("rewards.model", ["posttrain.rewards.pool"], mods) == {"rewards.pool"}
    edges = import_graph()
    edges["envs"] |= targets_of("envs", ["posttrain.rewards.pool"], mods)
    assert upward_imports(edges) == ["envs (layer 4) imports rewards (layer 6)",
                                     "envs (layer 4) imports rewards.pool (layer 6)"]
