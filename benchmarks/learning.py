"""Learning per step and per minute: posttrain and TRL on the same recipe, several seeds each.

    .venv/bin/python benchmarks/learning.py --seeds 0 1 2 --steps 20                 # both sides
    .venv/bin/python benchmarks/learning.py --sides posttrain --label lr1e-5 -- --optim.lr 1e-5
    .venv/bin/python benchmarks/learning.py --report OUT_A OUT_B ...                 # tables + plot only
    .venv/bin/python benchmarks/learning.py --presets reinforce rloo grpo dapo dr_grpo ppo \
        --steps 90 --max_minutes 10 --eval_every 10                                # the preset table

The recipe is the default job's (posttrain/recipes/addition_grpo.yaml): SmolLM2-135M-Instruct,
2-digit addition under the chat template's default system prompt, 16 prompts x 4 answers a step,
lr 2e-5, beta 0, at most 24 new tokens, temperature 1, answers scored on the text before the
first blank line by posttrain's verifier (posttrain's side: the recipe's token-mean loss, AdamW beta2
0.999, eager attention, cosine decay over --steps; TRL's side: a constant lr, so pass
`-- --optim.schedule constant` to compare per step). Anything after `--` is passed to `posttrain train` (the
TRL side always runs the fixed recipe, with TRL 1.16's defaults otherwise: its 'dapo' token-mean
loss, AdamW betas (0.9, 0.999), float32).

Each side runs one seed at a time (never two heavy jobs at once: 2 cores). Every
`--eval_every` steps the policy's held-out greedy accuracy on the same 200 problems is measured
(posttrain: its own evaluator; TRL: benchmarks/heldout.py, plain transformers `generate`); the
final models of both sides are scored again by benchmarks/heldout.py, on 2-digit and on 3-digit
addition (never trained). Evaluation time is excluded from the training minutes.

Prints, for each side: a summary row (held-out accuracy at 2 and 5 training minutes and after
training, 3-digit transfer, steps, s/step, the run's peak resident memory) and each seed's own
figures (to pool seeds run on different days), training reward at
every step (mean and spread over seeds), its mean over all steps, held-out accuracy at equal
steps and at equal training minutes, entropy and the share of all-equal groups per step; writes
OUT/learning.png (each run's figures: OUT/posttrain-s<seed>/bench.json, OUT/trl-s<seed>.json).
Runs already finished in OUT are reused, so an interrupted benchmark continues where it stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this tree's package first: the provenance of the tree the runs use, not of the one an editable
# install points to (a git worktree beside it)
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from step_time import MALLOC_ENV, ensure_trl_venv  # noqa: E402
from posttrain.run.provenance import provenance as record_provenance  # noqa: E402

FINAL_HELDOUT = True   # --no-final: skip benchmarks/heldout.py on the final models (cut for time)
RECIPE = dict(prompts=16, group=4, lr=2e-5, max_new_tokens=24, threads=2)

# `--presets`: each algorithm on the default job's task, sampling and optimizer (lr, cosine decay,
# AdamW beta2, bf16). The default recipe overrides GRPO's aggregation (token-mean), so each preset
# gets its own back; PPO takes its critic from its recipe.
PRESET_ARGS = {
    "reinforce": ["--preset", "reinforce", "--algorithm.aggregation", "seq_mean_token_sum"],
    "rloo": ["--preset", "rloo", "--algorithm.aggregation", "seq_mean_token_mean"],
    "grpo": [],                                   # the default job itself
    "dapo": ["--preset", "dapo"],
    "dr_grpo": ["--preset", "dr_grpo", "--algorithm.aggregation", "seq_mean_token_sum_norm"],
    "ppo": ["--config", "posttrain/recipes/addition_ppo.yaml", "--optim.schedule", "cosine",
            "--optim.beta2", "0.999", "--model.attention", "eager"],
    # the field's current objectives (docs/algorithms.md §11) differ from the policy gradient only
    # once the policy has moved from pi_old: 4 minibatches per batch (4 optimizer steps)
    "gspo": ["--preset", "gspo", "--optim.minibatches", "4", "--algorithm.aggregation",
             "seq_mean_token_mean"],
    "cispo": ["--preset", "cispo", "--optim.minibatches", "4"],
    "sapo": ["--preset", "sapo", "--optim.minibatches", "4"],
    "gmpo": ["--preset", "gmpo", "--optim.minibatches", "4", "--algorithm.aggregation",
             "seq_mean_token_mean"],
}


def preset_args(name: str) -> list[str]:
    """The overrides of preset `name`'s row: its PRESET_ARGS entry, or else `--preset name` with
    the preset's own aggregation back (so a new preset needs no line here)."""
    if name in PRESET_ARGS:
        return PRESET_ARGS[name]
    from posttrain.config.presets import PRESETS
    return ["--preset", name, "--algorithm.aggregation", PRESETS[name].aggregation]


def table_presets() -> list[str]:
    """Every preset that runs on the default task alone (OPD needs a teacher: docs/distillation.md)."""
    from posttrain.config.presets import PRESETS
    return [name for name in PRESETS if name != "opd"]


# ---------------------------------------------------------------------------------------------
# posttrain
# ---------------------------------------------------------------------------------------------

def run_posttrain(out: Path, seed: int, steps: int, eval_every: int, overrides: list[str],
                  max_minutes: float | None) -> dict:
    run = out / f"posttrain-s{seed}"
    result = run / "bench.json"
    if result.is_file():
        return json.loads(result.read_text())
    env = {**os.environ, **MALLOC_ENV, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "--no-progress",
           "--run_dir", str(run), "--seed", str(seed), "--steps", str(steps),
           "--max_minutes", "null" if max_minutes is None else str(max_minutes),
           "--eval_every", str(eval_every), "--threads", str(RECIPE["threads"]),
           "--tensorboard", "false", *overrides]
    t0 = time.time()
    with open(out / f"posttrain-s{seed}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        tree = TreeMemory(proc.pid)                  # with its children (vLLM's engine processes)
        _, status, usage = os.wait4(proc.pid, 0)     # this run's own peak RSS (KiB on Linux)
        tree.stop()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"posttrain run failed (exit {proc.returncode}); see "
                           f"{out / f'posttrain-s{seed}.log'}")
    rows = [json.loads(line) for line in open(run / "metrics.jsonl") if line.strip()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    final = heldout_of(run / "final_model") if FINAL_HELDOUT else None
    res = {
        "steps": [r["step"] for r in train],
        "reward": [r["reward/mean"] for r in train],
        "entropy": [r.get("policy/entropy") for r in train],
        "equal_groups": [r.get("rollout/equal_groups_frac") for r in train],
        "step_s": [r["perf/step_s"] for r in train],
        "eval_steps": [r["step"] for r in evals],
        "eval_minutes": [r["perf/train_minutes"] for r in evals],
        "eval_accuracy": [r["eval/accuracy"] for r in evals],
        "final": final, "wall_s": time.time() - t0, "peak_rss_gb": usage.ru_maxrss / 2**20,
        "peak_tree_gb": tree.peak_mb / 1024,
        **{key: [r.get(f"perf/{key}") for r in train] for key in
           ("generate_s", "update_s", "weight_push_s", "generated_tokens_per_s",
            "trainer_wait_s", "engine_idle_s")},
        "logp_mismatch": [r.get("rollout/logp_mismatch") for r in train],
        "staleness": [r.get("async/staleness") for r in train],
        "dropped_batches": [r.get("async/dropped_batches") for r in train],
        "provenance": provenance(cmd),
    }
    result.write_text(json.dumps(res))
    return res


class TreeMemory:
    """The peak memory of a process and all its descendants together (PSS, sampled every
    second): a vLLM engine runs in child processes that the run's own peak RSS leaves out."""

    def __init__(self, pid: int) -> None:
        import threading
        from posttrain.sandbox.procs import tree_memory_mb
        self.peak_mb, self._stop = 0.0, threading.Event()

        def sample() -> None:
            while not self._stop.wait(1.0):
                self.peak_mb = max(self.peak_mb, tree_memory_mb(pid))
        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def provenance(cmd: list[str]) -> dict:
    """The record's provenance (posttrain/run/provenance.py) for a `posttrain train` command line."""
    return record_provenance(" ".join(["posttrain", *cmd[3:]]))


def heldout_of(model_dir: Path) -> dict:
    """benchmarks/heldout.py on a saved model: 2-digit (the training task) and 3-digit."""
    out = {}
    for digits, n in ((2, 200), (3, 300)):
        proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "heldout.py"), str(model_dir),
                               "--digits", str(digits), "--n", str(n)],
                              capture_output=True, text=True, check=True)
        out[f"{digits}digit"] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


# ---------------------------------------------------------------------------------------------
# TRL
# ---------------------------------------------------------------------------------------------

TRL_SCRIPT = textwrap.dedent('''
    import json, sys, time
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    model_dir, out, w = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    sys.path.insert(0, sys.argv[4])
    import heldout
    from posttrain.data.tasks import Problem, addition_task
    from posttrain.rewards.verifiers import math_correct
    torch.set_num_threads(w["threads"])
    seed, steps, every = w["seed"], w["steps"], w["eval_every"]
    task = addition_task(2)
    task.build_eval(200, 1234)              # the training stream skips the held-out problems
    probs = [task.train_problem(seed, i) for i in range(w["prompts"] * (steps + 2))]
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p.prompt}], "answer": p.answer}
                            for p in probs])
    def reward(completions, answer, **kw):
        return [float(math_correct(c[0]["content"].split("\\n\\n")[0], Problem("", a)))
                for c, a in zip(completions, answer)]
    record = {"steps": [], "reward": [], "entropy": [], "equal_groups": [], "step_s": [],
              "eval_steps": [], "eval_minutes": [], "eval_accuracy": []}
    eval_set = heldout.problems(2, 200)
    class Clock(TrainerCallback):
        train_s = 0.0
        def evaluate(self, model, step):
            acc = heldout.greedy_accuracy(model, tok, eval_set)["accuracy"]
            record["eval_steps"].append(step); record["eval_accuracy"].append(acc)
            record["eval_minutes"].append(self.train_s / 60)
            print("eval", step, acc, flush=True)
        def on_train_begin(self, args, state, control, model=None, **kw):
            self.evaluate(model, 0)
        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
        def on_step_end(self, args, state, control, model=None, **kw):
            dt = time.perf_counter() - self.t
            self.train_s += dt
            record["step_s"].append(dt)
            if state.global_step % every == 0 or state.global_step == steps:
                self.evaluate(model, state.global_step)
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                record["steps"].append(state.global_step); record["reward"].append(logs["reward"])
                record["entropy"].append(logs.get("entropy"))
                record["equal_groups"].append(logs.get("frac_reward_zero_std"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = GRPOConfig(output_dir=out, per_device_train_batch_size=w["prompts"] * w["group"],
                     num_generations=w["group"], max_completion_length=w["max_new_tokens"],
                     beta=0.0, learning_rate=w["lr"], lr_scheduler_type="constant",
                     temperature=1.0, max_steps=steps, logging_steps=1, report_to=[],
                     use_cpu=True, bf16=False, save_strategy="no", seed=seed)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=cfg, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    model = trainer.model
    record["final"] = {"2digit": heldout.greedy_accuracy(model, tok, eval_set),
                       "3digit": heldout.greedy_accuracy(model, tok, heldout.problems(3, 300))}
    import transformers, trl
    record["versions"] = {"trl": trl.__version__, "transformers": transformers.__version__,
                          "torch": torch.__version__}
    print("RESULT", json.dumps(record))
''')


def run_trl(out: Path, seed: int, steps: int, eval_every: int, model_dir: Path, venv: Path) -> dict:
    result = out / f"trl-s{seed}.json"
    if result.is_file():
        return json.loads(result.read_text())
    py = ensure_trl_venv(venv)
    w = {**RECIPE, "seed": seed, "steps": steps, "eval_every": eval_every}
    t0 = time.time()
    with open(out / f"trl-s{seed}.log", "w") as log:
        proc = subprocess.run([str(py), "-c", TRL_SCRIPT, str(model_dir), str(out / f"trl-s{seed}"),
                               json.dumps(w), str(ROOT / "benchmarks")], stdout=subprocess.PIPE,
                              stderr=log, text=True, env={**os.environ, **MALLOC_ENV,
                                                          "HF_HUB_OFFLINE": "1"})
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"TRL run failed; see {out / f'trl-s{seed}.log'}")
    res = json.loads(line[len("RESULT "):])
    res["wall_s"] = time.time() - t0
    # the tree and machine as for posttrain's side; the packages are the TRL venv's own
    res["provenance"] = {**record_provenance(f"benchmarks/learning.py TRL_SCRIPT seed={seed} "
                                             f"steps={steps} eval_every={eval_every}"),
                         "versions": res.pop("versions")}
    result.write_text(json.dumps(res))
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------

def mean_sd(xs: list[float], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """'mean ± sd' over seeds (sample sd), None values left out."""
    xs = [scale * x for x in xs if x is not None]
    if not xs:
        return "n/a"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.{digits}f} ± {sd:.{digits}f}{unit}"


def pct(xs: list[float]) -> str:
    return mean_sd(xs, 100.0, 1, "%")


def at_minutes(run: dict, t: float) -> float | None:
    """Held-out accuracy at t training minutes, linear between evaluations (None past the end)."""
    pts = list(zip(run["eval_minutes"], run["eval_accuracy"]))
    if not pts or t > pts[-1][0] + 1e-9:
        return None
    for (t0, a0), (t1, a1) in zip(pts, pts[1:]):
        if t0 <= t <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (t - t0) / (t1 - t0)
    return pts[0][1]


def summary(sides: dict[str, list[dict]]) -> None:
    """One row per side: held-out at 2 and 5 training minutes and after training, 3-digit
    transfer, steps done, step time and peak memory (mean ± sd over seeds)."""
    print("| side | held-out 2 min | 5 min | after training | training minutes | steps | "
          "3-digit | s/step | peak RSS |")
    print("|---" * 9 + "|")
    for name, runs in sides.items():
        at = {t: [at_minutes(r, t) for r in runs] for t in (2, 5)}
        cells = [pct(v) if all(x is not None for x in v) else "-" for v in at.values()]
        rss = [r["peak_rss_gb"] for r in runs if r.get("peak_rss_gb")]
        step_s = statistics.median(x for r in runs for x in r["step_s"][1:] or r["step_s"])
        print(f"| {name} | " + " | ".join(cells) +
              f" | {pct([r['eval_accuracy'][-1] for r in runs])}"
              f" | {mean_sd([r['eval_minutes'][-1] for r in runs], digits=1)}"
              f" | {mean_sd([r['eval_steps'][-1] for r in runs], digits=0)}"
              f" | {pct([r['final']['3digit']['accuracy'] for r in runs])} | {step_s:.1f}"
              f" | {f'{max(rss):.1f} GB' if rss else 'n/a'} |")
    # each run's own figures, so that seeds measured on other days can be pooled with these
    print("\nper seed:")
    for name, runs in sides.items():
        for r in runs:
            at = ", ".join(f"{t} min {100 * a:.1f}%" for t in (2, 5)
                           if (a := at_minutes(r, t)) is not None)
            step_s = statistics.median(r["step_s"][1:] or r["step_s"])
            print(f"  {name} seed {r['seed']}: {at}, after training "
                  f"{100 * r['eval_accuracy'][-1]:.1f}% ({r['eval_steps'][-1]} steps, "
                  f"{step_s:.1f} s/step), 3-digit {100 * r['final']['3digit']['accuracy']:.1f}%")


def report(sides: dict[str, list[dict]], out: Path) -> None:
    print(f"\n## {', '.join(f'{k}: {len(v)} seeds' for k, v in sides.items())}\n")
    summary(sides)
    print()
    print("training reward (mean ± sd over seeds) at step:")
    n_steps = min(len(r["reward"]) for runs in sides.values() for r in runs)
    marks = sorted({1, 5, 10, 15, 20, n_steps} & set(range(1, n_steps + 1)))
    print("| side | " + " | ".join(f"step {s}" for s in marks) + f" | mean of steps 1-{n_steps} |")
    print("|---" * (len(marks) + 2) + "|")
    for name, runs in sides.items():
        cells = [mean_sd([r["reward"][s - 1] for r in runs]) for s in marks]
        overall = mean_sd([statistics.mean(r["reward"][:n_steps]) for r in runs])
        print(f"| {name} | " + " | ".join(cells) + f" | {overall} |")
    print("\nheld-out greedy accuracy (200 problems) at equal steps:")
    steps = sorted(set.intersection(*(set(r["eval_steps"]) for runs in sides.values() for r in runs)))
    print("| side | " + " | ".join(f"step {s}" for s in steps) + " | s/step |")
    print("|---" * (len(steps) + 2) + "|")
    for name, runs in sides.items():
        cells = [pct([r["eval_accuracy"][r["eval_steps"].index(s)] for r in runs]) for s in steps]
        step_s = statistics.median(x for r in runs for x in r["step_s"][1:] or r["step_s"])
        print(f"| {name} | " + " | ".join(cells) + f" | {step_s:.1f} |")
    print("\nheld-out greedy accuracy at equal training minutes (linear between evaluations):")
    last = min(r["eval_minutes"][-1] for runs in sides.values() for r in runs)
    span = max(r["eval_minutes"][-1] for runs in sides.values() for r in runs)
    grid = [t for t in (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20) if t <= span]
    print("| side | " + " | ".join(f"{t:g} min" for t in grid) + " |")
    print("|---" * (len(grid) + 1) + "|")
    for name, runs in sides.items():
        cells = []
        for t in grid:
            vals = [at_minutes(r, t) for r in runs]
            cells.append(pct(vals) if all(v is not None for v in vals) else "-")
        print(f"| {name} | " + " | ".join(cells) + " |")
    del last
    print("\nfinal models, benchmarks/heldout.py (plain transformers, greedy):")
    print("| side | 2-digit (trained) | carry | no carry | 3-digit (never trained) |")
    print("|---|---|---|---|---|")
    for name, runs in sides.items():
        f2 = [r["final"]["2digit"] for r in runs]
        print(f"| {name} | {pct([f['accuracy'] for f in f2])} | "
              f"{pct([f.get('accuracy_carry=true') for f in f2])} | "
              f"{pct([f.get('accuracy_carry=false') for f in f2])} | "
              f"{pct([r['final']['3digit']['accuracy'] for r in runs])} |")
    print("\nentropy and share of all-equal groups per step (mean over seeds):")
    for name, runs in sides.items():
        ent = [statistics.mean(r["entropy"][i] for r in runs) for i in range(n_steps)
               if all(r["entropy"][i] is not None for r in runs)]
        eq = [statistics.mean(r["equal_groups"][i] for r in runs) for i in range(n_steps)
              if all(r["equal_groups"][i] is not None for r in runs)]
        print(f"  {name} entropy: " + " ".join(f"{x:.2f}" for x in ent))
        print(f"  {name} all-equal groups: " + " ".join(f"{x:.2f}" for x in eq))
    plot(sides, out / "learning.png")
    print(f"\nplot: {out / 'learning.png'}")


def plot(sides: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [("reward", "steps", "training reward", axes[0, 0]),
              ("eval_accuracy", "eval_steps", "held-out accuracy vs step", axes[0, 1]),
              ("eval_accuracy", "eval_minutes", "held-out accuracy vs training minutes", axes[0, 2]),
              ("entropy", "steps", "policy entropy (nats/token)", axes[1, 0]),
              ("equal_groups", "steps", "share of all-equal groups", axes[1, 1])]
    for i, (name, runs) in enumerate(sides.items()):
        color = f"C{i}"
        for key, xkey, title, ax in panels:
            for j, r in enumerate(runs):
                pts = [(x, y) for x, y in zip(r[xkey], r[key]) if y is not None]
                if pts:
                    ax.plot(*zip(*pts), color=color, alpha=0.35, lw=1,
                            label=name if j == 0 else None)
            n = min(len(r[key]) for r in runs)
            if key != "eval_accuracy" or xkey == "eval_steps":
                ys = [[r[key][k] for r in runs] for k in range(n)]
                if all(all(v is not None for v in y) for y in ys) and n:
                    ax.plot(runs[0][xkey][:n], [np.mean(y) for y in ys], color=color, lw=2.5)
            ax.set_title(title)
            ax.set_xlabel("training minutes" if xkey == "eval_minutes" else "step")
    axes[0, 0].legend()
    ax = axes[1, 2]
    for i, (name, runs) in enumerate(sides.items()):
        ax.bar(i, np.mean([r["final"]["3digit"]["accuracy"] for r in runs]), color=f"C{i}")
        ax.scatter([i] * len(runs), [r["final"]["3digit"]["accuracy"] for r in runs], color="k", s=10)
    ax.set_xticks(range(len(sides)), list(sides), rotation=20)
    ax.set_title("3-digit addition (never trained), final models")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def load_out(out: Path) -> dict[str, list[dict]]:
    """The finished runs of an output folder, by side (label from its meta.json)."""
    meta = json.loads((out / "meta.json").read_text()) if (out / "meta.json").is_file() else {}
    label = meta.get("label") or out.name
    sides: dict[str, list[dict]] = {}
    for f in sorted(out.glob("posttrain-s*/bench.json")):
        run = {"seed": int(f.parent.name.removeprefix("posttrain-s")), **json.loads(f.read_text())}
        sides.setdefault(f"posttrain {label}".strip(), []).append(run)
    for f in sorted(out.glob("trl-s*.json")):
        run = {"seed": int(f.stem.removeprefix("trl-s")), **json.loads(f.read_text())}
        sides.setdefault("TRL 1.16", []).append(run)
    return sides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--max_minutes", type=float, default=None,
                    help="posttrain: stop at this many training minutes (default: run all steps)")
    ap.add_argument("--sides", nargs="+", default=["posttrain", "trl"], choices=["posttrain", "trl"])
    ap.add_argument("--no-final", action="store_true",
                    help="do not score the final models again with benchmarks/heldout.py")
    ap.add_argument("--label", default="", help="names this posttrain configuration in the tables")
    ap.add_argument("--out", type=Path, help="output folder (default benchmarks/out/learning-LABEL)")
    ap.add_argument("--trl-venv", type=Path, default=ROOT / ".venv-trl")
    ap.add_argument("--report", type=Path, nargs="+", help="only print tables of finished folders")
    ap.add_argument("--presets", nargs="+", choices=table_presets(),
                    help="run these algorithms (posttrain only), one folder each under --out")
    args, overrides = ap.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    global FINAL_HELDOUT
    FINAL_HELDOUT = not args.no_final
    if args.presets:
        root = args.out or ROOT / "benchmarks" / "out" / "presets"
        folders = [root / name for name in args.presets]
        for name, folder in zip(args.presets, folders):
            run_side(folder, "posttrain", name, args, preset_args(name) + overrides)
        args.report = folders
    if args.report:
        sides: dict[str, list[dict]] = {}
        for folder in args.report:
            for k, v in load_out(folder).items():
                sides.setdefault(k if k not in sides else f"{k} ({folder.name})", v)
        report(sides, args.report[0])
        return
    out = args.out or ROOT / "benchmarks" / "out" / f"learning-{args.label or 'default'}"
    for side in args.sides:
        run_side(out, side, args.label, args, overrides)
    if FINAL_HELDOUT:   # (the report reads the final models' scores)
        report(load_out(out), out)


def run_side(out: Path, side: str, label: str, args: argparse.Namespace, overrides: list[str]) -> None:
    """Every seed of one side into `out` (finished seeds are reused)."""
    out.mkdir(parents=True, exist_ok=True)
    meta = out / "meta.json"
    if side == "posttrain" or not meta.is_file():
        meta.write_text(json.dumps({"label": label, "overrides": overrides,
                                    "steps": args.steps, "seeds": args.seeds}))
    from posttrain.model.loading import prepare_embedded
    model_dir = prepare_embedded()
    for seed in args.seeds:
        t0 = time.time()
        if side == "posttrain":
            r = run_posttrain(out, seed, args.steps, args.eval_every, overrides, args.max_minutes)
        else:
            r = run_trl(out, seed, args.steps, args.eval_every, model_dir, args.trl_venv)
        print(f"{label or side} seed {seed}: held-out {r['eval_accuracy'][-1]:.3f} at step "
              f"{r['eval_steps'][-1]}, {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
