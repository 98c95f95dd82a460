"""Ctrl-C with vLLM in process: a SIGINT sent to the trainer's whole process group (what a
terminal sends; a scheduler's SIGTERM to the group is the same) must not reach the engine's
processes. The step in flight finishes on the engine, a checkpoint and `stopped_by` are written,
nothing is left in shared memory, and `--resume` ends on the weights an uninterrupted run ends
on; synchronous and sampling ahead (K = 1). The last test checks the mechanism alone, in a
second, without an engine; that the engine still goes when the trainer is killed outright, with
one: tests/test_async_vllm.py."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# (imports vLLM: a broken install fails; no CPU build for this platform: skipped)
from tests.test_vllm_cpu import tiny  # noqa: F401  (tiny: a fixture)

ROOT = Path(__file__).resolve().parent.parent
STEPS = 4


def command(model: Path, run_dir: Path, K: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "posttrain.cli", "train", "--no-progress",
            "--model.path", str(model), "--run_dir", str(run_dir), "--seed", "0",
            "--reward.verifier", "none", "--reward.functions", "tests.slow_rewards:slow_first_letter",
            "--rollout.max_new_tokens", "4", "--rollout.prompts_per_step", "2",
            "--rollout.group_size", "2", "--data.system_prompt", "null", "--data.eval_size", "0",
            "--rollout.backend", "vllm", "--rollout.max_staleness", str(K),
            "--steps", str(STEPS), "--checkpoint.every_steps", "0", "--optim.lr", "1e-2",
            "--threads", "1", "--tensorboard", "false", "--max_minutes", "null", *extra]


def steps_logged(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return 0
    return sum(1 for line in lines if line.strip() and "perf/step_s" in json.loads(line))


def shm_entries() -> set[str]:
    """What vLLM's message queues and posttrain's weight pushes leave in /dev/shm."""
    try:
        return {e for e in os.listdir("/dev/shm") if e.startswith(("psm_", "posttrain-weights-"))}
    except OSError:
        return set()


def start(cmd: list[str]) -> subprocess.Popen:
    """The run in a process group of its own (as a shell starts a job)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return err


def run(cmd: list[str]) -> None:
    proc = start(cmd)
    err = finish(proc)
    assert proc.returncode == 0, err[-3000:]


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


@pytest.mark.slow   # (~2-3 min each: three runs, each starting a vLLM engine on the CPU)
@pytest.mark.parametrize("K", [0, 1])
def test_ctrl_c_to_the_group_saves_the_step_and_resumes_to_the_same_weights(tiny, tmp_path, K):
    model = tiny[1]
    whole, stopped = tmp_path / "whole", tmp_path / "stopped"
    run(command(model, whole, K))
    shm_before = shm_entries()
    proc = start(command(model, stopped, K))
    deadline = time.monotonic() + 600
    while proc.poll() is None and steps_logged(stopped) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert proc.poll() is None, finish(proc)[-3000:]
    os.killpg(proc.pid, signal.SIGINT)          # the terminal's Ctrl-C: the whole group
    err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads((stopped / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGINT", summary
    assert 2 <= summary["steps"] < STEPS, summary
    assert (stopped / "checkpoints" / f"step_{summary['steps']:06d}").is_dir()
    assert shm_entries() <= shm_before, "shared memory left behind"
    assert "leaked shared_memory" not in err, err[-3000:]   # (what the resource tracker freed)
    run(command(model, stopped, K, "--resume", str(stopped)))
    want, got = final_weights(whole), final_weights(stopped)
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[k], got[k]) for k in want), "resumed weights differ"


# the engine core's side, without an engine: a "trainer" that starts a child, which detaches as
# posttrain's executor makes vLLM's engine core detach (rollout/vllm_worker.py, loaded from its file:
# no vLLM import, a second's start)
CHILD = """import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("w", sys.argv[1])
w = importlib.util.module_from_spec(spec)
spec.loader.exec_module(w)
w.detach_from_trainer()
print(os.getpid(), os.getsid(0), flush=True)
time.sleep(120)
"""
TRAINER = """import os, signal, subprocess, sys, time
env = {**os.environ, "POSTTRAIN_VLLM_TRAINER_PID": str(os.getpid())}
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env)
signal.signal(signal.SIGINT, signal.SIG_IGN)     # (a trainer finishing its step)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_the_engine_core_leaves_the_group_and_goes_with_its_trainer():
    """A Ctrl-C to the trainer's group misses the detached process; SIGKILL to the trainer alone
    and it goes within a second or two."""
    worker = ROOT / "posttrain" / "rollout" / "vllm_worker.py"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, CHILD, str(worker)],
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    pid = None
    try:
        pid, sid = map(int, trainer.stdout.readline().split())
        assert sid == pid != trainer.pid            # a session of its own
        os.killpg(trainer.pid, signal.SIGINT)
        time.sleep(1.0)
        assert alive(pid) and trainer.poll() is None
        trainer.kill()
        trainer.wait()
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(pid)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
        if pid is not None and alive(pid):
            os.kill(pid, signal.SIGKILL)
