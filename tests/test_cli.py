"""The command line: help, and bad configs refused before any model is loaded."""

import subprocess
import sys

import pytest

from posttrain.cli import main


def test_help_lists_presets_and_fields(capsys):
    try:
        main(["train", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for word in ("reinforce", "rloo", "grpo", "dapo", "dr_grpo", "--algorithm.clip_high", "--resume",
                 "--optim.lr (float, default 1e-05): AdamW learning rate"):
        assert word in out


def test_every_option_of_every_command_has_a_description(capsys):
    """--help of each command lists each config field with its type, default and description
    (read from the comments beside the dataclass field)."""
    from posttrain.config import StageConfig, TrainConfig, option_names, options_help
    for cls in (TrainConfig, StageConfig):
        lines = options_help(cls)
        assert len(lines) == len(option_names(cls))
        undocumented = [line for line in lines if "): " not in line or not line.split("): ", 1)[1]]
        assert not undocumented, undocumented
    for command, line in (("sft", "--lr (float, default 1e-05): AdamW learning rate"),
                          ("dpo", "--beta (float, default 0.1): DPO"),
                          ("reward-model", "--reward_form (score_head|log_ratio, default")):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert line in capsys.readouterr().out


def test_stage_commands_read_a_yaml_config_and_the_command_line_wins(tmp_path, monkeypatch):
    import posttrain.stages
    seen = {}
    monkeypatch.setattr(posttrain.stages, "sft", lambda cfg: seen.update(cfg=cfg) or {})
    f = tmp_path / "sft.yaml"
    f.write_text("synthetic: subtraction\nlr: 3.0e-5\nbatch_size: 4\n")
    assert main(["sft", "--config", str(f), "--batch_size", "16"]) == 0
    cfg = seen["cfg"]
    assert (cfg.synthetic, cfg.lr, cfg.batch_size) == ("subtraction", 3e-5, 16)
    f.write_text("synthetic: subtraction\nlrr: 3.0e-5\n")
    assert main(["sft", "--config", str(f)]) == 2


@pytest.mark.parametrize("argv,msg", [
    (["sft", "--synthetic", "addition", "--lr", "-1"], "lr=-1.0 must be > 0"),
    (["sft", "--synthetic", "addition", "--batch_size", "0"], "batch_size=0 must be >= 1"),
    (["dpo", "--synthetic", "addition", "--beta", "0"], "beta=0.0 must be > 0"),
    (["dpo", "--synthetic", "countdown"], "synthetic='countdown' is not valid"),
    (["reward-model", "--synthetic", "addition", "--terse_wrong_share", "2"],
     "terse_wrong_share=2.0 must be <= 1"),
    (["sft", "--synthetic", "addition", "--strategy", "zero3"], "strategy='zero3' is not valid"),
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


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "posttrain" in out and "train" in out



@pytest.mark.parametrize("argv,msg", [
    (["train", "--no-progres"], "unknown option --no-progres; did you mean --no-progress?"),
    (["train", "--no-prog"], "unknown option --no-prog; did you mean --no-progress?"),   # no prefixes
    (["train", "--optim.lrr", "1"], "unknown option --optim.lrr; did you mean --optim.lr?"),
    (["train", "--algorithm.clip_hi", "0.3"], "did you mean --algorithm.clip_high?"),
    (["eval", "--model", "m", "--sample", "3"], "unknown option --sample; did you mean --samples?"),
    (["generate", "--model", "m", "--out", "o.jsonl", "--rollout.groupsize", "2"],
     "did you mean --rollout.group_size?"),
    (["sft", "--lrr", "1e-5"], "unknown option --lrr; did you mean --lr?"),
    (["dpo", "--synthetic", "addition", "--bta", "0.1"], "did you mean --beta?"),
    (["reward-model", "--synthetic", "addition", "--reward_from", "x"], "did you mean --reward_form?"),
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
