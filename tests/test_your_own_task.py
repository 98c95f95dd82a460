"""docs/your-own-task.md runs as written: every code block, in order, on a tiny random model.

File blocks (```jsonl problems.jsonl, ```python my_rewards.py, ```yaml my_task.yaml) are written
into a scratch folder; each `posttrain ...` line of a ```bash block runs through the CLI's own
`main` with the sizes shrunk (SHRINK: 2 steps of 2 x 2 answers of 4 tokens); other shell lines run
in a shell; a ```python block without a file name runs with `load_config` shrinking the same way
and pointing at the tiny model. ```text blocks (the GPU commands) are not run.
"""

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import make_tiny_model

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "your-own-task.md"
BLOCK = re.compile(r"^```(\w+)(?: (\S+))?\n(.*?)^```$", re.S | re.M)
SHRINK = {
    "train": ["--steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
              "--rollout.max_new_tokens", "4", "--data.eval_size", "4", "--max_minutes", "null",
              "--threads", "1"],
    "eval": ["--rollout.max_new_tokens", "4"],
}


def blocks() -> list[tuple[str, str | None, str]]:
    return [(m[1], m[2], m[3]) for m in BLOCK.finditer(GUIDE.read_text())]


def commands(script: str) -> list[str]:
    """A bash block's commands, backslash continuations joined."""
    return [line.strip() for line in script.replace("\\\n", " ").splitlines() if line.strip()]


def run_posttrain(line: str) -> None:
    from posttrain.cli import main

    args = shlex.split(line)[1:]
    args += SHRINK.get(args[0], []) + (["--no-progress"] if args[0] == "train" else [])
    assert main(args) == 0, line


def run_python(code: str, monkeypatch) -> None:
    import posttrain
    from posttrain.config import options

    def shrunk(path=None, overrides=None, base=None):
        extra = [*SHRINK["train"][:-2], "--model.path", "my-model"]   # (--threads is the CLI's)
        return options.load_config(path, [*(overrides or []), *extra], base)

    monkeypatch.setattr(posttrain, "load_config", shrunk, raising=False)
    exec(compile(code, str(GUIDE), "exec"), {"__name__": "guide"})


def test_the_guide_has_every_kind_of_block():
    kinds = {(lang, name is not None) for lang, name, _ in blocks()}
    assert {("jsonl", True), ("python", True), ("yaml", True), ("bash", False),
            ("python", False), ("text", False)} <= kinds


@pytest.mark.slow   # (~25 s, every block of the guide run: in the full suite, README)
def test_every_block_of_the_guide_runs(tokenizer, tmp_path, monkeypatch, capsys):
    make_tiny_model(tokenizer).save_pretrained(tmp_path / "my-model")
    tokenizer.save_pretrained(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))       # my_rewards is imported from here
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    ran = []
    for lang, name, body in blocks():
        if name is not None:
            Path(name).write_text(body)
        elif lang == "bash":
            for line in commands(body):
                if line.startswith("posttrain "):
                    run_posttrain(line)
                else:
                    subprocess.run(line, shell=True, check=True, capture_output=True)
                ran.append(line.split()[:2])
        elif lang == "python":
            run_python(body, monkeypatch)
            ran.append(["python"])
    out = capsys.readouterr().out
    assert ["posttrain", "eval"] in ran and ["posttrain", "plot"] in ran and ["python"] in ran
    assert sum(r == ["posttrain", "train"] for r in ran) == 6
    for run in ("runs/mine", "runs/brief", "runs/own-reward", "runs/trl", "runs/my-task",
                "runs/my-task-lr2e-5", "runs/py"):
        assert (tmp_path / run / "final_model" / "config.json").is_file(), run
    # the TRL functions ran on every response (a failing call would be counted, never raised)
    trl = [json.loads(line) for line in open(tmp_path / "runs/trl/metrics.jsonl")]
    assert [k for r in trl for k in r if k.startswith("reward/failures")] == []
    assert any("reward/mean" in r for r in trl)
    # the Python block's prints: accuracy before -> after (fractions), then the final model
    assert re.search(r"(?m)^[01](\.\d+)?(e-\d+)? -> [01](\.\d+)?(e-\d+)?$", out), out[-500:]
    assert re.search(r"(?m)^runs/py/final_model$", out), out[-500:]


def test_the_guide_recipe_and_rewards_mean_what_it_says(tmp_path):
    """The recipe block is a valid config naming the reward block's function; the reward
    functions return what their docstrings say."""
    from posttrain.config.options import load_config

    files = {name: body for _, name, body in blocks() if name}
    (tmp_path / "my_task.yaml").write_text(files["my_task.yaml"])
    cfg = load_config(tmp_path / "my_task.yaml")
    assert cfg.reward.functions == ("my_rewards:brevity",) and cfg.data.task == "file"
    # it trains the default recipe's algorithm, as the command-line examples do (it says so),
    # where the library defaults alone would add a KL penalty and drop the stop string
    from posttrain.config.options import recipe_path
    recipe, bare = load_config(recipe_path()), load_config(None)
    assert cfg.algo == recipe.algo != bare.algo and cfg.algo.kl_coef == 0.0 < bare.algo.kl_coef
    assert cfg.rollout.stop == recipe.rollout.stop == ("\n\n",) != bare.rollout.stop
    assert cfg.model.autocast == recipe.model.autocast
    namespace: dict = {}
    exec(files["my_rewards.py"], namespace)
    assert namespace["brevity"]("q", "  42 ", "42") == 0.2
    assert namespace["brevity"]("q", "x" * 41, "42") == 0.0
    assert namespace["mentions_answer"]("q", "it is 42.", "42") == 1.0
    assert namespace["mentions_answer"]("q", "it is 41.", "42") == 0.0

