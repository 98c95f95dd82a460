"""docs/architecture.md is what the tree gives (scripts/architecture.py), and the generator reads
what it claims to: every layer's folder, every module's first docstring sentence."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts" / "architecture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_page_is_generated_from_the_tree():
    gen = _generator()
    assert (ROOT / "docs" / "architecture.md").read_text() == gen.page(), \
        "docs/architecture.md is stale: run python scripts/architecture.py"


def test_the_page_lists_every_layer_in_order_and_every_module():
    gen = _generator()
    found = gen.layers()
    assert [layer for layer, _, _ in found] == sorted(layer for layer, _, _ in found)
    assert {"sampling", "rl", "run"} <= {folder for _, folder, _ in found}
    page = gen.page()
    for module in sorted((ROOT / "posttrain" / "sampling").glob("[!_]*.py")):
        assert f"- `{module.name}`: " in page
    assert gen.first_sentence("The one evaluator. More text.") == "The one evaluator."
    assert gen.first_sentence("docs/algorithms.md §1 names it") == "docs/algorithms.md §1 names it"
