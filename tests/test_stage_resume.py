"""SFT, DPO and reward-model runs share one lifecycle: config.json at the start, a checkpoint every
N optimizer steps, `--resume` to the same final weights, summary.json at the end."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from posttrain.stages.common import OfflineJob, write_jsonl
from posttrain.stages.preference import dpo
from posttrain.stages.reward_model import reward_model
from posttrain.stages.sft import sft

from tests.conftest import make_tiny_model, make_tiny_reward_model, stage_config

CASES = {
    # name: (stage function, StageConfig fields, model factory)
    "sft": (sft, dict(synthetic="addition"), make_tiny_model),
    # LoRA: the checkpoints hold the adapters; the base is the model given again on resume
    "sft-lora": (sft, dict(synthetic="addition", lora_rank=4), make_tiny_model),
    "dpo": (dpo, dict(data="PAIRS", beta=0.1), make_tiny_model),   # (no greedy answers)
    "reward-model": (reward_model, dict(synthetic="addition"), make_tiny_reward_model),
    "reward-model-log-ratio": (reward_model, dict(synthetic="addition", reward_form="log_ratio"),
                               make_tiny_model),
}


def _config(run_dir, **fields):
    # 24 pairs in batches of 8, two epochs: 6 optimizer steps, a checkpoint every 2
    return stage_config(n_pairs=24, eval_size=2, lr=3e-3, batch_size=8, epochs=2, checkpoint_every=2,
                       schedule="cosine", warmup_steps=2, run_dir=str(run_dir),
                       system_prompt="Be brief.", **fields)


def _weights(run_dir) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def _training_rows(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "reward-model-log-ratio"
                                  else n for n in CASES])   # (log-ratio: in the full suite)
def test_a_stage_killed_between_checkpoints_resumes_to_the_same_final_weights(tmp_path, tokenizer,
                                                                              monkeypatch, name):
    stage, fields, make = CASES[name]
    if fields.get("data") == "PAIRS":
        write_jsonl(tmp_path / "pairs.jsonl", [
            {"prompt": f"Question {i}", "chosen": "Yes, gladly.", "rejected": "No way."} for i in range(26)])
        fields = {**fields, "data": str(tmp_path / "pairs.jsonl")}
    whole = tmp_path / "whole"
    stage(_config(whole, **fields), model=make(tokenizer), tokenizer=tokenizer, show_progress=False)

    killed = tmp_path / "killed"
    calls, real_step = [0], OfflineJob.optimizer_step

    def dies_at_step_5(st, loss):     # after the checkpoint of step 4, before the end
        calls[0] += 1
        if calls[0] == 5:
            raise KeyboardInterrupt("killed")
        return real_step(st, loss)
    monkeypatch.setattr(OfflineJob, "optimizer_step", dies_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        stage(_config(killed, **fields), model=make(tokenizer), tokenizer=tokenizer, show_progress=False)
    monkeypatch.setattr(OfflineJob, "optimizer_step", real_step)
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    assert not (killed / "final_model").exists() and not (killed / "summary.json").exists()

    base = dict(model=make(tokenizer), tokenizer=tokenizer) if fields.get("lora_rank") else {}
    summary = stage(_config(killed, **fields), show_progress=False, resume=killed, **base)
    a, b = _weights(whole), _weights(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # every step logged once, with the values of the run that never stopped
    assert _training_rows(killed) == _training_rows(whole)
    assert json.loads((killed / "summary.json").read_text())["steps"] == summary["steps"] == 6
    assert json.loads((killed / "config.json").read_text())["checkpoint"]["every_steps"] == 2


def test_resume_needs_a_checkpoint_and_is_refused_in_one_line(tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        sft(_config(tmp_path / "run", synthetic="addition"), resume=tmp_path / "run")
    proc = subprocess.run([sys.executable, "-m", "posttrain.cli", "dpo", "--resume", str(tmp_path / "none")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "config.json not found" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
