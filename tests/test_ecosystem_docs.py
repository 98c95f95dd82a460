"""docs/environments.md's worked examples (OpenEnv, verifiers, an agent harness, an LLM judge)
run as written, on a tiny random model: file blocks are written into a scratch folder, each
`posttrain ...` line runs through the CLI's `main` with the sizes shrunk, a line ending in `&`
starts in the background (its port swapped for a free one) and is stopped at the end. Every
other `posttrain` command the docs show (GPU runs, ```text blocks, indented blocks: not run)
is parsed by the CLI's own parser and option check.
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import openenv.core  # noqa: F401  (installed by scripts/install-cpu.sh: a broken install fails)
import pytest
import verifiers.v1  # noqa: F401

from tests.conftest import make_tiny_model
from tests.test_your_own_task import BLOCK, commands

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "environments.md"
SHRINK = ["--steps", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
          "--rollout.max_new_tokens", "4", "--data.eval_size", "2", "--max_minutes", "null",
          "--model.path", "my-model", "--env.max_tokens", "32", "--no-progress"]
# what each example's run must show it did (a tiny random policy solves nothing: counts, not rewards)
SHOWS = {"openenv": lambda r: r.get("env/turns", 0) >= 1,
         "verifiers": lambda r: "env/reward_correct" in r and r.get("env/env_errors", 0) == 0,
         "agent": lambda r: r.get("env/turns", 0) >= 1,
         "judge": lambda r: r.get("reward/judge_requests", 0) + r.get("reward/judge_cache_hits", 0) > 0}


def examples() -> list[tuple[str, str | None, str]]:
    text = PAGE.read_text()
    part = text[text.index("<!-- worked examples -->"):text.index("<!-- /worked examples -->")]
    return [(m[1], m[2], m[3]) for m in BLOCK.finditer(part)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(port: int, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise AssertionError(f"the background server exited: {open(proc.log).read()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listens on {port}")


def background(line: str, ports: dict[str, str]) -> subprocess.Popen:
    port = re.search(r"--port (\d+)", line)[1]
    ports[port] = str(free_port())
    args = shlex.split(line.rstrip("&").replace(port, ports[port]))
    if args[0] == "posttrain":
        args = [sys.executable, "-m", "posttrain.cli", *args[1:], "--model.path", "my-model"]
    else:
        args[0] = sys.executable
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.getcwd()]))
    log = open(f"background-{len(ports)}.log", "w")   # (never a pipe nobody reads)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    proc.log = log.name
    wait_for(int(ports[port]), proc)
    return proc


def run_train(line: str, ports: dict[str, str], run_dir: Path) -> None:
    from posttrain.cli import main
    for old, new in ports.items():
        line = line.replace(f":{old}", f":{new}")
    args = shlex.split(line)[1:]
    assert main([*args, *SHRINK, "--run_dir", str(run_dir)]) == 0, line


# a command line in a code block: `posttrain ...`, `VAR=x posttrain ...`, `torchrun ... -m posttrain.cli ...`
COMMAND = re.compile(r"^(?:\w+=\S+ )*(?:posttrain |torchrun .*-m posttrain\.cli )")


def doc_commands(text: str) -> list[str]:
    """Every command line of a Markdown page's code (fenced or indented four spaces),
    backslash continuations joined."""
    lines, fenced = [], False
    for raw in text.replace("\\\n", " ").splitlines():
        if raw.lstrip().startswith("```"):
            fenced = not fenced
        elif (fenced or raw.startswith("    ")) and COMMAND.match(raw.strip()):
            lines.append(raw.strip())
    return lines


def quiet_parser():
    """The parser `main` builds, raising its errors instead of printing them and exiting."""
    from posttrain.cli import build_parser
    from posttrain.config.commands import ConfigError

    def error(message: str):
        raise ConfigError(message)
    parser = build_parser()
    parser.error = error
    for sub in next(a for a in parser._actions if a.dest == "command").choices.values():
        sub.error = error
    return parser


def refusal(line: str, parser=None) -> str | None:
    """What `posttrain` says when it refuses the line's command and options (None: accepted):
    the parser `main` builds, then the option check `main` runs before any job starts."""
    from posttrain.config.commands import ConfigError, StageConfig, TrainConfig
    from posttrain.config.options import check_option_names
    args = shlex.split(line.rstrip("&"), comments=True)
    argv = args[args.index("posttrain" if "posttrain" in args else "posttrain.cli") + 1:]
    parser = parser or quiet_parser()
    try:
        ns, rest = parser.parse_known_args(argv)
        if ns.command in ("prepare-model", "plot", "view"):
            return f"unexpected arguments {rest}" if rest else None
        config = StageConfig if ns.command in ("sft", "dpo", "reward-model") else TrainConfig
        check_option_names(rest, config, ns.own_flags)
    except ConfigError as e:
        return str(e)
    return None


def test_every_posttrain_command_in_the_docs_parses(monkeypatch):
    import functools
    from posttrain.config import options
    # (the option check asks typing for each field's hint; the same answers, cached, for 60 lines)
    monkeypatch.setattr(options, "type_hint", functools.cache(options.type_hint))
    pages = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    found = {p.name: doc_commands(p.read_text()) for p in pages}
    assert len(found["environments.md"]) >= 9 and sum(map(len, found.values())) >= 60
    parser = quiet_parser()
    said = {f"{page}: {line}": refusal(line, parser) for page, lines in found.items() for line in lines}
    assert {where: why for where, why in said.items() if why is not None} == {}


@pytest.mark.parametrize("line, said", [
    ("posttrain train --optim.lrr 1e-5", "unknown option --optim.lrr; did you mean --optim.lr?"),
    ("posttrain sft --lr 1e-5", "did you mean --optim.lr?"),
    ("posttrain trian --steps 2", "invalid choice: 'trian'"),
    ("posttrain plot runs/x --dpi 3", "unexpected arguments ['--dpi', '3']"),
    ("torchrun --nproc-per-node 2 -m posttrain.cli sft --parallel.stratgy fsdp",
     "did you mean --parallel.strategy?"),
])
def test_a_docs_command_with_a_wrong_option_is_caught(line, said):
    assert said in refusal(line)
    assert doc_commands(f"```bash\n{line} \\\n  --seed 1\n```\n    {line}\nprose {line}\n") == [
        f"{line}    --seed 1", line]


@pytest.mark.slow   # (~35 s, every worked example run: in the full suite, README)
def test_every_worked_example_runs(tokenizer, tmp_path, monkeypatch):
    make_tiny_model(tokenizer).save_pretrained(tmp_path / "my-model")
    tokenizer.save_pretrained(tmp_path / "my-model")
    monkeypatch.chdir(tmp_path)
    for name in ("examples", "posttrain"):   # (the commands name the repository's files)
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.setattr(sys, "path", [str(ROOT), *sys.path])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path)]))
    ports: dict[str, str] = {}
    procs, runs = [], []
    try:
        for lang, name, body in examples():
            if name is not None:
                Path(name).write_text(body)
                continue
            for line in commands(body) if lang == "bash" else []:
                if line.endswith("&"):
                    procs.append(background(line, ports))
                else:
                    runs.append((line, tmp_path / f"run{len(runs)}"))
                    run_train(line, ports, runs[-1][1])
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
    shown = set()
    for line, run_dir in runs:
        rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
        kind = next(k for k in ("openenv", "verifiers", "agent", "judge") if k in line)
        assert any(SHOWS[kind](r) for r in rows), (line, rows[-1])
        shown.add(kind)
    assert shown == set(SHOWS) and len(runs) == 5
