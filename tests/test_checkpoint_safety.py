"""Checkpoints that cannot run code and survive a crash or a damaged disk: weights_only loading,
a COMPLETE marker with sizes written last, numeric step order, the old checkpoint kept until the
new one is in place, and a resume that falls back to the previous checkpoint."""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import posttrain.run.checkpoint as ckpt
from posttrain import load_config, train
from tests.conftest import make_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

TINY = ["--data.eval_size", "0", "--data.system_prompt", "null", "--tensorboard", "false",
        "--threads", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--checkpoint.every_minutes", "null", "--optim.lr", "1e-3", "--rollout.max_new_tokens", "3",
        "--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e"]


class Evil:
    """A pickle that creates a file when it is loaded (any callable would run the same way)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


def _run(tmp_path, tokenizer, steps, resume=None):
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", str(steps),
                             "--checkpoint.every_steps", "1"])
    return train(cfg, resume=resume, model=make_tiny_model(tokenizer) if resume is None else None,
                 tokenizer=tokenizer if resume is None else None, show_progress=False)


def test_a_tampered_trainer_state_is_refused_and_runs_nothing(tmp_path, tokenizer):
    _run(tmp_path, tokenizer, 1)
    step = ckpt.latest_checkpoint(tmp_path / "run")
    marker = tmp_path / "PWNED"
    torch.save({"step": 1, "payload": Evil(marker)}, step / "trainer_state.pt")
    (step / "COMPLETE").unlink()
    ckpt.seal(step, 1)                  # (an attacker can rewrite the marker too)
    with pytest.raises(ckpt.CheckpointError, match="trainer_state.pt: cannot be loaded safely"):
        ckpt.load_trainer_state(step)
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint under .* loads"):
        train(load_config(None, [*TINY, "--steps", "2"]), resume=tmp_path / "run",
              show_progress=False)
    assert not marker.exists()
    torch.load(step / "trainer_state.pt", weights_only=False)   # the old loader: it would have run
    assert marker.exists()


def test_rng_states_survive_weights_only_loading_exactly(tmp_path):
    gen = torch.Generator().manual_seed(3)
    random.seed(1), np.random.seed(2), torch.manual_seed(4), np.random.standard_normal()
    torch.save({"rng": ckpt.rng_state(gen)}, tmp_path / "s.pt")
    expected = (random.random(), np.random.standard_normal(), torch.rand(2), torch.rand(2, generator=gen))
    ckpt.restore_rng(torch.load(tmp_path / "s.pt", weights_only=True)["rng"], gen)
    got = (random.random(), np.random.standard_normal(), torch.rand(2), torch.rand(2, generator=gen))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2]) and torch.equal(got[3], expected[3])


def _fake_checkpoint(run_dir: Path, step: int, sealed: bool = True) -> Path:
    folder = run_dir / "checkpoints" / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.pt").write_bytes(b"x" * 100)
    if sealed:
        ckpt.seal(folder, step)
    return folder


def test_steps_sort_as_numbers_and_only_complete_checkpoints_count(tmp_path):
    _fake_checkpoint(tmp_path, 999_999)
    _fake_checkpoint(tmp_path, 1_000_000)          # 'step_1000000' < 'step_999999' as text
    assert ckpt.latest_checkpoint(tmp_path).name == "step_1000000"
    _fake_checkpoint(tmp_path, 1_000_001, sealed=False)   # never finished: no marker
    assert ckpt.latest_checkpoint(tmp_path).name == "step_1000000"
    with open(tmp_path / "checkpoints" / "step_1000000" / "trainer_state.pt", "r+b") as f:
        f.truncate(50)                               # the disk lost the end of a file
    assert ckpt.latest_checkpoint(tmp_path).name == "step_999999"


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path):
    for step in (2, 3, 5):   # 5: a complete but unreadable one a resume fell back past
        _fake_checkpoint(tmp_path, step)
    ckpt.prune(tmp_path, keep=1, newest=3)
    assert [p.name for p in ckpt.step_folders(tmp_path)] == ["step_000003", "step_000005"]


def test_the_old_checkpoint_stays_until_the_new_one_is_in_place(tmp_path, tokenizer, monkeypatch):
    _run(tmp_path, tokenizer, 2)
    run = tmp_path / "run"
    assert [p.name for p in ckpt.step_folders(run)] == ["step_000001", "step_000002"]
    real = os.replace

    def power_cut(src, dst):
        if str(src).endswith(".tmp"):   # the new checkpoint cannot be renamed into place
            raise OSError(5, "Input/output error")
        return real(src, dst)
    monkeypatch.setattr(ckpt.os, "replace", power_cut)
    from posttrain.run.checkpoint import save_checkpoint, trainer_state
    model = make_tiny_model(tokenizer)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for step in (3, 2):   # a new step, and the same step saved again (the old code deleted it first)
        with pytest.raises(OSError):
            save_checkpoint(run, step, model, tokenizer,
                            trainer_state(model, opt, sched, torch.Generator(), {}), {}, keep=1)
        assert [p.name for p in ckpt.step_folders(run)] == ["step_000001", "step_000002"]
        assert all(ckpt.is_complete(p) for p in ckpt.step_folders(run))
    marker = json.loads((run / "checkpoints" / "step_000002" / "COMPLETE").read_text())
    assert marker["step"] == 2 and marker["files"]["trainer_state.pt"] > 0


@pytest.mark.parametrize("name", ["model/model.safetensors", *(pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("trainer_state.pt", "model/config.json"))])
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, tokenizer, caplog, name):
    _run(tmp_path, tokenizer, 2)
    run = tmp_path / "run"
    newest = run / "checkpoints" / "step_000002" / name
    newest.write_bytes(b"\0" * newest.stat().st_size)        # same size (the marker agrees), unreadable
    point = ckpt.resume_point(run)
    assert point[0].name == "step_000001" and point[1]["step"] == 1
    assert "step_000002" in caplog.text and "resuming from step_000001" in caplog.text


@pytest.mark.slow   # (~40 s: in the full suite, README; benchmarks/crash_resume.py runs 8 kills)
def test_kill9_and_a_truncated_newest_checkpoint_still_end_bit_identical(tmp_path):
    """SIGKILL once the checkpoint of step 3 is complete, cut its largest file in half: the
    resume falls back to step 2's checkpoint and ends bit for bit like an uninterrupted run."""
    from crash_resume import kill_truncate_resume
    result = kill_truncate_resume(tmp_path, steps=6, at_checkpoint=3)
    assert result["newest_checkpoint_truncated"] == 1 and result["exit"] == 0, result
    assert int(result["fell_back_to"][5:]) < int(result["killed_after"][5:]), result
    assert result["weights"] == 0 and result["optimizer"] == 0 and result["metrics_rows"] == 0, result
    assert result["n_weights"] > 0 and result["n_rows"] >= 6


# ---------------------------------------------------------------------------------------------
# resume trusts nothing it did not write
# ---------------------------------------------------------------------------------------------

def test_an_edited_run_config_is_not_what_resumes(tmp_path, tokenizer, caplog, monkeypatch):
    """The attack: add a module to import to a finished run's config.json, then resume it. The
    run continues (one more step) with the checkpoint's own config: the module is never
    imported, the edit is named. (Read from the folder's config.json, the Scorer would import
    pwn.py at the start of the resumed run and PWNED would exist.)"""
    import argparse
    from posttrain.cli import _config_and_resume
    _run(tmp_path, tokenizer, 2)
    run = tmp_path / "run"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pwn.py").write_text(f"open({str(tmp_path / 'PWNED')!r}, 'w')\ndef f(**kw): return 0.0\n")
    config = json.loads((run / "config.json").read_text())
    config["reward"]["functions"] = ["pwn:f"]
    (run / "config.json").write_text(json.dumps(config))
    with caplog.at_level("WARNING", logger="posttrain"):
        cfg, resume = _config_and_resume(argparse.Namespace(resume=str(run)), None, ["--steps", "3"],
                                         load_config, lambda c: c.to_dict())
        summary = train(cfg, resume=resume, show_progress=False)
    assert summary["steps"] == 3 and resume == run
    assert cfg.reward.functions == ("tests.toy_rewards:first_letter_a_to_e",)
    assert "differs from the config checkpoint step_000002 recorded (in reward)" in caplog.text
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("victim", ["trainer_state.pt", *(pytest.param(v, marks=pytest.mark.slow)
                                    for v in ("config.json", "model/model.safetensors"))])
def test_a_file_changed_in_place_is_refused_and_the_resume_falls_back(tmp_path, tokenizer, victim):
    """One byte changed, size kept (an edit, a flipped bit): the checkpoint's hash record refuses
    it with one line naming the file, and the resume takes the previous checkpoint."""
    _run(tmp_path, tokenizer, 2)
    run = tmp_path / "run"
    newest = ckpt.latest_checkpoint(run)
    path = newest / victim
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert ckpt.is_complete(newest)                  # sizes alone cannot tell
    assert ckpt.problem_with(newest) == f"{victim} is not the file it was written as (SHA-256 differs)"
    point, _ = ckpt.resume_point(run)
    assert point.name == "step_000001"


def test_a_checkpoint_without_hashes_is_refused(tmp_path, tokenizer):
    _run(tmp_path, tokenizer, 1)
    newest = ckpt.latest_checkpoint(tmp_path / "run")
    record = json.loads((newest / "COMPLETE").read_text())
    del record["sha256"]
    (newest / "COMPLETE").write_text(json.dumps(record))
    with pytest.raises(ckpt.CheckpointError, match="sealed without file hashes"):
        ckpt.resume_point(tmp_path / "run")
    with pytest.raises(ckpt.CheckpointError, match="has a config that verifies"):
        ckpt.checkpoint_config(tmp_path / "run")


def test_the_minimum_torch_is_the_first_whose_weights_only_holds():
    """weights_only=True could be bypassed before torch 2.6 (CVE-2025-32434)."""
    import tomllib
    deps = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert "torch>=2.6" in deps["project"]["dependencies"]
