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

# The pipeline, lowest layer first. A module may import from its own layer and the ones below,
# never from a layer above (and never in a cycle, even within a layer).
LAYERS = [
    ["registry", "perf", "data.tasks", "recipes", "errors", "checks", "health",
     "usercode", "provenance", "trackers",
     "sandbox", "sandbox.seccomp", "sandbox.procs", "sandbox.launch", "sandbox.run"],  # plain Python
    ["losses", "losses.common", "losses.policy", "losses.correction", "losses.aggregation",
     "losses.kl", "losses.value", "losses.distill", "losses.preference",
     "advantages", "data", "data.files", "data.preferences", "data.gym", "rollout.base",
     "envs.base"],                                                           # math, data
    ["presets", "sections", "config", "options"],                            # typed configs
    ["data.source", "prompts", "models", "distributed", "memory", "logging", "checkpoint",
     "rewards.host", "rewards.pool", "rewards.verifiers", "run", "lifecycle", "view", "view.server",
     "envs.tools", "envs.builtin", "envs"],                                 # machinery
    ["rollout", "rollout.hf", "rollout.vllm", "rollout.vllm_worker", "rollout.vllm_weights",
     "rollout.vllm_engines", "rollout.episodes", "forward",
     "batch", "step_metrics", "token_records"],                              # sampling, forward
    ["rewards", "rewards.scorer", "rewards.model", "teachers", "critic", "sampling", "evaluation", "collect",
     "batch_source"],  # scores, teachers
    ["update_terms", "update"],                                              # the policy update
    ["stages", "stages.common", "train_run"],                                # one run's lifecycle
    ["trainer", "stages.sft", "stages.preference", "stages.generate", "stages.evaluate",   # the loops
     "experiments", "experiments.common"],                                   # (and their measures)
    ["stages.reward_model", "experiments.baselines", "experiments.kl_estimators",
     "experiments.importance_sampling", "experiments.length_bias",
     "experiments.length_training", "experiments.clip_higher", "experiments.dynamic_sampling",
     "experiments.opd_vs_grpo", "experiments.reward_hacking"],               # (read the layer above)
    ["cli", ""],                                                             # entry points
]


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


def test_every_module_has_a_layer():
    placed = {m for layer in LAYERS for m in layer}
    assert set(_modules()) == placed, "add new modules to LAYERS (tests/test_layout.py)"


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    layer_of = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    return [f"{m} (layer {layer_of[m]}) imports {t} (layer {layer_of[t]})"
            for m, targets in sorted(edges.items()) for t in sorted(targets)
            if layer_of[t] > layer_of[m]]


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
    assert upward_imports(edges) == ["rewards.model (layer 5) imports stages (layer 7)",
                                     "rewards.model (layer 5) imports stages.sft (layer 8)"]
    assert any({"rewards.model", "stages.sft"} <= set(c) for c in cycles(edges))


def function_lengths() -> dict[str, int]:
    """Every function's length in lines, by 'module path::name'."""
    return {f"{f.relative_to(PACKAGE)}::{node.name}": node.end_lineno - node.lineno + 1
            for f in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_no_function_grows_past_60_lines():
    lengths = function_lengths()
    assert max(lengths.values()) > 40   # the walk sees the package's functions
    long = {k: v for k, v in lengths.items() if v > 60}
    assert not long, f"functions over 60 lines (split them where they hold two ideas): {long}"


def test_a_real_package_with_one_version_and_a_public_api():
    assert (PACKAGE / "__init__.py").is_file()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project.get("dynamic", [])      # read from posttrain.__version__
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "--version"], capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == f"posttrain {posttrain.__version__}"
    from posttrain.options import load_config
    from posttrain.trainer import train
    assert posttrain.train is train and posttrain.load_config is load_config
    assert "group" in posttrain.ADVANTAGES and "k3" in posttrain.KL_ESTIMATORS
    for name in posttrain.__all__:
        assert getattr(posttrain, name) is not None
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
    assert upward_imports(edges) == ["envs (layer 3) imports rewards (layer 5)"]
