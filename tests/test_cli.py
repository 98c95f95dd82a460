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
