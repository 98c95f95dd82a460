"""Asynchronous training on the real engine (vLLM's CPU build) with a tiny random model: K = 1 and
K = 2 train within their bound, evaluations and checkpoints between two batches, the per-token
records carry each response's weight version; and a run killed with SIGKILL and resumed trains on
exactly the prompts an uninterrupted run trains on (in-flight batches are checkpointed), its
engine gone with it."""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from posttrain.rl.loop import train
from tests.test_trainer import toy_config

# (imports vLLM: a broken install fails; no CPU build for this platform: skipped)
from tests.test_vllm_cpu import group_members, tiny, tiny_llama  # noqa: F401  (tiny: a fixture)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tiny_folder(tiny):
    """The tiny Llama of tests/test_vllm_cpu.py, saved as a model folder."""
    return tiny[1]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


# K = 1 on multi-turn episodes (guess the number: the environment answers between turns), K = 2
# with dynamic sampling (refill rounds inside one batch): both run in the engine's thread unchanged
EXTRA = {1: ["--data.task", "guess_number", "--data.difficulty", "4", "--env.max_turns", "3"],
         2: ["--algorithm.dynamic_sampling", "true"]}


# (slow: 50 s each with the engine's start; tests/test_async.py runs the same machinery on a
# scripted engine in the quick suite, and benchmarks/gpu_check_vllm.sh these on a GPU)
@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2])
def test_sampling_ahead_trains_on_the_real_engine_within_its_bound(tiny_folder, tokenizer, tmp_path, K):
    cfg = toy_config(tmp_path, "--model.path", str(tiny_folder), "--rollout.backend", "vllm",
                     "--rollout.max_staleness", str(K), "--steps", "5", "--rollout.group_size", "2",
                     "--rollout.prompts_per_step", "4", "--optim.lr", "1e-2", "--log_tokens", "2",
                     "--data.eval_size", "4", "--eval_every", "2", "--checkpoint.every_steps", "2",
                     *EXTRA[K])
    summary = train(cfg, show_progress=False)
    steps = [r for r in rows(tmp_path / "run") if "async/staleness" in r]
    if K == 1:
        assert max(r["env/turns"] for r in steps) > 1       # the environment answered
    else:
        assert all(r["rollout/dynamic_rounds"] >= 1 for r in steps)
    staleness = [r["async/staleness"] for r in steps]
    assert len(steps) == 5 and max(staleness) <= K and max(staleness) >= 1, staleness
    assert all(r["perf/trainer_wait_s"] >= 0 and "perf/engine_idle_s" in r for r in steps)
    assert summary["eval_after"]["eval/accuracy"] >= 0
    start = tiny_llama(tokenizer)                   # (the folder's weights)
    from safetensors.torch import load_file
    final = load_file(str(tmp_path / "run" / "final_model" / "model.safetensors"))
    assert any(not torch.equal(final[k], v) for k, v in start.state_dict().items() if k in final)
    import pyarrow.parquet as pq
    records = [r for f in sorted((tmp_path / "run" / "tokens").glob("step_*.parquet"))
               for r in pq.read_table(f).to_pylist()]
    assert records
    for rec in records:
        assert rec["staleness"] == steps[rec["step"] - 1]["async/staleness"]
        assert rec["weight_version"] == steps[rec["step"] - 1]["async/weight_version"]
    in_flight = sorted((tmp_path / "run" / "checkpoints").glob("step_*/in_flight/count.json"))
    assert in_flight, "checkpoints carry the batches sampled ahead"


def command(model: Path, run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "train", "--no-progress",
            "--model.path", str(model), "--run_dir", str(run_dir), "--seed", "0",
            "--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e",
            "--rollout.max_new_tokens", "4", "--rollout.prompts_per_step", "4",
            "--rollout.group_size", "2", "--data.system_prompt", "null", "--data.eval_size", "0",
            "--rollout.backend", "vllm", "--rollout.max_staleness", "1", "--log_samples", "8",
            "--steps", "6", "--checkpoint.every_steps", "1", "--optim.lr", "1e-2", "--threads", "1",
            "--tensorboard", "false", "--max_minutes", "null", "--resume", "auto"]


def trained_prompts(run_dir: Path) -> dict[int, list[str]]:
    """Each step's prompts as the trainer logged them (a resumed step: its last record)."""
    out = {}
    for line in open(run_dir / "samples.jsonl"):
        rec = json.loads(line)
        out[rec["step"]] = [s["prompt"] for s in rec["samples"]]
    return out


def engine_pids(trainer: int) -> list[int]:
    """The trainer's child processes running vLLM's engine core (its title: VLLM::EngineCore)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            cmdline = open(f"/proc/{entry}/cmdline", "rb").read()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == trainer and cmdline.startswith(b"VLLM::EngineCore"):
            found.append(int(entry))
    return found


def run(cmd: list[str], kill_when=None) -> int:
    """Run `cmd`; with `kill_when`, SIGKILL the trainer alone once it holds (as the OOM killer
    would): its engine processes, in a session of their own, must notice and go."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    with tempfile.TemporaryFile("w+") as err:   # (not a pipe: an engine left behind holds it)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                text=True, start_new_session=True)
        groups = []
        try:
            while kill_when is not None and proc.poll() is None and not kill_when():
                time.sleep(0.05)
            if kill_when is not None and proc.poll() is None:
                groups = [os.getpgid(pid) for pid in engine_pids(proc.pid)]
                os.kill(proc.pid, signal.SIGKILL)
                assert groups, "no engine process found to follow"
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (left := [p for p in group_members(groups) if p[1] != "Z"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, _ in left:                      # (not to leave them running past the test)
            os.kill(pid, signal.SIGKILL)
        assert left == [], f"the engine outlived its trainer: {left}"
        err.seek(0)
        if proc.returncode not in (0, -signal.SIGKILL):
            raise RuntimeError(f"run failed ({proc.returncode}):\n{err.read()[-3000:]}")
    return proc.returncode


@pytest.mark.slow   # (~2.5 min: three runs, each starting a vLLM engine)
def test_a_killed_async_run_resumes_on_exactly_the_prompts_of_an_uninterrupted_one(tiny_folder,
                                                                                   tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    assert run(command(tiny_folder, whole)) == 0
    ckpts = killed / "checkpoints"
    # killed once its third checkpoint is written: batches sampled ahead are in flight
    assert run(command(tiny_folder, killed),
               kill_when=lambda: (ckpts / "step_000003").is_dir()) == -signal.SIGKILL
    assert not (killed / "final_model").exists()
    assert run(command(tiny_folder, killed)) == 0
    want, got = trained_prompts(whole), trained_prompts(killed)
    assert sorted(want) == sorted(got) == list(range(1, 7))
    assert got == want
