"""Crash harness: a run killed with SIGKILL at random moments, resumed each time, must end with the
same final weights, optimizer state and metrics as an uninterrupted run, bit for bit.

    .venv/bin/python benchmarks/crash_resume.py --kills 20          # the README's figure
    .venv/bin/python benchmarks/crash_resume.py --kills 3 --seed 1  # the test suite's version
    .venv/bin/python benchmarks/crash_resume.py --kills 8 --truncate   # and a damaged newest checkpoint
    .venv/bin/python benchmarks/crash_resume.py --kills 6 --steps 12 --command sft   # dpo, reward-model

A tiny random model (the real SmolLM2 tokenizer) trains with `posttrain train` in a subprocess:
GRPO on a toy reward, 24 steps, a checkpoint every step, a held-out evaluation every 3 steps, one
thread (so floating-point sums are reproducible). The uninterrupted run is timed first; then a
second run is started, killed at a uniformly random moment of that span (the moment lands in
process start-up, generation, the update, an evaluation or a checkpoint being written), and
restarted with `--resume auto` (which continues from the latest complete checkpoint, or starts
anew when none was written yet), until it finishes. Compared at the end: every tensor of the final
model, every tensor of the last checkpoint's optimizer state, and every metrics row without its
timings (perf/*). `--command sft|dpo|reward-model` does the same to an offline stage (a
checkpoint every step, one epoch of synthetic addition rows). Every 4th kill waits for a checkpoint write to begin (a new `.step_*.tmp`
folder) and strikes at once; the others fall at random moments. Kills that left a new
half-written checkpoint folder are counted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def make_model_folder(out: Path) -> Path:
    """A tiny random Llama with the embedded SmolLM2 tokenizer, saved as a model folder."""
    from posttrain.model.loading import load_tokenizer, prepare_embedded
    from tests.conftest import make_tiny_model
    folder = out / "tiny_model"
    if not (folder / "config.json").is_file():
        tok = load_tokenizer(prepare_embedded(out / "cache"))
        model = make_tiny_model(tok)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    return folder


COMMANDS = ("train", "sft", "dpo", "reward-model")


def command(model: Path, run_dir: Path, steps: int, kind: str = "train") -> list[str]:
    """`kind`'s command line: `steps` optimizer steps, a checkpoint after each, one thread,
    continuing the run in `run_dir` when it has a checkpoint (`--resume auto`)."""
    if kind != "train":   # an offline stage: one epoch of `steps` batches of 4 synthetic rows
        return [sys.executable, "-m", "posttrain.cli", kind, "--no-progress",
                "--model.path", str(model), "--run_dir", str(run_dir), "--seed", "0",
                "--data.synthetic", "addition", "--data.n_pairs", str(4 * steps),
                "--data.eval_size", "4", "--batch_size", "4", "--optim.lr", "1e-3",
                "--checkpoint.every_steps", "1", "--threads", "1", "--resume", "auto"]
    return [sys.executable, "-m", "posttrain.cli", "train", "--no-progress",
            "--model.path", str(model), "--run_dir", str(run_dir), "--seed", "0",
            "--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e",
            "--rollout.max_new_tokens", "4", "--rollout.prompts_per_step", "4",
            "--rollout.group_size", "2", "--data.system_prompt", "null", "--data.eval_size", "8",
            "--steps", str(steps), "--eval_every", "3", "--checkpoint.every_steps", "1",
            "--optim.lr", "1e-2", "--optim.minibatches", "2", "--threads", "1",
            "--tensorboard", "false", "--max_minutes", "null", "--resume", "auto"]


def _run(cmd: list[str], kill_after: float | None, kill_in_write: Path | None = None
         ) -> tuple[int, float]:
    """Run `cmd`; SIGKILL it after `kill_after` seconds, or (`kill_in_write`, a checkpoints
    folder) the moment a new half-written checkpoint folder appears in it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    seen = set(kill_in_write.glob(".step_*.tmp")) if kill_in_write is not None else set()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        if kill_in_write is not None:
            while proc.poll() is None and not set(kill_in_write.glob(".step_*.tmp")) - seen:
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
        elif kill_after is not None:
            try:
                proc.wait(timeout=kill_after)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGKILL)
        _, err = proc.communicate()
    finally:
        proc.kill()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"run failed ({proc.returncode}):\n{err[-3000:]}")
    return proc.returncode, time.perf_counter() - t0


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [{k: v for k, v in r.items() if not k.startswith("perf/") and k != "eval/seconds"}
            for r in rows]


def compare(a: Path, b: Path) -> dict[str, int]:
    """Differences between two finished runs: weight tensors, optimizer tensors, metrics rows."""
    import torch
    from safetensors.torch import load_file
    from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
    wa, wb = (load_file(str(p / "final_model" / "model.safetensors")) for p in (a, b))
    weights = sum(not torch.equal(wa[k], wb[k]) for k in wa) + len(set(wa) ^ set(wb))
    oa, ob = (load_trainer_state(latest_checkpoint(p))["optimizer"]["state"] for p in (a, b))
    optim = 0
    for name in oa:
        for k, v in oa[name].items():
            other = ob.get(name, {}).get(k)
            same = torch.equal(v, other) if isinstance(v, torch.Tensor) else v == other
            optim += not same
    ra, rb = _rows(a), _rows(b)
    rows = sum(x != y for x, y in zip(ra, rb)) + abs(len(ra) - len(rb))
    return {"weights": weights, "optimizer": optim, "metrics_rows": rows,
            "n_weights": len(wa), "n_optimizer": sum(len(v) for v in oa.values()), "n_rows": len(ra)}


def _steps_done(run_dir: Path) -> int:
    from posttrain.run.checkpoint import latest_checkpoint
    ckpt = latest_checkpoint(run_dir)
    return int(ckpt.name.split("_")[1]) if ckpt is not None else 0


def truncate_newest(run_dir: Path) -> int:
    """Cut the largest file of the newest complete checkpoint to half its size (a disk that lost
    the end of a file), when an older complete one exists to fall back to. Returns 1 if it did."""
    from posttrain.run.checkpoint import is_complete, step_folders
    complete = [p for p in step_folders(run_dir) if is_complete(p)]
    if len(complete) < 2:
        return 0
    biggest = max((f for f in complete[-1].rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    with open(biggest, "r+b") as f:
        f.truncate(biggest.stat().st_size // 2)
    return 1


def crash_and_resume(out: Path, kills: int, seed: int = 0, steps: int = 24,
                     truncate: bool = False, kind: str = "train") -> dict:
    """Kill the run `kills` times (fewer if it finishes first), each at a moment drawn uniformly
    from the time it still needs (start-up included), every 4th inside a checkpoint write,
    resuming after each; with `truncate`, after each kill the newest checkpoint also loses the
    second half of its largest file, and the resume must fall back to the one before it."""
    out.mkdir(parents=True, exist_ok=True)
    model = make_model_folder(out)
    whole, cut = out / f"{kind}-whole-{steps}", out / f"{kind}-cut-{steps}-{kills}-{seed}"
    if not (whole / "span.txt").is_file():
        _, span = _run(command(model, whole, steps, kind), None)
        (whole / "span.txt").write_text(str(span))
    span = float((whole / "span.txt").read_text())
    startup = 6.0   # about what importing torch and transformers and loading take here
    rng = random.Random(seed)
    killed = half_written = truncated = 0
    while True:
        left = startup + (span - startup) * (1 - _steps_done(cut) / steps)
        at = rng.uniform(0.5, left) if killed < kills else None
        before = set((cut / "checkpoints").glob(".step_*.tmp"))
        in_write = killed < kills and killed % 4 == 3   # every 4th kill aims at a checkpoint write
        code, _ = _run(command(model, cut, steps, kind), at, cut / "checkpoints" if in_write else None)
        if code == 0:
            break
        killed += 1
        half_written += bool(set((cut / "checkpoints").glob(".step_*.tmp")) - before)
        truncated += truncate_newest(cut) if truncate else 0
    return {"command": kind, "kills": killed, "kills_in_checkpoint_writing": half_written,
            "newest_checkpoint_truncated": truncated, "steps": steps,
            "span_s": round(span, 1), **compare(whole, cut)}


def kill_truncate_resume(out: Path, steps: int = 6, at_checkpoint: int = 3) -> dict:
    """Deterministic version of the damaged-disk case: SIGKILL the run as soon as its checkpoint
    of step `at_checkpoint` is complete, truncate a file of that checkpoint, resume (it must
    fall back to the checkpoint before) and compare with the uninterrupted run."""
    from posttrain.run.checkpoint import latest_checkpoint
    out.mkdir(parents=True, exist_ok=True)
    model = make_model_folder(out)
    whole, cut = out / f"train-whole-{steps}", out / f"train-cut-{steps}-truncate"
    if not (whole / "span.txt").is_file():
        _, span = _run(command(model, whole, steps), None)
        (whole / "span.txt").write_text(str(span))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(command(model, cut, steps), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and _steps_done(cut) < at_checkpoint:
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    newest = latest_checkpoint(cut)
    truncated = truncate_newest(cut)
    fell_back_to = latest_checkpoint(cut)
    code, _ = _run(command(model, cut, steps), None)
    return {"killed_after": newest.name, "newest_checkpoint_truncated": truncated,
            "fell_back_to": fell_back_to.name, "exit": code, **compare(whole, cut)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "crash_resume")
    ap.add_argument("--truncate", action="store_true",
                    help="after each kill, truncate a file of the newest checkpoint")
    ap.add_argument("--command", choices=COMMANDS, default="train",
                    help="the command killed and resumed (the stages: `--steps` batches of 4 rows)")
    args = ap.parse_args()
    result = crash_and_resume(args.out, args.kills, args.seed, args.steps, args.truncate,
                              args.command)
    print(json.dumps(result, indent=2))
    ok = result["weights"] == result["optimizer"] == result["metrics_rows"] == 0
    print("identical to the uninterrupted run" if ok else "DIFFERENT from the uninterrupted run")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
