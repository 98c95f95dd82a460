"""The command line: help, and bad configs refused before any model is loaded."""

import json
import re
import subprocess
import sys
from dataclasses import replace

import pytest

from posttrain.cli import main


def _help(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def _fields(cls: type, prefix: str = "") -> list[str]:
    """A config dataclass's fields, dotted, walked here without posttrain's own walk (TrainConfig's
    `algorithm` mapping takes AlgorithmConfig's fields, as the --help text says)."""
    import dataclasses
    import typing
    from posttrain.config.commands import TrainConfig
    from posttrain.config.presets import AlgorithmConfig
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if cls is TrainConfig and f.name == "algorithm":
            out += _fields(AlgorithmConfig, "algorithm.")
        elif dataclasses.is_dataclass(hints[f.name]):
            out += _fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append(f"{prefix}{f.name}")
    return out


@pytest.mark.parametrize("command", ["train", "sft", "dpo", "reward-model"])
def test_help_lists_every_config_field_once_and_each_listed_option_is_accepted(command, capsys):
    """The option list of `posttrain CMD --help` is the config dataclass's fields, each once, in
    declaration order; every option it lists passes the check `main` runs on the command line
    (a field missing from --help, or one --help shows that `main` refuses, fails here)."""
    from posttrain.cli import build_parser
    from posttrain.config.commands import StageConfig, TrainConfig
    from posttrain.config.options import check_option_names
    cls = TrainConfig if command == "train" else StageConfig
    out = _help(command, capsys)
    listed = re.findall(r"^  --([\w.]+) \(", out, re.M)
    assert listed == _fields(cls)
    own = build_parser().parse_known_args([command])[0].own_flags   # (what main reads)
    assert set(own) == {"-h", "--help", "--config", "--resume", "--no-progress"}
    usage = out.split("\n\n")[0]
    assert [f for f in own if f"[{f}" not in usage] == ["--help"]   # (shown as [-h])
    # (raises ConfigError naming the first option it refuses)
    check_option_names([arg for name in listed for arg in (f"--{name}", "1")], cls, own)


def test_train_help_lists_each_preset_and_each_selects_its_algorithm(capsys):
    from posttrain.config.options import load_config
    from posttrain.config.presets import PRESETS
    line = next(x for x in _help("train", capsys).splitlines() if x.startswith("Presets (--preset): "))
    names = line[len("Presets (--preset): "):].split(". ")[0].split(", ")
    assert names == list(PRESETS)
    for name in names:   # (opd distils: it needs a teacher to pass validation)
        teacher = ["--teacher.path", "T"] if name == "opd" else []
        assert load_config(None, ["--preset", name, *teacher]).algo == PRESETS[name], name
    clip = load_config(None, ["--preset", "dapo", "--algorithm.clip_high", "0.5"]).algo
    assert clip == replace(PRESETS["dapo"], clip_high=0.5)   # algorithm.* on top of the preset


def test_every_option_of_every_command_has_a_description(capsys):
    """--help of each command lists each config field with its type, default and description
    (read from the comments beside the dataclass field)."""
    from posttrain.config.commands import StageConfig, TrainConfig
    from posttrain.config.options import option_names, options_help
    for cls in (TrainConfig, StageConfig):
        lines = options_help(cls)
        assert len(lines) == len(option_names(cls))
        undocumented = [line for line in lines if "): " not in line or not line.split("): ", 1)[1]]
        assert not undocumented, undocumented
    for command, line in (("sft", "--optim.lr (float, default 1e-05): AdamW learning rate"),
                          ("dpo", "--beta (float, default 0.1): DPO"),
                          ("reward-model", "--reward_form (score_head|log_ratio, default")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert line in capsys.readouterr().out


def test_stage_commands_read_a_yaml_config_and_the_command_line_wins(tmp_path, monkeypatch):
    import posttrain.stages.sft
    seen = {}
    monkeypatch.setattr(posttrain.stages.sft, "sft", lambda cfg, resume=None, **kw: seen.update(cfg=cfg, resume=resume, **kw) or {})
    f = tmp_path / "sft.yaml"
    f.write_text("data:\n  synthetic: subtraction\noptim:\n  lr: 3.0e-5\nbatch_size: 4\n")
    assert main(["sft", "--config", str(f), "--batch_size", "16"]) == 0
    cfg = seen["cfg"]
    assert (cfg.data.synthetic, cfg.optim.lr, cfg.batch_size) == ("subtraction", 3e-5, 16)
    assert cfg.optim.beta2 == 0.999   # the stages' own default, kept under a partial optim section
    f.write_text("data:\n  synthetic: subtraction\noptim:\n  lrr: 3.0e-5\n")
    assert main(["sft", "--config", str(f)]) == 2
    # --resume RUN: the config its checkpoint recorded (hash-checked), then the command line
    from posttrain.run.checkpoint import seal
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_000001"
    step.mkdir(parents=True)
    saved = json.dumps({"data": {"synthetic": "addition"}, "optim": {"lr": 2e-5}, "run_dir": str(run)})
    for folder in (run, step):
        (folder / "config.json").write_text(saved)
    seal(step, 1)
    assert main(["sft", "--resume", str(run), "--batch_size", "2"]) == 0
    cfg = seen["cfg"]
    assert (cfg.data.synthetic, cfg.optim.lr, cfg.batch_size, seen["resume"]) == ("addition", 2e-5, 2, run)


@pytest.mark.parametrize("argv,msg", [
    (["sft", "--data.synthetic", "addition", "--optim.lr", "-1"], "optim.lr=-1.0 must be > 0"),
    (["sft", "--data.synthetic", "addition", "--batch_size", "0"], "batch_size=0 must be >= 1"),
    (["dpo", "--data.synthetic", "addition", "--beta", "0"], "beta=0.0 must be > 0"),
    (["dpo", "--data.synthetic", "countdown"], "data.synthetic='countdown' is not valid"),
    (["reward-model", "--data.synthetic", "addition", "--data.terse_wrong_share", "2"],
     "terse_wrong_share=2.0 must be <= 1"),
    (["sft", "--data.synthetic", "addition", "--parallel.strategy", "zero3"], "zero3"),
    (["sft", "--config", "/nonexistent.yaml"], "config file /nonexistent.yaml does not exist"),
])
def test_stage_ranges_are_checked_before_anything_loads(argv, msg, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1


def test_bad_override_fails_fast_with_the_field_name(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--optim.lr", "fast"]) == 2
    assert "optim.lr='fast' must be a number" in capsys.readouterr().err
    assert main(["train", "--model.path", "/does/not/exist", "--data.eval_size", "0"]) == 2
    assert "not a local Hugging Face model folder" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []     # a refused run leaves no empty run folder behind


def test_the_installed_console_script_is_the_cli(tmp_path):
    """The `posttrain` script the install put beside this Python: its --help names exactly the
    commands the parser registers, and a mistyped option exits 2 with one line on stderr that
    names it, before any job starts."""
    import argparse
    import tomllib
    from pathlib import Path
    import posttrain
    from posttrain.cli import build_parser
    root = Path(__file__).resolve().parent.parent
    scripts = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"posttrain": "posttrain.cli:main"}
    script = Path(sys.executable).parent / "posttrain"
    run = lambda *a: subprocess.run([str(script), *a], capture_output=True, text=True,  # noqa: E731
                                    cwd=tmp_path, timeout=120)
    shown = run("--help")
    assert shown.returncode == 0
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    listed = re.search(r"\{([\w,-]+)\}", shown.stdout)[1].split(",")
    assert listed == list(commands.choices)
    assert run("--version").stdout.strip() == f"posttrain {posttrain.__version__}"
    refused = run("train", "--optim.lrr", "1")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == ["posttrain: error: unknown option --optim.lrr; did you "
                                           "mean --optim.lr? (every option: --help)"]
    assert list(tmp_path.iterdir()) == []   # no run folder


@pytest.mark.parametrize("argv,msg", [
    (["train", "--no-progres"], "unknown option --no-progres; did you mean --no-progress?"),
    (["train", "--no-prog"], "unknown option --no-prog; did you mean --no-progress?"),   # no prefixes
    (["train", "--optim.lrr", "1"], "unknown option --optim.lrr; did you mean --optim.lr?"),
    (["train", "--algorithm.clip_hi", "0.3"], "did you mean --algorithm.clip_high?"),
    (["eval", "--model.path", "m", "--sample", "3"], "unknown option --sample; did you mean --samples?"),
    (["generate", "--model.path", "m", "--out", "o.jsonl", "--rollout.groupsize", "2"],
     "did you mean --rollout.group_size?"),
    (["sft", "--lrr", "1e-5"], "unknown option --lrr; did you mean --optim.lr?"),
    (["dpo", "--strategy", "fsdp"], "unknown option --strategy; did you mean --parallel.strategy?"),
    (["dpo", "--lr", "1e-5"], "unknown option --lr; did you mean --optim.lr?"),
    (["train", "--lr", "1e-5"], "unknown option --lr; did you mean --optim.lr or --critic.lr?"),
    (["dpo", "--data.synthetic", "addition", "--bta", "0.1"], "did you mean --beta?"),
    (["reward-model", "--data.synthetic", "addition", "--reward_from", "x"], "did you mean --reward_form?"),
    (["plot", "runs/x", "--dpi", "3"], "unexpected arguments --dpi"),
])
def test_a_mistyped_option_never_starts_a_job(argv, msg, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_version(capsys):
    import posttrain
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"posttrain {posttrain.__version__}"


def _command_options() -> dict[str, set[str]]:
    """Every option of every command, dotted, dashes as underscores: the command's own flags and
    the config fields it takes as overrides."""
    import argparse
    from posttrain.cli import build_parser
    from posttrain.config.commands import StageConfig, TrainConfig
    from posttrain.config.options import option_names
    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    config_of = {"train": TrainConfig, "eval": TrainConfig, "generate": TrainConfig,
                 "sft": StageConfig, "dpo": StageConfig, "reward-model": StageConfig}
    out = {}
    for name, sub in subs.items():
        flags = {o[2:].replace("-", "_") for a in sub._actions for o in a.option_strings
                 if o.startswith("--") and o != "--help"}
        fields = set(option_names(config_of[name])) if name in config_of else set()
        out[name] = flags | fields
    return out


def _clashes(opts: dict[str, set[str]]) -> list[str]:
    train_paths: dict[str, set[str]] = {}
    for o in opts["train"]:
        train_paths.setdefault(o.split(".")[-1], set()).add(o)
    return [f"{cmd}: --{o}" for cmd, names in sorted(opts.items()) for o in sorted(names)
            if o.split(".")[-1] in train_paths and o not in train_paths[o.split(".")[-1]]]


def test_every_command_spells_an_option_the_same_way():
    """Walks every command's options: a name two commands share is written one way (for each
    last component, `lr`, `path`, `strategy`, `system_prompt`, ..., only the dotted paths
    `posttrain train` uses: --optim.lr everywhere, never --lr), and the concepts every training
    command has are there under the same name."""
    opts = _command_options()
    assert set(opts) >= {"train", "eval", "sft", "dpo", "reward-model", "generate", "prepare-model"}
    assert not _clashes(opts)
    shared = ["config", "resume", "model.path", "model.autocast", "model.attention", "optim.lr",
              "optim.schedule", "optim.warmup_steps", "optim.beta2", "parallel.strategy",
              "data.system_prompt", "data.eval_size", "data.prompt_field", "seed", "run_dir",
              "checkpoint.every_steps", "checkpoint.every_minutes", "checkpoint.keep",
              "no_progress", "threads", "max_minutes"]
    for cmd in ("train", "sft", "dpo", "reward-model"):
        assert not [o for o in shared if o not in opts[cmd]], cmd
    for cmd in ("eval", "generate"):   # (they take TrainConfig's fields: its seed, threads, ...)
        assert not [o for o in ("model.path", "config", "seed", "threads", "no_progress")
                    if o not in opts[cmd]], cmd


def test_max_minutes_ends_a_stage_early_and_it_finishes_as_at_the_end(tmp_path, tokenizer,
                                                                      monkeypatch):
    """A stage past --max_minutes stops before its next step, checkpoints, and still writes its
    held-out figures, final model and summary; a longer budget continues from that checkpoint."""
    import json

    import posttrain.run.lifecycle as lifecycle
    from posttrain.stages.sft import sft
    from tests.conftest import make_tiny_model, stage_config

    clock = iter(float(i) for i in range(1000))   # each step reads it twice: 1 s a step
    monkeypatch.setattr(lifecycle, "_clock", lambda: next(clock))
    run = tmp_path / "run"
    fields = dict(synthetic="addition", n_pairs=24, eval_size=2, batch_size=8, epochs=2)
    out = sft(stage_config(run_dir=str(run), max_minutes=2.5 / 60, **fields),
              model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert out["steps"] == 3 and (run / "final_model").is_dir()   # 1 s a step: 3 s >= 2.5 s
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003"]
    assert "behaviour_after" in json.loads((run / "summary.json").read_text())
    out = sft(stage_config(run_dir=str(run), **fields), show_progress=False, resume=run)
    assert out["steps"] == 6


def test_the_walk_catches_a_flat_name():
    """Not vacuous: the stages' old spellings (--lr, --strategy beside train's --optim.lr and
    --parallel.strategy) are clashes."""
    opts = _command_options()
    opts["sft"].add("lr")
    opts["dpo"].add("strategy")
    assert _clashes(opts) == ["dpo: --strategy", "sft: --lr"]
