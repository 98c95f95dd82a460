"""A record's provenance, read from the git tree the posttrain code lives in, never from the
directory the command runs in: the commit `git rev-parse HEAD` names there, whether posttrain/,
benchmarks/ or pyproject.toml differ from it, $POSTTRAIN_COMMIT where the code runs without its
.git folder, and the machine. Each test copies the module into a scratch git repository and reads
the record in a fresh interpreter started elsewhere (in this checkout, another git tree)."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# the files a record's provenance imports, at their places in the tree
CODE = ("posttrain/__init__.py", "posttrain/run/__init__.py", "posttrain/run/provenance.py")
GIT = ["git", "-c", "user.name=test", "-c", "user.email=test@example.com", "-c",
       "commit.gpgsign=false"]


def copy_of_the_code(tree: Path) -> Path:
    """The provenance module at its place in a tree that also holds benchmarks/, docs/ and a
    pyproject.toml (not a git repository yet)."""
    for name in CODE:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, tree / name)
    (tree / "benchmarks").mkdir()
    (tree / "benchmarks" / "bench.py").write_text("N = 1\n")
    (tree / "benchmarks" / "results" / "r").mkdir(parents=True)
    (tree / "benchmarks" / "results" / "r" / "record.json").write_text("{}\n")
    (tree / "docs").mkdir()
    (tree / "docs" / "notes.md").write_text("notes\n")
    (tree / "pyproject.toml").write_text('[project]\nname = "posttrain"\n')
    return tree


def git(tree: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(tree), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def commit_all(tree: Path, message: str) -> str:
    git(tree, "add", "-A")
    git(tree, "commit", "-q", "-m", message)
    return git(tree, "rev-parse", "HEAD")


@pytest.fixture
def tree(tmp_path) -> Path:
    tree = copy_of_the_code(tmp_path / "tree")
    git(tree, "init", "-q")
    commit_all(tree, "first")
    return tree


def record(tree: Path, cwd: Path, **env: str) -> dict:
    """provenance() of the code in `tree`, run in a new interpreter from `cwd` (-P: the code is
    imported from `tree` even where `cwd` holds a posttrain package)."""
    code = ("import json, posttrain.run.provenance as p; "
            "print(json.dumps({'file': p.__file__, **p.provenance('posttrain train')}))")
    base = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_COMMIT"}
    env = {**base, "PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": "",
           "GIT_CEILING_DIRECTORIES": str(tree.parent), **env}
    out = subprocess.run([sys.executable, "-P", "-c", code], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    rec = json.loads(out)
    assert Path(rec.pop("file")) == tree / "posttrain" / "run" / "provenance.py"   # the copy ran
    return rec


def test_the_commit_is_the_code_trees_head_not_the_working_directorys(tree):
    head = git(tree, "rev-parse", "HEAD")
    assert head != git(REPO, "rev-parse", "HEAD")
    rec = record(tree, cwd=REPO)            # run from inside another git checkout
    assert rec["commit"] == head and rec["dirty"] is False
    assert rec["command"] == "posttrain train"
    # the machine: no GPU visible here, this machine's CPU count, the installed packages
    assert rec["machine"]["gpu"] is None and rec["machine"]["cpus"] == os.cpu_count()
    assert rec["versions"] == {n: importlib.metadata.version(n)
                               for n in ("posttrain", "torch", "transformers")}
    (tree / "benchmarks" / "bench.py").write_text("N = 2\n")
    later = commit_all(tree, "second")
    assert record(tree, cwd=tree.parent)["commit"] == later != head   # (cwd: no git tree at all)


@pytest.mark.parametrize("edited", ["posttrain/run/provenance.py",
                                    *(pytest.param(f, marks=pytest.mark.slow)
                                      for f in ("benchmarks/bench.py", "pyproject.toml"))])
def test_an_uncommitted_edit_to_the_code_makes_the_record_dirty(tree, edited):
    with open(tree / edited, "a") as f:
        f.write("# edited\n")
    rec = record(tree, cwd=REPO)
    assert rec["dirty"] is True and rec["commit"] == git(tree, "rev-parse", "HEAD")
    commit_all(tree, "the edit")
    assert record(tree, cwd=REPO)["dirty"] is False


def test_edits_outside_the_code_and_new_files_leave_the_record_clean(tree):
    (tree / "docs" / "notes.md").write_text("rewritten\n")        # tracked, not code
    (tree / "benchmarks" / "results" / "r" / "record.json").write_text('{"new": 1}\n')   # a result
    (tree / "posttrain" / "scratch.py").write_text("x = 1\n")     # untracked
    assert record(tree, cwd=REPO)["dirty"] is False


def test_without_git_the_commit_comes_from_the_environment_and_dirty_is_unknown(tmp_path):
    bare = copy_of_the_code(tmp_path / "bare")          # the code without its .git folder
    rec = record(bare, cwd=REPO, POSTTRAIN_COMMIT="abc123")
    # without git nobody knows whether the copy was edited: null, never a clean False
    assert rec["commit"] == "abc123" and rec["dirty"] is None
    rec = record(bare, cwd=REPO)
    assert rec["commit"] == "" and rec["dirty"] is None
