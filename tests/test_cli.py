"""The command line: help, and bad configs refused before any model is loaded."""

import subprocess
import sys

from posttrain.cli import main


def test_help_lists_presets_and_fields(capsys):
    try:
        main(["train", "--help"])
    except SystemExit as e:
        assert e.code == 0
    out = capsys.readouterr().out
    for word in ("reinforce", "rloo", "grpo", "dapo", "dr_grpo", "optim:", "clip_high", "--resume"):
        assert word in out


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


import pytest  # noqa: E402


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
