"""Seconds per GRPO step, split by phase, on a fixed workload; optionally TRL's GRPOTrainer beside it.

Workload (issue "RL training engine"): GRPO, 8 prompts x 4 samples, at most 32 new tokens, beta 0.04
(so a reference model runs), 2-digit addition, SmolLM2-135M-Instruct in float32, 2 threads.

    .venv/bin/python benchmarks/step_time.py                 # posttrain only
    .venv/bin/python benchmarks/step_time.py --trl           # and TRL 1.16 in .venv-trl, side by side

The TRL run uses its own virtual environment (created on first use: torch 2.13.0 CPU + trl 1.16.0),
so TRL's dependencies never touch posttrain's. Both runs are separate processes with the same glibc
malloc settings, one after the other, and print the median over the measured steps (the first step
is warm-up and is not counted). A benchmark, not a test: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# glibc malloc: keep freed memory instead of returning it to the OS on every large temporary;
# removes page-fault storms (20-35% of TRL's step time here). Applied to both runs.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "100000000000",
              "MALLOC_TOP_PAD_": "1073741824"}
WORKLOAD = dict(prompts=8, group=4, max_new_tokens=32, beta=0.04, lr=1e-5, threads=2)


def run_posttrain(steps: int, autocast: str = "none", attention: str = "auto") -> dict:
    import torch

    from posttrain.config.options import load_config
    from posttrain.rl.loop import train

    torch.set_num_threads(WORKLOAD["threads"])
    w = WORKLOAD
    run_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"posttrain-bench-{os.getpid()}"
    cfg = load_config(None, [
        "--preset", "grpo", "--algorithm.kl_coef", str(w["beta"]), "--optim.lr", str(w["lr"]),
        "--rollout.prompts_per_step", str(w["prompts"]), "--rollout.group_size", str(w["group"]),
        "--rollout.max_new_tokens", str(w["max_new_tokens"]), "--steps", str(steps + 1),
        "--data.eval_size", "0", "--threads", str(w["threads"]), "--run_dir", str(run_dir),
        "--tensorboard", "false", "--data.system_prompt", "null", "--model.autocast", autocast,
        "--model.attention", attention])
    train(cfg, show_progress=False)
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")][1:]   # skip warm-up
    med = lambda k: statistics.median(r.get(k, 0.0) for r in rows)  # noqa: E731
    tokens = statistics.median(r["rollout/length_mean"] * w["prompts"] * w["group"] for r in rows)
    return {"step_s": med("perf/step_s"), "generate_s": med("perf/generate_s"),
            "reference_s": med("perf/reference_s"), "update_s": med("perf/update_s"),
            "reward_s": med("perf/reward_s"), "gen_tokens_per_step": tokens,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


TRL_SCRIPT = textwrap.dedent('''
    import json, resource, sys, time, statistics
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    model_dir, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    w = json.loads(sys.argv[4])
    torch.set_num_threads(w["threads"])
    sys.path.insert(0, sys.argv[5])
    from posttrain.data.tasks import addition_task
    task = addition_task(2)
    probs = [task.train_problem(0, i) for i in range(w["prompts"] * (steps + 2))]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer}
                            for p in probs])
    from math_verify import parse, verify
    def reward(completions, answer, **kw):
        return [float(verify(parse(a), parse(c[0]["content"]))) for c, a in zip(completions, answer)]
    times = []
    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw): self.t = time.perf_counter()
        def on_step_end(self, args, state, control, **kw): times.append(time.perf_counter() - self.t)
    cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=w["prompts"] * w["group"],
                     num_generations=w["group"], max_completion_length=w["max_new_tokens"],
                     beta=w["beta"], learning_rate=w["lr"], temperature=1.0, max_steps=steps + 1,
                     logging_steps=1, report_to=[], use_cpu=True, bf16=False, save_strategy="no",
                     lr_scheduler_type="constant", seed=0)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=AutoTokenizer.from_pretrained(model_dir),
                          callbacks=[Clock()])
    trainer.train()
    print("RESULT", json.dumps({"step_s": statistics.median(times[1:]),
          "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
''')


# What the TRL side imports: TRL itself, and from posttrain (put on sys.path, not installed) its
# task and verifier, whose package imports reach pebble. An existing venv missing one gets it.
TRL_VENV_PACKAGES = {"trl": "trl==1.16.0", "math_verify": "math-verify", "gguf": "gguf",
                     "accelerate": "accelerate", "pebble": "pebble"}


def ensure_trl_venv(path: Path) -> Path:
    py = path / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([*pip, "torch==2.13.0"], check=True)
    missing = [spec for module, spec in TRL_VENV_PACKAGES.items()
               if subprocess.run([str(py), "-c", f"import {module}"], capture_output=True).returncode]
    if missing:
        subprocess.run([*pip, *missing], check=True)
    return py


def run_trl(steps: int, model_dir: Path, venv: Path) -> dict:
    py = ensure_trl_venv(venv)
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"trl-bench-{os.getpid()}"
    proc = subprocess.run([str(py), "-c", TRL_SCRIPT, str(model_dir), str(steps), str(out),
                           json.dumps(WORKLOAD), str(ROOT)], capture_output=True, text=True,
                          env={**os.environ, **MALLOC_ENV})
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"TRL run failed:\n{proc.stderr[-3000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4, help="measured steps (plus one warm-up)")
    ap.add_argument("--trl", action="store_true", help="also run TRL's GRPOTrainer")
    ap.add_argument("--trl-venv", type=Path, default=ROOT / ".venv-trl")
    ap.add_argument("--autocast", default="none", choices=["none", "bfloat16"],
                    help="posttrain's model.autocast (TRL always runs float32 here)")
    ap.add_argument("--attention", default="auto", choices=["auto", "sdpa", "eager"],
                    help="posttrain's model.attention (the default recipe's: eager)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT", json.dumps(run_posttrain(args.steps, args.autocast, args.attention)))
        return
    from posttrain.model.loading import prepare_embedded
    model_dir = prepare_embedded()
    print(f"workload: {WORKLOAD}, model {model_dir}", flush=True)
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps),
                           "--autocast", args.autocast, "--attention", args.attention],
                          capture_output=True, text=True, env={**os.environ, **MALLOC_ENV})
    ours = next((json.loads(l[7:]) for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if ours is None:
        raise RuntimeError(proc.stderr[-3000:])
    print(f"posttrain, autocast={args.autocast}, attention={args.attention} "
          f"({time.time() - t0:.0f} s wall):")
    for k, v in ours.items():
        print(f"  {k:22s} {v:8.2f}")
    gen_tps = ours["gen_tokens_per_step"] / ours["generate_s"]
    print(f"  {'generated tokens/s':22s} {gen_tps:8.1f}")
    if args.trl:
        theirs = run_trl(args.steps, model_dir, args.trl_venv)
        print("TRL 1.16 GRPOTrainer:")
        for k, v in theirs.items():
            print(f"  {k:22s} {v:8.2f}")
        print(f"side by side: posttrain {ours['step_s']:.1f} s/step vs TRL {theirs['step_s']:.1f} "
              f"s/step = {ours['step_s'] / theirs['step_s']:.2f}x TRL's time; peak memory "
              f"{ours['peak_rss_gb']:.1f} vs {theirs['peak_rss_gb']:.1f} GB")


if __name__ == "__main__":
    main()
