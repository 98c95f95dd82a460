"""The docs' result tables, rendered from the committed records under benchmarks/results/.

    .venv/bin/python benchmarks/tables.py           # rewrite every table in docs/ from its records
    .venv/bin/python benchmarks/tables.py --check   # exit 1 naming each table that differs

A table sits in a docs page between `<!-- table: NAME -->` and `<!-- /table -->`; TABLES maps NAME
to the function that renders it from the records (each run's `bench.json`, written by
benchmarks/learning.py, and its folder's `meta.json` with the overrides it ran with).
tests/test_docs_tables.py fails when a table in the docs is not what its records render.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import datetime
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import learning  # noqa: E402
from learning import at_minutes  # noqa: E402

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)



def held_out_accuracy(behaviour: dict, name: str = "accuracy") -> float:
    """A stage's greedy held-out accuracy (or `name`: length_mean); records written before the
    stages used the one evaluator name it behaviour/accuracy."""
    return behaviour.get(f"eval/{name}", behaviour.get(f"behaviour/{name}"))

def mean_sd(xs: list[float], scale: float = 1.0, digits: int = 3, unit: str = "") -> str:
    """learning.py's 'mean ± sd' over seeds; one seed's value alone (it has no spread)."""
    if len([x for x in xs if x is not None]) == 1:
        return f"{scale * next(x for x in xs if x is not None):.{digits}f}{unit}"
    return learning.mean_sd(xs, scale, digits, unit)


def pct(xs: list[float]) -> str:
    return mean_sd(xs, 100.0, 1, "%")


def load_runs(folder: Path, side: str = "posttrain") -> list[dict]:
    """Every seed's record of one side in a folder, in seed order: posttrain's
    `posttrain-s<seed>/bench.json`, TRL's `trl-s<seed>.json`."""
    pattern, seed = {
        "posttrain": ("posttrain-s*/bench.json", lambda path: int(path.parent.name[len("posttrain-s"):])),
        "trl": ("trl-s*.json", lambda path: int(path.stem[len("trl-s"):])),
    }[side]
    return [{**json.loads(path.read_text()), "seed": seed(path)}
            for path in sorted(folder.glob(pattern), key=seed)]


def at_step(run: dict, step: int) -> float | None:
    """Held-out accuracy evaluated at `step` (None where that step was not evaluated)."""
    return dict(zip(run["eval_steps"], run["eval_accuracy"])).get(step)


def pct_at_step(runs: list[dict], step: int) -> str:
    """Held-out at `step` over the seeds evaluated there, saying so when not every seed was (a
    seed whose 10 minutes ended before `step`)."""
    values = [at_step(r, step) for r in runs]
    have = sum(v is not None for v in values)
    return pct(values) + (f" ({have} of {len(runs)} seeds)" if 0 < have < len(runs) else "")


def median_step_s(runs: list[dict]) -> float:
    """The median step time over every step of every seed but each run's first (warm-up)."""
    return statistics.median(x for r in runs for x in r["step_s"][1:])


def per_seed_end(runs: list[dict]) -> str:
    """Each seed's last held-out reading and the steps it had: '83.5 (83) / 91.0 (78)'."""
    return " / ".join(f"{100 * r['eval_accuracy'][-1]:.1f} ({r['eval_steps'][-1]})" for r in runs)


def preset_row(label: str, runs: list[dict]) -> str:
    """One preset's row: held-out at 2 and 5 training minutes and at the end (mean ± sd over
    seeds, linear between evaluations), each seed's end (steps), at step 30 (per step, whatever
    the machine's speed), the median step time and the 3-digit transfer."""
    at = [pct([at_minutes(r, t) for r in runs]) for t in (2, 5)]
    step30 = pct_at_step(runs, 30)
    end = pct([r["eval_accuracy"][-1] for r in runs])
    three = pct([r["final"]["3digit"]["accuracy"] for r in runs])
    return (f"| {label} | {len(runs)} | {at[0]} | {at[1]} | {end} | {per_seed_end(runs)} | {step30} | "
            f"{median_step_s(runs):.1f} | {three} |")


DEFAULT = "benchmarks/results/default-2026-12-07"


def default_table(root: Path) -> str:
    """The default job (`posttrain train`, 10 minutes) over its seeds: held-out before training,
    at steps 30 and 60 and after the 10 minutes, the steps that fit, the 3-digit transfer and
    the peak resident memory."""
    runs = load_runs(root / DEFAULT)
    steps = [r["eval_steps"][-1] for r in runs]
    return "\n".join([
        "| held-out accuracy, mean ± sd | step 0 | step 30 | step 60 | **after 10 min** | "
        "steps in 10 min (median s a step) | 3-digit (never trained) | peak RSS |", "|---" * 8 + "|",
        f"| the default job ({len(runs)} seeds) | " +
        " | ".join(pct_at_step(runs, s) for s in (0, 30, 60)) +
        f" | **{pct([r['eval_accuracy'][-1] for r in runs])}** | "
        f"{mean_sd(steps, digits=0)} ({median_step_s(runs):.1f} s) | "
        f"{pct([r['final']['3digit']['accuracy'] for r in runs])} | "
        f"{max(r['peak_rss_gb'] for r in runs):.1f} GB |",
        "",
        f"Per seed after 10 minutes (steps): {per_seed_end(runs)}. Records: "
        f"`{DEFAULT}/posttrain-s<seed>/bench.json`.",
    ]) + "\n"


OPD = "benchmarks/results/opd-2026-12-04"
OPD_TEACHER = "benchmarks/results/default-2026-12-03"   # the default job whose seed 0 taught OPD


def distill_table(runs: list[dict], label: str, footer: str) -> str:
    """A distillation recipe's held-out accuracy at each step every seed evaluated (mean ± sd),
    training minutes and 3-digit transfer, then each seed's last reading and `footer`."""
    steps = sorted(set.intersection(*(set(r["eval_steps"]) for r in runs)))
    return "\n".join([
        "| run | " + " | ".join(f"step {s}" for s in steps) + " | training minutes | 3-digit |",
        "|---" * (len(steps) + 3) + "|",
        f"| {label} | " + " | ".join(pct_at_step(runs, s) for s in steps) +
        f" | {mean_sd([r['eval_minutes'][-1] for r in runs], digits=1)} | "
        f"{pct([r['final']['3digit']['accuracy'] for r in runs])} |",
        "",
        f"Per seed at step {steps[-1]}: " +
        " / ".join(f"{100 * at_step(r, steps[-1]):.1f}%" for r in runs) + f". {footer}",
    ]) + "\n"


def opd_table(root: Path) -> str:
    """On-policy distillation from the default job's seed-0 model (the records of OPD_TEACHER,
    which taught these runs): held-out every 2 student steps (mean ± sd over seeds), training
    minutes, and that default GRPO job at step 30."""
    runs, teachers = load_runs(root / OPD), load_runs(root / OPD_TEACHER)
    return distill_table(
        runs, f"OPD ({len(runs)} seeds), teacher {100 * teachers[0]['eval_accuracy'][-1]:.1f}%",
        f"The default GRPO job at step 30: {pct([at_step(r, 30) for r in teachers])}."
        f" Records: `{OPD}/posttrain-s<seed>/bench.json` (the teacher: `{OPD_TEACHER}`, seed 0).")


OPSD = "benchmarks/results/opsd-2026-12-04"


def opsd_table(root: Path) -> str:
    """On-policy self-distillation (the student shown the answer is its own teacher): held-out
    at each evaluated step (mean ± sd over seeds), training minutes, the 3-digit transfer."""
    runs = load_runs(root / OPSD)
    return distill_table(runs, f"OPSD ({len(runs)} seeds)", f"Records: `{OPSD}/posttrain-s<seed>/bench.json`.")


LORA = "benchmarks/results/lora-2026-12-04"


def lora_table(root: Path) -> str:
    """LoRA adapters (rank 16, lr 1e-4) on the default job beside full fine-tuning (the default
    job): held-out at steps 10-30 where evaluated, after 10 minutes, steps, peak memory."""
    lora, full = load_runs(root / LORA), load_runs(root / DEFAULT)
    meta = json.loads((root / LORA / "meta.json").read_text())

    def row(label: str, runs: list[dict]) -> str:
        return (f"| {label} | {len(runs)} | {pct_at_step(runs, 30)} | "
                f"**{pct([r['eval_accuracy'][-1] for r in runs])}** | "
                f"{mean_sd([r['eval_steps'][-1] for r in runs], digits=0)} "
                f"({median_step_s(runs):.1f} s) | {max(r['peak_rss_gb'] for r in runs):.2f} GB |")
    return "\n".join([
        "| run | seeds | held-out step 30 | **after 10 min** | steps (median s a step) | peak RSS |",
        "|---" * 6 + "|",
        row(f"LoRA (`{' '.join(meta['overrides'])}`)", lora),
        row("full fine-tuning (the default job)", full),
        "",
        f"Records: `{LORA}/posttrain-s<seed>/bench.json`, `{DEFAULT}/posttrain-s<seed>/bench.json`.",
    ]) + "\n"


GPU = "benchmarks/results/gpu-h200-2026-12-04"


def gpu_table(root: Path) -> str:
    """One GPU: the default job over the seeds on record (held-out at steps 0-90, its training
    minutes, median step, 3-digit) and benchmarks/gpu_check.py's larger steps (time a step and
    its parts, generated tokens a second, peak GPU memory, the trainer-vs-sampler mismatch)."""
    runs = load_runs(root / GPU / "default")
    checks = [json.loads(f.read_text()) for f in sorted((root / GPU).glob("gpu_check*.json"))]
    env = checks[0]["env"]
    measured = {r["name"] for c in checks for r in c["runs"] if "error" not in r}
    rows = [r for c in checks for r in c["runs"] if "error" not in r or r["name"] not in measured]
    labels = {"grpo": "GRPO", "ppo": "PPO (value model, GAE, KL 0.05 in the reward)",
              "lora": "GRPO with LoRA r16 and a KL (reference = adapters off)"}

    def check_row(r: dict) -> str:
        if "error" in r:      # a run no record measured
            return f"| {labels[r['name']]} | not measured: {r['error']} |" + " |" * 5
        return (f"| {labels[r['name']]} | {r['step_s']:.1f} | {r['generate_s']:.1f} "
                f"({r['generated_tokens_per_s']:,.0f}) | {r['update_s']:.2f} | "
                f"{r['peak_gpu_gib']:.1f} GiB | {r['logp_mismatch']:.3f} | {r['is_ratio_max']:.2f} |")
    seeds = ", ".join(str(r["seed"]) for r in runs)
    return "\n".join([
        f"On one {env['gpu']} (torch {env['torch']}, transformers {env['transformers']}):", "",
        "| the default job (`posttrain train`), seeds | step 0 | step 30 | step 60 | step 90 | "
        "training minutes | median s a step | 3-digit (never trained) |", "|---" * 8 + "|",
        f"| {seeds} | " + " | ".join(pct_at_step(runs, s) for s in (0, 30, 60, 90)) + " | " +
        f"{mean_sd([r['eval_minutes'][-1] for r in runs], digits=1)} | {median_step_s(runs):.2f} | "
        f"{pct([r['final']['3digit']['accuracy'] for r in runs])} |",
        "",
        f"Each seed after training, held-out % (steps): {per_seed_end(runs)}.",
        "",
        "| `gpu_check.py`: 32 prompts x 8 answers, up to 128 new tokens, bf16 autocast | s a step | "
        "generation s (tokens/s) | update s | peak GPU memory | mean abs log-prob mismatch | "
        "largest trainer/sampler probability ratio |", "|---" * 7 + "|",
        *[check_row(r) for r in rows],
        "",
        f"Records: `{GPU}/default/posttrain-s<seed>/bench.json`, "
        + ", ".join(f"`{GPU}/{f.name}` (commit {c['provenance']['commit'][:7]})"
                    for f, c in zip(sorted((root / GPU).glob("gpu_check*.json")), checks)) + ".",
    ]) + "\n"


ENVIRONMENTS = "benchmarks/results/environments-2026-12-04"


def metrics_of(folder: Path) -> list[dict]:
    """A run's metrics.jsonl, one dict a line (training steps and evaluations)."""
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_footer(record: dict, name: str) -> str:
    """Steps, training minutes, minutes in all and the record's path, from benchmarks/record.py."""
    s = record["summary"]
    return (f"{s['steps']} steps in {s['train_minutes']:.1f} training minutes, "
            f"{record['wall_s'] / 60:.1f} minutes in all. Record: `{ENVIRONMENTS}/{name}/record.json` "
            f"(metrics.jsonl and the run's eval_samples.jsonl beside it).")


def guess_number_table(root: Path) -> str:
    """Guess the number (posttrain/recipes/guess_number.yaml): held-out success and turns at each
    evaluation, invalid guesses per episode in training at that step, training success early and
    late."""
    folder = root / ENVIRONMENTS / "guess-number"
    record, rows = json.loads((folder / "record.json").read_text()), metrics_of(folder)
    train = [r for r in rows if "reward/accuracy" in r]
    invalid = {r["step"]: r.get("env/invalid_guesses", 0.0) for r in train}   # absent: none that step
    lines = ["| step | held-out success (100 secrets, greedy) | turns / episode (held-out) | "
             "invalid guesses / episode (training, that step; step 1 for the base model) |", "|---" * 4 + "|"]
    for r in (r for r in rows if "eval/accuracy" in r):
        lines.append(f"| {r['step'] or '0 (the base model)'} | {100 * r['eval/accuracy']:.0f}% | "
                     f"{r['eval/turns']:.2f} | {invalid[max(r['step'], 1)]:.2f} |")
    early, late = ([r["reward/accuracy"] for r in part] for part in (train[:5], train[-5:]))
    return "\n".join(lines + ["", f"Training success (sampled): {statistics.mean(early):.2f} over steps "
                              f"{train[0]['step']}-{train[4]['step']}, {statistics.mean(late):.2f} over "
                              f"steps {train[-5]['step']}-{train[-1]['step']}. " + run_footer(record, "guess-number")]) + "\n"


ECOSYSTEM = "benchmarks/results/ecosystem-2026-12-05"
# the judge's arm, agreement and calls, measured with the fenced templates (rewards/judge_format.py)
JUDGE_RECORDS = "benchmarks/results/ecosystem-2026-12-06"
HELD_OUT = {"verifiers": "eval/env_reward"}   # a verifiers task's held-out figure is its rubric's


def arm_runs(root: Path, arm: str, where: str = ECOSYSTEM) -> list[tuple[dict, list[dict]]]:
    """Every seed's (record, metrics rows) of one arm of benchmarks/ecosystem.sh, in seed order."""
    folders = sorted((root / where).glob(f"{arm}-seed*"), key=lambda f: int(f.name.rsplit("seed", 1)[1]))
    return [(json.loads((f / "record.json").read_text()), metrics_of(f)) for f in folders]


def arm_row(label: str, runs: list[tuple[dict, list[dict]]], key: str) -> str:
    """Held-out before and after (mean ± sd over seeds, each seed's after), steps taken."""
    evals = [[r[key] for r in rows if key in r] for _, rows in runs]
    before, after = [e[0] for e in evals], [e[-1] for e in evals]
    steps = [rec["summary"]["steps"] for rec, _ in runs]
    return (f"| {label} | {mean_sd(before, 100, 1)} | **{mean_sd(after, 100, 1)}** | "
            f"{' / '.join(f'{100 * a:.0f}' for a in after)} | {statistics.mean(steps):.1f} |")


def ecosystem_envs_table(root: Path) -> str:
    """Each adapter beside the native run it re-expresses, same seeds, same training minutes."""
    lines = ["| arm | held-out before (%, mean ± sd) | held-out after (%) | after, per seed | "
             "steps in the budget (mean) |", "|---" * 5 + "|"]
    minutes = {}
    for arm, label in (("guess-native", "guess the number, native"),
                       ("guess-openenv", "guess the number, OpenEnv in process"),
                       ("addition-native", "addition (the default job), native"),
                       ("addition-verifiers", "addition, verifiers taskset")):
        runs = arm_runs(root, arm)
        lines.append(arm_row(label, runs, HELD_OUT.get(arm.split("-")[1], "eval/accuracy")))
        minutes[arm] = statistics.mean(rec["summary"]["train_minutes"] for rec, _ in runs)
    each = ", ".join(f"{arm} {m:.1f}" for arm, m in minutes.items())
    return "\n".join(lines + ["", f"{len(arm_runs(root, 'guess-native'))} seeds per arm; training "
                              f"minutes a seed (mean): {each}. Records: `{ECOSYSTEM}/ARM-seedS/record.json`."]) + "\n"


ARTIFACTS = "benchmarks/results/artifacts-2026-12-06"


def artifacts_table(root: Path) -> str:
    """Environments as their authors publish them (benchmarks/artifacts.sh): OpenEnv's
    reasoning_gym_env beside posttrain's native chain_sum task (same seeds and minutes), and
    verifiers' scratchpad (no native equivalent)."""
    lines = ["| arm | held-out before (%, mean ± sd) | held-out after (%) | after, per seed | "
             "steps in the budget (mean) |", "|---" * 5 + "|"]
    minutes = {}
    for arm, label in (("chain-sum-native", "chain_sum, posttrain's reasoning-gym task"),
                       ("chain-sum-openenv", "chain_sum, OpenEnv's reasoning_gym_env in process"),
                       ("scratchpad-verifiers", "scratchpad, verifiers' own (a shared tool server)")):
        runs = arm_runs(root, arm, ARTIFACTS)
        lines.append(arm_row(label, runs, "eval/accuracy"))
        minutes[arm] = statistics.mean(rec["summary"]["train_minutes"] for rec, _ in runs)
    each = ", ".join(f"{arm} {m:.1f}" for arm, m in minutes.items())
    return "\n".join(lines + ["", f"3 seeds per arm; training minutes a seed (mean): {each}. "
                              f"Records: `{ARTIFACTS}/ARM-seedS/record.json`."]) + "\n"


VLLM_IDLE = {   # (its table: docs/scaling.md) each record, and its CPU's vector units (PROVENANCE.md)
    "benchmarks/results/vllm-idle-2026-12-06": "AVX-512 (bf16 autocast)",
    "benchmarks/results/vllm-idle-2026-12-07": "AVX2 only (float32: autocast auto)",
}
PHASES = ("perf/generate_s", "perf/update_s", "perf/weight_push_s", "perf/step_s")


def vllm_idle_table(root: Path) -> str:
    """Each phase of a step, median over steps 2-12 of each run (the first step warms up), for
    `generate` and vLLM in process, two rounds back to back (benchmarks/vllm_idle.sh), on each
    machine."""
    lines = ["| CPU | sampler, round | generation (s) | update (s) | weight push (s) | step (s) |",
             "|---" * 6 + "|"]
    for record, cpu in VLLM_IDLE.items():
        for backend, label in (("hf", "`generate`, in the trainer"), ("vllm", "vLLM in process")):
            for round_ in (1, 2):
                folder = root / record / f"{backend}-round{round_}"
                json.loads((folder / "record.json").read_text())   # (named in the provenance line)
                steps = [r for r in metrics_of(folder) if "perf/step_s" in r][1:]
                cells = [f"{statistics.median(r.get(k, 0.0) for r in steps):.2f}" for k in PHASES]
                lines.append(f"| {cpu} | {label}, {round_} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", "The default job, seed 0, 12 steps a run. Records: " + ", ".join(
        f"`{r}/SAMPLER-roundN/record.json`" for r in VLLM_IDLE) + "."]) + "\n"


TINKER_COOKBOOK = "benchmarks/results/tinker-cookbook-2026-12-07"   # (its table: docs/tinker.md)


def tinker_cookbook_table(root: Path) -> str:
    """tinker-cookbook's arithmetic RL recipe against tinker-serve, and posttrain's own GRPO with
    the same adapter, lr and batch for the same minutes (benchmarks/tinker_cookbook.py): steps,
    steps a minute, the training answers' accuracy over the first and the last 3 steps."""
    folder = root / TINKER_COOKBOOK
    cook = [json.loads(p.read_text()) for p in sorted(folder.glob("run*/record.json"))]
    mine = load_runs(folder / "posttrain")
    minutes = [r["wall_s"] / 60 for r in cook]
    rows = [("tinker-cookbook `math_rl` (arithmetic) on `posttrain tinker-serve`", [r["steps"] for r in cook],
             [r["steps_per_minute"] for r in cook], [r["correct_first_3_steps"] for r in cook],
             [r["correct_last_3_steps"] for r in cook]),
            ("posttrain's GRPO, LoRA 32, lr 1e-4 (2-digit addition)", [len(r["steps"]) for r in mine],
             [60 / statistics.median(r["step_s"]) for r in mine],
             [statistics.mean(r["reward"][:3]) for r in mine], [statistics.mean(r["reward"][-3:]) for r in mine])]
    lines = ["| run (16 problems x 4 answers a step) | steps | steps a minute | correct, first 3 steps | "
             "correct, last 3 steps |", "|---" * 5 + "|"]
    for label, steps, rate, first, last in rows:
        lines.append(f"| {label} ({len(steps)} runs) | {mean_sd(steps, digits=0)} | "
                     f"{mean_sd(rate, digits=2)} | {pct(first)} | {pct(last)} |")
    held = [(r["eval_accuracy"][0], r["eval_accuracy"][-1]) for r in mine if r["eval_accuracy"]]
    tail = (f" posttrain's held-out accuracy (200 problems, greedy): {pct([h[0] for h in held])} before, "
            f"{pct([h[1] for h in held])} after." if held else "")
    return "\n".join(lines + ["", f"{mean_sd(minutes, digits=1)} minutes a cookbook run.{tail} Records: "
                              f"`{TINKER_COOKBOOK}/runK/record.json`, `{TINKER_COOKBOOK}/posttrain/"
                              "posttrain-s<seed>/bench.json`."]) + "\n"


TINKER_COOKBOOK_SL = "benchmarks/results/tinker-cookbook-sl-2026-12-07"   # (docs/tinker.md)
POSTTRAIN_SL = "benchmarks/results/posttrain-sl-2026-12-07"   # posttrain's own sft beside it


def tinker_cookbook_sl_table(root: Path) -> str:
    """tinker-cookbook's basic SL recipe (sl_basic.py) against tinker-serve on the conversation
    file it ships (benchmarks/tinker_cookbook.py --recipe sl), and posttrain's own sft beside it
    (--recipe posttrain-sl): steps, steps a minute, the training NLL over the first and last 3
    steps, the held-out NLL before and after."""
    folder = root / TINKER_COOKBOOK_SL
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("run*/record.json"))]
    lines = ["| run (8 conversations a step, 3 epochs) | steps | steps a minute | training NLL, first 3 "
             "steps | training NLL, last 3 steps | held-out NLL, step 0 | held-out NLL, last "
             "evaluation (step) |", "|---" * 7 + "|"]
    lines.append(_sl_row(f"tinker-cookbook `sl_basic` on `posttrain tinker-serve` ({len(runs)} runs)", runs))
    own = [json.loads(p.read_text()) for p in sorted((root / POSTTRAIN_SL).glob("run*/record.json"))]
    lines.append(_sl_row(f"posttrain's own `sft` (LoRA 32), same settings and splits ({len(own)} runs)", own))
    minutes = [r["wall_s"] / 60 for r in runs + own]
    return "\n".join(lines + ["", f"{mean_sd(minutes, digits=1)} minutes a run; exit codes "
                              f"{', '.join(str(r['exit_code']) for r in runs + own)} (0: the run went to its end). "
                              f"Records: `{TINKER_COOKBOOK_SL}/runK/record.json`, "
                              f"`{POSTTRAIN_SL}/runK/record.json`."]) + "\n"


def _sl_row(label: str, runs: list[dict]) -> str:
    held = [r["test_nll_per_eval"] for r in runs]
    return (f"| {label} | {mean_sd([r['steps'] for r in runs], digits=0)} | "
            f"{mean_sd([r['steps_per_minute'] for r in runs], digits=2)} | "
            f"{mean_sd([r['train_nll_first_3_steps'] for r in runs], digits=3)} | "
            f"{mean_sd([r['train_nll_last_3_steps'] for r in runs], digits=3)} | "
            f"{mean_sd([h[0][1] for h in held], digits=3)} | "
            f"{mean_sd([h[-1][1] for h in held], digits=3)} ({', '.join(str(h[-1][0]) for h in held)}) |")


TINKER_SAMPLING = "benchmarks/results/tinker-sampling-2026-12-07"   # (docs/tinker.md)


def tinker_sampling_table(root: Path) -> str:
    """tinker-serve's two samplers in an RL loop (benchmarks/tinker_sampling.py): tokens sampled
    a second, seconds of sampling a step and of the whole step, mean ± sd over rounds."""
    rec = json.loads((root / TINKER_SAMPLING / "record.json").read_text())
    lines = ["| sampler | tokens sampled a second | seconds of sampling a step | seconds a step "
             "(with the update) |", "|---" * 4 + "|"]
    for name, label in (("hf", "`hf` (default)"), ("vllm", "`vllm`")):
        runs = [r for r in rec["runs"] if r["sampler"] == name]
        lines.append(f"| {label} | {mean_sd([r['tokens_per_s'] for r in runs], digits=1)} | "
                     f"{mean_sd([r['sample_s'] for r in runs], digits=1)} | "
                     f"{mean_sd([r['step_s'] for r in runs], digits=1)} |")
    return "\n".join(lines + ["", f"{len(rec['runs']) // 2} rounds each. Record: "
                              f"`{TINKER_SAMPLING}/record.json`."]) + "\n"


TINKER_CLIENTS = "benchmarks/results/tinker-clients-2026-12-07"   # (docs/tinker.md)


def tinker_clients_table(root: Path) -> str:
    """Several training clients at once on one tinker-serve (benchmarks/tinker_clients.py): the
    steps a minute of all clients together, their forward_backwards batched or each alone."""
    rec = json.loads((root / TINKER_CLIENTS / "record.json").read_text())
    runs = rec["runs"]
    spm = {}
    for r in runs:
        spm.setdefault((r["clients"], r["batched"]), []).append(r["steps_per_minute"])
    lines = ["| training clients | steps a minute, each alone (the default) | steps a minute, "
             "batched (`--batch_clients`) | batched / alone | forward_backwards batched with "
             "another client's |", "|---" * 5 + "|"]
    for clients in sorted({c for c, _ in spm}):
        alone, together = spm[(clients, False)], spm[(clients, True)]
        share = [r["batched_share"] for r in runs if r["clients"] == clients and r["batched"]]
        lines.append(f"| {clients} | {mean_sd(alone, digits=2)} | {mean_sd(together, digits=2)} | "
                     f"{statistics.mean(together) / statistics.mean(alone):.2f}x | "
                     f"{100 * statistics.mean(share):.0f}% |")
    rounds = len({r["round"] for r in runs})
    return "\n".join(lines + ["", f"{rounds} rounds (mean ± sd); a step: forward_backward of "
                              f"{rec['datums']} datums then optim_step, LoRA {rec['rank']}. Record: "
                              f"`{TINKER_CLIENTS}/record.json`."]) + "\n"


def judge_row(label: str, runs: list[tuple[dict, list[dict]]]) -> str:
    train = [[r for r in rows if "reward/mean" in r] for _, rows in runs]
    agree = [r["reward/judge_agreement"] for t in train for r in t if "reward/judge_agreement" in r]
    unscorable = [r["reward/judge_unscorable"] / 64 for t in train for r in t if "reward/judge_unscorable" in r]
    judged = (f"{100 * statistics.mean(agree):.0f}%" if agree else "",
              f"{100 * statistics.mean(unscorable):.0f}%" if unscorable else "")
    return arm_row(label, runs, "eval/accuracy") + f" {judged[0]} | {judged[1]} |"


def ecosystem_judge_table(root: Path) -> str:
    """The default job rewarded by the verifier and by an LLM judge (SmolLM2 itself, served)."""
    lines = ["| reward | held-out before (%, mean ± sd) | held-out after (%) | after, per seed | "
             "steps in the budget (mean) | judge agrees with the verifier (training answers) | "
             "unscorable (training) |", "|---" * 7 + "|"]
    lines.append(judge_row("the verifier (the default job)", arm_runs(root, "addition-native")))
    judged = arm_runs(root, "addition-judge", JUDGE_RECORDS)
    lines.append(judge_row("an LLM judge alone (correct_reward 0)", judged))
    n = len(judged)
    a = json.loads((root / JUDGE_RECORDS / "judge-agreement" / "record.json").read_text())
    return "\n".join(lines + [
        "", f"Held-out accuracy is the verifier's in both rows; {n} seed(s) for the judge. On the "
        f"{a['judged']} held-out answers of the verifier-trained seed 0 after training "
        f"({a['verifier_correct']} correct), the judge says Yes {a['judge_yes']} times, No "
        f"{a['judge_no']} times ({a['unscorable']} unscorable): it agrees with the verifier on "
        f"{100 * a['agreement']:.0f}% (`benchmarks/judge_agreement.py`, {a['judge_seconds']:.0f} s). "
        f"Records: `{ECOSYSTEM}/addition-native-seedS/record.json`, "
        f"`{JUDGE_RECORDS}/addition-judge-seedS/record.json`, `{JUDGE_RECORDS}/judge-agreement/"
        f"record.json`, the judge's calls in `{JUDGE_RECORDS}/judge-server/served.jsonl`."]) + "\n"


def chain_sum_table(root: Path) -> str:
    """reasoning-gym chain_sum, 2 terms: held-out accuracy at each evaluation."""
    folder = root / ENVIRONMENTS / "chain-sum"
    record, rows = json.loads((folder / "record.json").read_text()), metrics_of(folder)
    evals = [r for r in rows if "eval/accuracy" in r]
    head = [str(r["step"]) for r in evals[:-1]] + [f"after {evals[-1]['perf/train_minutes']:.1f} min "
                                                   f"({evals[-1]['step']} steps)"]
    return "\n".join([
        "| held-out (100 problems, greedy), step | " + " | ".join(head) + " |", "|---" * (len(head) + 1) + "|",
        "| chain_sum, 2 terms | " + " | ".join(f"{100 * r['eval/accuracy']:.0f}%" for r in evals[:-1])
        + f" | **{100 * evals[-1]['eval/accuracy']:.0f}%** |", "", run_footer(record, "chain-sum"),
    ]) + "\n"


RLHF = "benchmarks/results/rlhf-2026-12-04"
RLHF_ARMS = {"terse": "score head, half the wrong answers terse (`--data.terse_wrong_share 0.5`)",
             "first": "score head, no terse wrong answers",
             "log-ratio": "log-ratio (`--reward_form log_ratio`)"}


def rlhf_row(folder: Path, arm: str) -> str:
    """One reward model and PPO on its score: pairs ranked, held-out at each evaluation, the
    reward model's score and the KL to the start over the first and last 5 steps, step time."""
    rm = json.loads((folder / f"rm-{arm}" / "record.json").read_text())["summary"]["eval_after"]
    rows = metrics_of(folder / f"ppo-{arm}")
    train, evals = [r for r in rows if "reward/model_score" in r], [r for r in rows if "eval/accuracy" in r]
    first, last = train[:5], train[-5:]

    def mean(key: str, part: list[dict]) -> float:
        return statistics.mean(r[key] for r in part)
    return (f"| {RLHF_ARMS[arm]} | {100 * rm['rm/eval_accuracy']:.1f}% "
            f"({100 * rm['rm/eval_accuracy@correct>wrong']:.0f}%) | "
            + " -> ".join(f"{100 * r['eval/accuracy']:.1f}%" for r in evals) + f" ({evals[-1]['step']} steps) | "
            f"{mean('reward/model_score', first):+.2f} -> {mean('reward/model_score', last):+.2f} | "
            f"{mean('policy/kl_ref', last):.2f} | {statistics.median(r['perf/step_s'] for r in train):.0f} |")


def rlhf_table(root: Path) -> str:
    """RLHF (posttrain/recipes/addition_rlhf.yaml): PPO on each recorded reward model's score alone
    (the verifier only measures)."""
    folder = root / RLHF
    arms = [a for a in RLHF_ARMS if (folder / f"ppo-{a}" / "record.json").exists()]
    return "\n".join([
        "| reward model | held-out pairs ranked (correct > wrong) | PPO on its score: held-out accuracy at "
        "steps 0, 10, 20, ... and the end | reward-model score, first -> last 5 steps | KL to the start, last 5 steps | median s a step |",
        "|---" * 6 + "|", *[rlhf_row(folder, a) for a in arms], "",
        f"Records: `{RLHF}/rm-<arm>/record.json` (the reward model) and `{RLHF}/ppo-<arm>/record.json` "
        "(PPO; metrics.jsonl and the run's eval_samples.jsonl beside it).",
    ]) + "\n"


MOPD = "benchmarks/results/mopd-2026-12-04"


def printed_json(log: Path) -> dict:
    """The JSON object a command printed last (posttrain generate's count of kept answers)."""
    text = log.read_text()
    return json.loads(text[text.rindex("\n{") + 1:])


def sft_minutes(folder: Path) -> float:
    """An SFT run's training minutes: its steps' times summed (its summary has no clock)."""
    return sum(r["perf/step_s"] for r in metrics_of(folder) if "perf/step_s" in r) / 60


def domain_row(label: str, r: dict, minutes: str) -> str:
    return (f"| {label} | {100 * r['eval/accuracy@addition']:.0f}% | "
            f"{100 * r['eval/accuracy@subtraction']:.0f}% | {minutes} |")


def mopd_table(root: Path) -> str:
    """MOPD from the base model and after an SFT warm-up on both teachers' verified answers:
    held-out accuracy per domain (100 problems each), the teachers and the answers kept."""
    folder = root / MOPD
    rec = {name: json.loads((folder / name / "record.json").read_text())
           for name in ("teacher-a", "teacher-b", "sft-mix", "sft-then-mopd", "mopd")}
    mopd = [r for r in metrics_of(folder / "mopd") if "eval/accuracy@addition" in r]
    warm = [r for r in metrics_of(folder / "sft-then-mopd") if "eval/accuracy@addition" in r]
    sft_min = sft_minutes(folder / "sft-mix")
    kept = {d: printed_json(folder / f"generate-{d}" / "run.log") for d in "ab"}
    teacher_a = rec["teacher-a"]["summary"]["eval_after"]["eval/accuracy"]
    teacher_b = held_out_accuracy(rec["teacher-b"]["summary"]["behaviour_after"])
    return "\n".join([
        "| model | addition | subtraction | training minutes |", "|---" * 4 + "|",
        domain_row("SmolLM2-135M-Instruct", mopd[0], "-"),
        *[domain_row(f"MOPD, step {r['step']}", r, f"{r['perf/train_minutes']:.1f}")
          for r in mopd[1:] if r["step"] in (16, mopd[-1]["step"])],
        domain_row("SFT on both teachers' verified answers (their token ids)", warm[0], f"{sft_min:.1f}"),
        domain_row(f"**... then MOPD, {warm[-1]['step']} steps, lr 1e-5**", warm[-1],
                   f"{sft_min:.1f} + {warm[-1]['perf/train_minutes']:.1f}"),
        "",
        f"Teachers: A {100 * teacher_a:.1f}% on 200 addition problems (the default job, 90 steps), "
        f"B {100 * teacher_b:.1f}% on 200 subtraction problems (SFT). Warm-up data: "
        f"{kept['a']['written']} of A's {kept['a']['generated']} answers kept, "
        f"{kept['b']['written']} of B's {kept['b']['generated']} (verified). "
        f"Records: `{MOPD}/<step>/record.json` (teacher-a, teacher-b, generate-a, generate-b, "
        "sft-mix, sft-then-mopd, mopd).",
    ]) + "\n"


DPO = "benchmarks/results/dpo-2026-12-04"


def dpo_table(root: Path) -> str:
    """DPO on the synthetic pairs: held-out pairs ranked by the implicit reward (and by kind),
    the policy's held-out accuracy and answer length before and after, the minutes."""
    rec = json.loads((root / DPO / "record.json").read_text())
    s = rec["summary"]
    ev, before, after = s["eval_after"], s["behaviour_before"], s["behaviour_after"]
    kinds = ", ".join(f"{k.split('@')[1]} {100 * v:.0f}%" for k, v in ev.items() if "@" in k)
    return "\n".join([
        "| | before | after |", "|---|---|---|",
        f"| {s['eval_pairs']} held-out pairs ranked by `beta log(pi/pi_ref)` | - | "
        f"**{100 * ev['dpo/eval_reward_accuracy']:.1f}%** ({kinds}) |",
        f"| held-out problems, greedy, no stop string | {100 * held_out_accuracy(before):.1f}% | "
        f"**{100 * held_out_accuracy(after):.1f}%** |",
        f"| mean response length (tokens) | {held_out_accuracy(before, 'length_mean'):.1f} | "
        f"{held_out_accuracy(after, 'length_mean'):.1f} |",
        "",
        f"{s['train_pairs']} training pairs, {s['steps']} steps in {s['train_minutes']:.1f} training "
        f"minutes (+ {s['reference_s'] / 60:.1f} for the reference pass), one seed. Record: "
        f"`{DPO}/record.json`.",
    ]) + "\n"


PPO_RECIPE = "benchmarks/results/ppo-recipe-2026-12-04"
REWARD_MODELS = "benchmarks/results/reward-model-2026-12-04"


def explained_variance_span(folder: Path) -> str:
    """The range of the critic's explained variance over a PPO run's steps (its first step, before
    any value update, left out)."""
    rows = metrics_of(folder)
    ev = [r["critic/explained_variance"] for r in rows if r.get("critic/explained_variance") is not None]
    return f"{min(ev[1:]):+.2f} to {max(ev[1:]):+.2f}"


def ppo_rlhf_table(root: Path) -> str:
    """The PPO recipe (held-out at each evaluation, steps in its minutes, the median step, the
    critic's explained variance) and the two reward-model forms (held-out pairs ranked, by kind,
    minutes), each from its record."""
    ppo = load_runs(root / PPO_RECIPE)
    r0 = ppo[0]
    # (the evaluation after training repeats the last step's when the steps end on one)
    evals = " -> ".join(f"{100 * a:.1f}% (step {s})"
                        for s, a in dict(zip(r0["eval_steps"], r0["eval_accuracy"])).items())
    lines = ["| run | command (below) | held-out | time |", "|---|---|---|---|",
             f"| PPO, separate value model, beta 0.05, not whitened (seed {r0['seed']}) | [PPO](#ppo) | "
             f"{evals}; critic's explained variance "
             f"{explained_variance_span(root / PPO_RECIPE / 'posttrain-s0')} | "
             f"{r0['eval_steps'][-1]} steps in {r0['eval_minutes'][-1]:.1f} min, "
             f"{median_step_s(ppo):.1f} s a step (median) |"]
    for form, label in (("score_head", "reward model, score head on the last token (Bradley-Terry)"),
                        ("log_ratio", "reward model, `--reward_form log_ratio` (r = beta log pi/pi_ref)")):
        rec = json.loads((root / REWARD_MODELS / form / "record.json").read_text())
        ev = rec["summary"]["eval_after"]
        lines.append(f"| {label} | [reward models](#reward-models) | "
                     f"{100 * ev['rm/eval_accuracy']:.1f}% of {rec['summary']['eval_pairs']} pairs "
                     f"(correct > wrong {100 * ev['rm/eval_accuracy@correct>wrong']:.0f}%) | "
                     f"{rec['wall_s'] / 60:.1f} min in all |")
    return "\n".join([*lines, "", f"Records: `{PPO_RECIPE}/posttrain-s0/` (bench.json, metrics.jsonl), "
                       f"`{REWARD_MODELS}/<form>/record.json`."]) + "\n"


PRESET_HEADER = ("| preset | seeds | held-out 2 min | 5 min | after 10 min | per seed after 10 min "
                 "(steps) | step 30 | s/step (median) | 3-digit |", "|---" * 9 + "|")
PRESETS = ("benchmarks/results/presets-2026-12-02", "benchmarks/results/presets-2026-12-04")
PRESET_LABELS = {
    "reinforce": "REINFORCE (batch-mean baseline, sum over tokens)",
    "dr_grpo": "Dr. GRPO (no std, constant normaliser)",
    "dapo": "DAPO (Clip-Higher, dynamic sampling, overlong shaping)",
    "ppo": "PPO (value model, GAE, 2 minibatches)",
}


def presets_table(root: Path) -> str:
    """The lecture's presets on the default task, 10 minutes, each seed on record."""
    lines = list(PRESET_HEADER)
    for name, label in PRESET_LABELS.items():   # a preset's seeds, pooled over the days they ran
        runs = [r for folder in PRESETS if (root / folder / name).is_dir()
                for r in load_runs(root / folder / name)]
        lines.append(preset_row(label, sorted(runs, key=lambda r: r["seed"])))
    lines.append(f"\nRecords: `{'`, `'.join(PRESETS)}`, each `<preset>/posttrain-s<seed>/bench.json` "
                 "(each folder's `meta.json` has the options it ran with).")
    return "\n".join(lines) + "\n"


OBJECTIVES = "benchmarks/results/objectives-2026-12-03"
OBJECTIVE_LABELS = {
    "gspo": "GSPO (sequence ratio, clip 3e-4 / 4e-4)",
    "cispo": "CISPO (capped IS weight as a constant, cap 5)",
    "sapo": "SAPO (soft gate, tau 1.0 / 1.05)",
    "gmpo": "GMPO (geometric mean, log-ratio clip 0.4)",
}


def objectives_table(root: Path) -> str:
    """The field's current objectives on the default task, 4 minibatches, 10 minutes."""
    lines = list(PRESET_HEADER)
    runs_with = []
    for name, label in OBJECTIVE_LABELS.items():
        lines.append(preset_row(label, load_runs(root / OBJECTIVES / name)))
        meta = json.loads((root / OBJECTIVES / name / "meta.json").read_text())
        runs_with.append(f"`{name}`: `{' '.join(meta['overrides'])}`")
    lines.append(f"\nRecords: `{OBJECTIVES}/<preset>/posttrain-s<seed>/bench.json`; each row ran "
                 "the default recipe with " + "; ".join(runs_with) + ".")
    return "\n".join(lines) + "\n"


PERSTEP = "benchmarks/results/perstep-2026-12-07"


def perstep_row(label: str, runs: list[dict]) -> str:
    """One side over 20 steps: mean training reward, held-out every 5 steps, 3-digit, entropy."""
    held = [pct([at_step(r, s) for r in runs]) for s in (5, 10, 15)]
    last = " / ".join(f"{100 * at_step(r, 20):.1f}" for r in runs)
    entropy = statistics.mean(r["entropy"][19] for r in runs)
    return (f"| {label} ({len(runs)} seed{'s' * (len(runs) > 1)}) | "
            f"{mean_sd([statistics.mean(r['reward'][:20]) for r in runs])} | " + " | ".join(held) +
            f" | **{pct([at_step(r, 20) for r in runs])}** ({last}) | "
            f"{pct([r['final']['3digit']['accuracy'] for r in runs])} | {entropy:.2f} | "
            f"{median_step_s(runs):.1f} |")


def perstep_table(root: Path) -> str:
    """posttrain against TRL's GRPOTrainer per step, the same recipe at a constant lr."""
    folder = root / PERSTEP
    return "\n".join([
        "| side | mean training reward, steps 1-20 | held-out step 5 | step 10 | step 15 | "
        "**step 20** (per seed) | 3-digit | entropy step 20 | s/step (median) |", "|---" * 9 + "|",
        perstep_row("posttrain", load_runs(folder)),
        perstep_row("TRL 1.16 GRPOTrainer", load_runs(folder, "trl")),
        "",
        f"Records: `{PERSTEP}/posttrain-s<seed>/bench.json` and `trl-s<seed>.json`.",
    ]) + "\n"


LECTURE = "benchmarks/results/lecture-2026-12-04"


def lecture_numbers(root: Path, name: str) -> dict:
    """One experiment's numbers and its wall time (`posttrain experiment NAME` writes NAME.json)."""
    record = json.loads((root / LECTURE / f"{name}.json").read_text())
    return {**record["numbers"], "wall_min": record["wall_s"] / 60}


def pm(value: float | None, se: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} ± {se:.{digits}f}"


def lecture_baselines_table(root: Path) -> str:
    """Each baseline's gradient variance and its expectation against no baseline."""
    n = lecture_numbers(root, "baselines")
    lines = ["| advantage | tr Cov(g), relative to none | variance reduction | E[g] along E[g_none] "
             "(± SE) | theory | cosine of E[g] with E[g_none] (± SE) |", "|---" * 6 + "|"]
    none = n["arms"]["none"]["variance"]
    for arm, a in n["arms"].items():
        theory = "-" if a["expected_scale"] is None else f"{a['expected_scale']:.3f}"
        lines.append(f"| {arm} | {a['variance'] / none:.3f} | {a['variance_reduction']:.1f}x | "
                     f"{pm(a['scale'], a['scale_se'])} | {theory} | "
                     f"{pm(a['cosine'], a['cosine_se'])} |")
    return "\n".join([*lines, "", f"{n['batches']} batches of {n['answers_per_batch']} answers "
                       f"(groups of {n['group_size']}), mean reward {n['mean_reward']:.3f}, "
                       f"{100 * n['all_equal_groups']:.0f}% of groups all-equal; "
                       f"{n['wall_min']:.1f} minutes. Record: `{LECTURE}/baselines.json`."]) + "\n"


def lecture_is_table(root: Path) -> str:
    """The drift from pi_old over epochs on one batch, with and without the clip."""
    n = lecture_numbers(root, "importance-sampling")
    arms = list(n["arms"])
    epochs = sorted({0, 1, 2, 4, 8, n["epochs"]} & set(range(n["epochs"] + 1)))
    cols = ["KL(pi_old‖pi)", "ratio sd", "outside band", "ESS"]
    lines = ["| epochs done | " + " | ".join(f"{arm}: {c}" for arm in arms for c in cols) + " |",
             "|---" * (1 + len(cols) * len(arms)) + "|"]
    for e in epochs:
        cells = []
        for arm in arms:
            r = n["arms"][arm][e]
            cells += [f"{r['approx_kl_old']:.4f}", f"{r['ratio_sd']:.3f}",
                      f"{100 * r['outside_band']:.1f}%", f"{100 * r['ess_share']:.0f}%"]
        lines.append(f"| {e} | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", f"One batch of {n['answers']} answers ({n['tokens']} tokens, "
                       f"{n['answers_with_signal']} with a non-zero advantage), lr {n['lr']:g}, "
                       f"clip band {n['clip_band'][0]:.1f}-{n['clip_band'][1]:.1f}; "
                       f"{n['wall_min']:.1f} minutes. "
                       f"Record: `{LECTURE}/importance-sampling.json`."]) + "\n"


def lecture_kl_table(root: Path) -> str:
    """Each KL estimator's value against the exact KL, and where its gradient points."""
    n = lecture_numbers(root, "kl-estimators")
    lines = ["| drift | exact KL(pi‖ref) per token | estimator | bias of the value (± SE) | sd per "
             "token | a: grad KL(pi‖ref) (± SE) | b: grad KL(ref‖pi) (± SE) |", "|---" * 7 + "|"]
    for drift, row in n["drifts"].items():
        for name, e in row["estimators"].items():
            lines.append(f"| {drift} | {row['exact_reverse_kl']:.4f} | {name} | "
                         f"{pm(e['bias'], e['bias_se'], 4)} | {e['sd_per_token']:.4f} | "
                         f"{pm(e['coef_reverse'], e['coef_reverse_se'], 2)} | "
                         f"{pm(e['coef_forward'], e['coef_forward_se'], 2)} |")
    tokens = next(iter(n["drifts"].values()))["tokens"]
    return "\n".join([*lines, "", f"{n['batches']} batches of {n['answers_per_batch']} answers "
                       f"({tokens} tokens); {n['wall_min']:.1f} minutes. "
                       f"Record: `{LECTURE}/kl-estimators.json`."]) + "\n"


SEEDS = (0, 1, 2)   # the experiments read over seeds, one record each


def spread(values: list[float | None], signed: bool = True, digits: int = 2, unit: str = "") -> str:
    """Mean ± sd over the seeds that have a value, saying how many where not all do (an arm
    that trained on nothing in a run's last quarter has no entropy there); '-' where none does."""
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    m = sum(present) / len(present)
    sd = (sum((v - m) ** 2 for v in present) / max(len(present) - 1, 1)) ** 0.5
    text = (f"{m:+.{digits}f} ± {sd:.{digits}f}" if signed else f"{m:.{digits}f} ± {sd:.{digits}f}") + unit
    return text + (f" ({len(present)} of {len(values)} seeds)" if len(present) < len(values) else "")


def span(values: list[float]) -> str:
    lo, hi = f"{min(values):.0f}", f"{max(values):.0f}"
    return lo if lo == hi else f"{lo}-{hi}"


def per_seed(values: list[float | None], digits: int = 2) -> str:
    return " / ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def lecture_length_table(root: Path) -> str:
    """Each arm's per-token weight against length (exact) and one small step's effect on the mean
    lengths of wrong and correct answers and the accuracy: all pairs of the 3 seeds pooled
    (jackknife SE over pairs), and the change against Dr. GRPO's on the same answers per seed."""
    import torch

    from posttrain.experiments.length_bias import pooled_change

    runs = seed_records(root, "length-bias")
    nums = [r["numbers"] for r in runs]
    ref = nums[0]["reference"]
    stack = lambda arm: torch.tensor([p for n in nums for p in n["pair_sums"][arm]],  # noqa: E731
                                     dtype=torch.float64)
    lines = [f"| arm | first step shared with | per-token weight of a wrong answer "
             f"per unit of r - group mean ∝ length^slope | Δ mean length, wrong answers (tokens) | Δ mean length, wrong, minus "
             f"{ref}'s (same answers) | the same, per seed | Δ mean length, correct answers | "
             f"Δ accuracy (pp) |", "|---" * 8 + "|"]
    for arm in nums[0]["arms"]:
        a = [n["arms"][arm] for n in nums]
        own, vs = pooled_change(stack(arm), stack("before")), pooled_change(stack(arm), stack(ref))
        slopes = [x["weight_length_slope"] for x in a if x["weight_length_slope"] is not None]
        slope = f"{sum(slopes) / len(slopes):+.2f}" if slopes else "n/a"
        per_seed = " / ".join("n/a" if x["vs_reference_len_wrong"] is None
                              else f"{x['vs_reference_len_wrong']:+.3f}" for x in a)
        acc = own["accuracy"] or (None, None)
        lines.append(f"| {arm} | {a[0]['same_step_as'] or '-'} | {slope} | "
                     f"{pm(*(own['len_wrong'] or (None, None)))} | "
                     f"{pm(*(vs['len_wrong'] or (None, None)))} | {per_seed} | "
                     f"{pm(*(own['len_correct'] or (None, None)))} | "
                     f"{pm(acc[0] and 100 * acc[0], acc[1] and 100 * acc[1], 2)} |")
    before = [n["before"] for n in nums]
    n0, pairs = nums[0], sum(n["pairs"] for n in nums)
    return "\n".join([*lines, "", f"Seeds {', '.join(map(str, SEEDS))}: {pairs} pairs of "
                       f"batches of {n0['answers_per_batch']} answers (one to step on, one to "
                       f"measure on), pooled, ± jackknife SE over pairs; a step of L2 length "
                       f"{n0['step_l2']:g} moves log pi of an answer by "
                       f"{sum(n['arms']['grpo']['mean_abs_delta_logp'] for n in nums) / len(nums):.3f} "
                       f"on average (GRPO's). Before the "
                       f"step, wrong answers averaged "
                       f"{sum(x['len_wrong'] for x in before) / len(before):.1f} tokens and correct "
                       f"ones {sum(x['len_correct'] for x in before) / len(before):.1f} (at most "
                       f"{n0['max_new_tokens']}), accuracy "
                       f"{100 * sum(x['accuracy'] for x in before) / len(before):.0f}%; "
                       f"{minutes_a_seed(runs):.1f} minutes a seed. "
                       f"Records: `{LECTURE}/length-bias-s<seed>/length-bias.json`."]) + "\n"


def minutes_a_seed(runs: list[dict]) -> float:
    """The mean wall time of an experiment's records, in minutes."""
    return sum(r["wall_s"] for r in runs) / 60 / len(runs)


def seed_records(root: Path, name: str) -> list[dict]:
    """`posttrain experiment NAME --seed S` records, one folder a seed (NAME-s<seed>)."""
    return [json.loads((root / LECTURE / f"{name}-s{s}" / f"{name}.json").read_text())
            for s in SEEDS]


def training_arms_footer(lines: list[str], runs: list[dict], name: str, setting: str) -> str:
    """The table of a training-arm experiment with the line under it: seeds, steps, the
    experiment's own setting, held-out accuracy before, minutes a seed, the records."""
    nums = [r["numbers"] for r in runs]
    n0 = nums[0]
    before = [100 * n["arms"][arm]["eval_before"] for n in nums for arm in n["arms"]]
    return "\n".join([*lines, "", f"Seeds {', '.join(map(str, SEEDS))} (mean ± sd over "
                       f"seeds): {n0['steps']} steps of {n0['answers_per_step']} answers, "
                       f"{setting}, lr {n0['lr']:g} constant, {n0['eval_size']} held-out "
                       f"problems ({span(before)}% before); "
                       f"{minutes_a_seed(runs):.1f} minutes a seed. "
                       f"Records: `{LECTURE}/{name}-s<seed>/{name}.json`."]) + "\n"


def lecture_clip_higher_table(root: Path) -> str:
    """Entropy, clipped shares, reward and held-out accuracy with each upper clip and each newer
    objective, 3 seeds."""
    runs = seed_records(root, "clip-higher")
    nums = [r["numbers"] for r in runs]
    lines = ["| arm | what bounds the update | entropy, first step with an update | entropy, last "
             "quarter of the steps | the same, per seed | tokens clipped high (mean over steps) | "
             "tokens clipped low | training reward, last quarter | held-out accuracy after (%) | "
             "the same, per seed |", "|---" * 10 + "|"]
    for arm in nums[0]["arms"]:
        a = [n["arms"][arm] for n in nums]
        first = [next((v for v in x["entropy"] if v is not None), None) for x in a]
        last = [x["entropy_last_quarter"] for x in a]
        after = [100 * x["eval_after"] for x in a]
        lines.append(
            f"| {arm} | {a[0]['bound']} | "
            f"{spread(first, signed=False)} | {spread(last, signed=False)} | {per_seed(last)} | "
            f"{clipped_share(a, 'high')} | {clipped_share(a, 'low')} | "
            f"{spread([x['reward_last_quarter'] for x in a], signed=False)} | "
            f"{spread(after, signed=False, digits=1)} | {per_seed(after, 0)} |")
    n0 = nums[0]
    return training_arms_footer(lines, runs, "clip-higher",
                                f"{n0['minibatches']} minibatch updates a step")


def lecture_length_training_table(root: Path) -> str:
    """The lengths of wrong and correct answers over training under each aggregation, 3 seeds:
    first and last quarter of the steps, the last quarter's wrong length against Dr. GRPO's
    (same seed, same start), accuracy sampled and held-out after."""
    runs = seed_records(root, "length-training")
    nums = [r["numbers"] for r in runs]
    ref = "dr_grpo"
    lines = ["| arm | aggregation | wrong answers' mean length, first quarter of the steps | "
             "last quarter | the same, per seed | last quarter minus dr_grpo's, per seed | "
             "correct answers' mean length, first quarter | last quarter | accuracy of the "
             "answers sampled, last quarter | held-out accuracy after (%) |", "|---" * 10 + "|"]
    for arm in nums[0]["arms"]:
        a = [n["arms"][arm] for n in nums]
        last = [x["length_wrong_last_quarter"] for x in a]
        gap = [None if v is None or n["arms"][ref]["length_wrong_last_quarter"] is None
               else v - n["arms"][ref]["length_wrong_last_quarter"] for v, n in zip(last, nums)]
        lines.append(
            f"| {arm} | {a[0]['algorithm']['aggregation']} | "
            f"{spread([x['length_wrong_first_quarter'] for x in a], signed=False, digits=1)} | "
            f"{spread(last, signed=False, digits=1)} | {per_seed(last, 1)} | "
            f"{'-' if arm == ref else per_seed(gap, 1)} | "
            f"{spread([x['length_correct_first_quarter'] for x in a], signed=False, digits=1)} | "
            f"{spread([x['length_correct_last_quarter'] for x in a], signed=False, digits=1)} | "
            f"{spread([x['accuracy_last_quarter'] for x in a], signed=False)} | "
            f"{spread([100 * x['eval_after'] for x in a], signed=False, digits=1)} |")
    return training_arms_footer(lines, runs, "length-training",
                                f"up to {nums[0]['max_new_tokens']} new tokens, no stop string")


def clipped_share(arms: list[dict], side: str) -> str:
    """The share of tokens whose gradient the `side` bound removed (mean over steps, mean ± sd
    over seeds); CISPO's tokens whose weight was capped (their gradient kept) marked as such;
    '-' where the objective has no such bound (SAPO's soft gate)."""
    for key, note in ((f"clip_frac_{side}_mean", ""), ("weight_capped_mean", " capped, kept")):
        values = [x.get(key) for x in arms]
        if (side == "high" or not note) and any(v is not None for v in values):
            return spread([None if v is None else 100 * v for v in values], signed=False,
                          unit="%") + note
    return "-"


def reward_within(arm: dict, seconds: float, last: int = 3) -> float:
    """The mean reward of the answers sampled in the last `last` steps an arm finished within
    `seconds` of training (the arms compared at equal time)."""
    done, kept = 0.0, []
    for step_s, reward in zip(arm["step_s"], arm["generated_reward"]):
        done += step_s or 0.0
        if done > seconds:
            break
        kept.append(reward)
    return sum(kept[-last:]) / len(kept[-last:]) if kept else 0.0


def lecture_dynamic_table(root: Path) -> str:
    """All-equal groups, generation, time and learning without and with dynamic sampling."""
    runs = seed_records(root, "dynamic-sampling")
    nums = [r["numbers"] for r in runs]
    lines = ["| dynamic sampling | all-equal groups among those sampled first | answers "
             "generated a step | seconds a step | reward of the sampled answers, last quarter | "
             "the same at equal time (last 3 steps within the seconds 'off' trained) | "
             "held-out accuracy after (%) | the same, per seed |", "|---" * 8 + "|"]
    budget = [sum(v or 0.0 for v in n["arms"]["off"]["step_s"]) for n in nums]
    for arm in nums[0]["arms"]:
        a = [n["arms"][arm] for n in nums]
        after = [100 * x["eval_after"] for x in a]
        equal_time = [reward_within(x, t) for x, t in zip(a, budget)]
        lines.append(
            f"| {arm} | {spread([100 * x['equal_groups_mean'] for x in a], signed=False, digits=1)}% | "
            f"{spread([x['generated_per_step'] for x in a], signed=False, digits=0)} | "
            f"{spread([x['step_s_mean'] for x in a], signed=False, digits=1)} | "
            f"{spread([x['generated_reward_last_quarter'] for x in a], signed=False)} | "
            f"{spread(equal_time, signed=False)} | "
            f"{spread(after, signed=False, digits=1)} | {per_seed(after, 0)} |")
    n0 = nums[0]
    return training_arms_footer(lines, runs, "dynamic-sampling",
                                f"at most {n0['max_refill_rounds']} refill rounds a step")


def accuracy_at(arm: dict, step: int) -> float | None:
    """An arm's held-out accuracy (%) at the evaluation after `step` (None if none there)."""
    return next((100 * a for s, a in zip(arm["eval_steps"], arm["eval_accuracy"]) if s == step), None)


OPD_STEPS = (0, 2, 4, 6, 8, 10, 20, 30)


def per_seed_reached(reached: list[dict], show) -> str:
    """`show(r)` of each seed's first evaluation at the target, or 'not reached'."""
    return " / ".join("not reached" if r["step"] is None else show(r) for r in reached)   # the evaluations shown (both arms evaluate every 2 steps)


def step_seconds(nums: list[dict], arm: str) -> float:
    """An arm's mean seconds a training step over all seeds' steps."""
    return sum(n["arms"][arm]["seconds"] for n in nums) / sum(len(n["arms"][arm]["step"]) for n in nums)


def lecture_opd_table(root: Path) -> str:
    """Held-out accuracy by step of GRPO and of OPD taught by GRPO's own result; the step and
    the training minutes at which each first reaches 90% of that teacher's accuracy."""
    runs = seed_records(root, "opd-vs-grpo")
    nums = [r["numbers"] for r in runs]
    lines = ["| arm | answers a step | " + " | ".join(f"step {s}" for s in OPD_STEPS)
             + " | first at 90% of the teacher, per seed: step | training minutes | answers "
             "sampled |", "|---" * (len(OPD_STEPS) + 5) + "|"]
    for arm in nums[0]["arms"]:
        a = [n["arms"][arm] for n in nums]
        cells = []
        for step in OPD_STEPS:
            acc = [accuracy_at(x, step) for x in a]
            cells.append("-" if None in acc else f"{spread(acc, signed=False, digits=1)}%")
        reached = [x["reached"] for x in a]
        answers = nums[0]["answers_per_step"][arm]
        steps = per_seed_reached(reached, lambda r: str(r["step"]))
        minutes = per_seed_reached(reached, lambda r: f"{r['minutes']:.1f}")
        sampled = per_seed_reached(reached, lambda r: str(r["step"] * answers))
        lines.append(f"| {arm} | {answers} | {' | '.join(cells)} | {steps} | {minutes} | {sampled} |")
    teacher = [100 * n["teacher_accuracy"] for n in nums]
    n0 = nums[0]
    return "\n".join([*lines, "", f"Seeds {', '.join(map(str, SEEDS))} (mean ± sd over seeds): "
                       f"GRPO {n0['rl_steps']} steps of the default recipe, whose final model "
                       f"(held-out {per_seed(teacher, 0)}% per seed) teaches OPD for "
                       f"{n0['opd_steps']} steps; {n0['eval_size']} held-out problems, greedy; "
                       f"training minutes are the step times summed (evaluations left out): "
                       f"a step took {step_seconds(nums, 'grpo'):.0f} s (GRPO) and "
                       f"{step_seconds(nums, 'opd'):.0f} s (OPD, with the teacher's forward) on "
                       f"average; {minutes_a_seed(runs):.1f} minutes a seed "
                       f"in all. Records: `{LECTURE}/opd-vs-grpo-s<seed>/opd-vs-grpo.json`."]) + "\n"


def lecture_hacking_table(root: Path) -> str:
    """Per seed on record: the reward model's held-out ranking, then the policy trained on its
    score: the score and the true accuracy of the sampled answers over training, held-out
    accuracy at each evaluation, the same recipe on the verifier's reward from the same seed
    (opd-vs-grpo's GRPO arm) where that record exists, and the largest share of one answer."""
    seeds = [s for s in SEEDS if (root / LECTURE / f"reward-hacking-s{s}" / "reward-hacking.json").exists()]
    lines = ["| seed | reward model: held-out pairs ranked (correct > wrong) | score of the "
             "sampled answers, first → last quarter | score of right minus wrong answers, last "
             "quarter | true accuracy of the sampled answers: first quarter, peak (step), last "
             "quarter | held-out accuracy at steps 0 / 10 / 20 / 30 / 40 | the same recipe on "
             "the verifier's reward, steps 10 / 20 / 30 | largest share of held-out problems "
             "given one answer, at the end |", "|---" * 8 + "|"]
    runs = []
    for seed in seeds:
        r = json.loads((root / LECTURE / f"reward-hacking-s{seed}" / "reward-hacking.json").read_text())
        runs.append(r)
        n = r["numbers"]
        rm, x = n["reward_model"], n["arms"]["policy"]
        tail = max(len(x["step"]) // 4, 1)
        gaps = [c - w for c, w in zip(x["model_score_correct"][-tail:], x["model_score_incorrect"][-tail:])
                if c is not None and w is not None]
        held = " / ".join(f"{100 * a:.0f}" for a in x["eval_accuracy"])
        control = root / LECTURE / f"opd-vs-grpo-s{seed}" / "opd-vs-grpo.json"
        verifier = "-"
        if control.exists():
            grpo = json.loads(control.read_text())["numbers"]["arms"]["grpo"]
            verifier = " / ".join(f"{accuracy_at(grpo, s):.0f}" for s in (10, 20, 30))
        lines.append(
            f"| {seed} | {100 * rm['held_out_pairs_ranked']:.0f}% "
            f"({100 * rm['eval_after']['rm/eval_accuracy@correct>wrong']:.0f}%) | "
            f"{x['score_first_quarter']:+.2f} → {x['score_last_quarter']:+.2f} | "
            f"{sum(gaps) / len(gaps):+.2f} | "
            f"{100 * x['accuracy_first_quarter']:.0f}%, {100 * x['accuracy_peak']:.0f}% "
            f"({x['accuracy_peak_step']}), {100 * x['accuracy_last_quarter']:.0f}% | "
            f"{held} | {verifier} | {100 * x['collapse'][-1]['top_share']:.0f}% |")
    n0 = runs[0]["numbers"]
    rm0 = n0["reward_model"]
    return "\n".join([*lines, "", f"Reward model: a score head trained on {rm0['pairs']} "
                       f"synthetic pairs ({rm0['eval_pairs']} held out); policy: GRPO, "
                       f"{n0['steps']} steps of {n0['answers_per_step']} answers on the "
                       f"normalised score alone, no KL; {n0['eval_size']} held-out problems, "
                       f"greedy (%); scores are the reward model's normalised output; "
                       f"{minutes_a_seed(runs):.1f} minutes a seed. "
                       f"Records: `{LECTURE}/reward-hacking-s<seed>/reward-hacking.json` (the "
                       f"verifier's column: `opd-vs-grpo-s<seed>`)."]) + "\n"

VIEWER = "benchmarks/results/viewer-2026-12-04"


def viewer_table(root: Path) -> str:
    """The per-token records' disk cost and the viewer's load time on a 1,000-step run
    (benchmarks/viewer_load.py)."""
    f = json.loads((root / VIEWER / "viewer.json").read_text())["figures"]
    return "\n".join([
        "| responses recorded a step | disk a step | 1,000 steps: tokens/ + metrics.jsonl | "
        "page ready (median of 5 loads) | switching to another step |",
        "|---" * 5 + "|",
        f"| {f['responses_per_step']:.0f} (default `--log_tokens 8`) | {f['bytes_per_step'] / 1e3:.1f} KB | "
        f"{f['tokens_folder_bytes'] / 1e6:.1f} MB + {f['metrics_bytes'] / 1e6:.1f} MB | "
        f"{f['page_ready_s']:.2f} s | {f['step_switch_s']:.2f} s |",
        "",
        f"Measured on a GRPO run of the default recipe ({f['real_steps']} steps recorded, answers "
        "of up to 24 tokens), its records repeated to 1,000 steps, in headless Chromium on 2 "
        f"CPU cores. Record: `{VIEWER}/viewer.json`.",
    ]) + "\n"


VLLM_CPU = "benchmarks/results/vllm-cpu-2026-12-05"
VLLM_ARMS = {"generate": "`generate` in the trainer's process (the default)",
             "vllm": "vLLM in process (`--rollout.backend vllm`)",
             "vllm-server": "vLLM as a server (`--rollout.vllm_launch 1`)"}


def median_of(runs: list[dict], key: str) -> float | None:
    """The median of a per-step figure over every step of every seed but each run's first."""
    values = [x for r in runs for x in (r.get(key) or [])[1:] if x is not None]
    return statistics.median(values) if values else None


def vllm_cpu_row(label: str, runs: list[dict]) -> str:
    cells = [median_of(runs, k) for k in ("step_s", "generate_s", "weight_push_s", "update_s",
                                          "generated_tokens_per_s", "logp_mismatch")]
    step, gen, push, update, tps, mismatch = cells
    steps = [r["eval_steps"][-1] for r in runs]
    same = pct([r["final"]["2digit"]["accuracy"] for r in runs])
    return (f"| {label} | **{pct([r['eval_accuracy'][-1] for r in runs])}** ({per_seed_end(runs)}) | "
            f"{same} | {mean_sd(steps, digits=0)} | {step:.2f} | {gen:.2f} ({tps:.0f}) | {push or 0:.2f} | "
            f"{update:.2f} | {max(r['peak_tree_gb'] for r in runs):.1f} GB | "
            f"{'-' if mismatch is None else f'{mismatch:.3f}'} |")


def vllm_cpu_table(root: Path) -> str:
    """The default job with each sampler, side by side over the same seeds: held-out after 10
    training minutes, the steps that fit, the median step and its parts, tokens/s, the peak memory
    of the trainer and its engine processes together, the trainer-vs-sampler log-prob mismatch."""
    arms = {name: load_runs(root / VLLM_CPU / name) for name in VLLM_ARMS}
    seeds = ", ".join(str(r["seed"]) for r in arms["generate"])
    return "\n".join([
        f"| the default job, seeds {seeds} | held-out after 10 min, its own sampler (per seed: % "
        "(steps)) | the final model, `generate` | steps | s a step | generation s (tokens/s) | "
        "weight push s | update s | peak memory, all processes | mean abs log-prob mismatch |",
        "|---" * 10 + "|",
        *[vllm_cpu_row(label, arms[name]) for name, label in VLLM_ARMS.items()],
        "",
        "Held-out: 200 2-digit problems, greedy; first by the run's own evaluator on the sampler "
        "it trained with, then the saved final model by `benchmarks/heldout.py` (plain "
        "transformers `generate` in float32: one yardstick for every arm). Medians over every "
        "step but each run's first; memory is the peak of the trainer and every engine process "
        f"together (PSS). Records: `{VLLM_CPU}/<arm>/posttrain-s<seed>/bench.json`.",
    ]) + "\n"


VLLM_MISMATCH = {"mismatch-fp32": "float32 (`--model.autocast none`)",
                 "mismatch-bf16": "bfloat16 (the default: trainer under bf16 autocast)"}


def vllm_mismatch_table(root: Path) -> str:
    """How far vLLM's log-probs of its own samples are from the trainer's, with both in float32
    and both in bf16 (benchmarks/record.py runs of the default job on vLLM in process)."""
    lines = ["| trainer and engine in | mean abs log-prob mismatch (median over steps) | largest "
             "importance ratio pi_trainer / pi_engine | tokens with the ratio capped |",
             "|---" * 4 + "|"]
    for name, label in VLLM_MISMATCH.items():
        (root / VLLM_CPU / name / "record.json").read_text()   # (its provenance: under the table)
        rows = [json.loads(line) for line in open(root / VLLM_CPU / name / "metrics.jsonl")
                if line.strip()]
        train = [r for r in rows if "rollout/logp_mismatch" in r]
        lines.append(
            f"| {label} | {statistics.median(r['rollout/logp_mismatch'] for r in train):.2g} | "
            f"{max(r['rollout/is_ratio_max'] for r in train):.5f} | "
            f"{100 * statistics.mean(r['rollout/tis_capped_frac'] for r in train):.2f}% |")
    steps = max(r["step"] for r in rows if "step" in r)
    return "\n".join([*lines, "", f"{steps} steps of the default job each, seed 0 (a step whose "
                       "groups all scored alike trains on nothing and reads no mismatch). Records: "
                       f"`{VLLM_CPU}/mismatch-fp32/`, `{VLLM_CPU}/mismatch-bf16/` (record.json, "
                       "metrics.jsonl)."]) + "\n"


ASYNC_CPU = "benchmarks/results/async-cpu-2026-12-05"
ASYNC_ARMS = {"k0": "K = 0: sample, then update (vLLM in process)",
              "k1": "K = 1", "k2": "K = 2",
              "k1-nocorr": "K = 1, no correction (`--rollout.tis_cap null`)",
              "k2-nocorr": "K = 2, no correction",
              "k2-dppo": "K = 2, DPPO (`--algorithm.policy_loss dppo_tv --algorithm.dppo_ratio_cap 2`)",
              "k1-split": "K = 1, engine on core 1, trainer on core 0 (`rollout.async_cpu_split`)",
              "k2-split": "K = 2, engine on core 1, trainer on core 0"}


def async_row(label: str, runs: list[dict], step: int) -> str:
    med = {k: median_of(runs, k) for k in ("step_s", "trainer_wait_s", "engine_idle_s",
                                           "generate_s", "update_s")}
    stale = [x for r in runs for x in (r.get("staleness") or [])[1:] if x is not None]
    dropped = sum(x or 0 for r in runs for x in (r.get("dropped_batches") or []))
    steps = [r["eval_steps"][-1] for r in runs]
    return (f"| {label} | {len(runs)} | **{pct([r['eval_accuracy'][-1] for r in runs])}** "
            f"({per_seed_end(runs)}) | {pct_at_step(runs, step)} | {mean_sd(steps, digits=0)} | "
            f"{med['step_s']:.2f} | {med['trainer_wait_s']:.2f} | {med['engine_idle_s']:.2f} | "
            f"{med['generate_s']:.2f} | {med['update_s']:.2f} | "
            f"{statistics.mean(stale) if stale else 0:.2f} | {dropped} |")


def async_cpu_table(root: Path) -> str:
    """The default job on vLLM in process with the engine sampling K batches ahead, side by side
    over the same seeds and training minutes: held-out at the end and at equal steps, the step
    and its waits, the staleness trained on, the batches dropped."""
    arms = {name: load_runs(root / ASYNC_CPU / name) for name in ASYNC_ARMS}
    arms = {name: runs for name, runs in arms.items() if runs}
    if not arms:
        return f"(no records under `{ASYNC_CPU}` yet: `bash benchmarks/async_cpu.sh`)\n"
    step = 20   # (held-out per step: the evaluation most runs reached; fewer seeds are said)
    return "\n".join([
        "| the default job on vLLM, 3 training minutes | seeds | held-out at the end (per seed: % "
        f"(steps)) | held-out at step {step} | steps | s a step | trainer waits s | engine idle s | "
        "generation s | update s | mean staleness | batches dropped |",
        "|---" * 12 + "|",
        *[async_row(ASYNC_ARMS[name], runs, step) for name, runs in arms.items()],
        "",
        "Held-out: 200 2-digit problems, greedy, by the run's own evaluator every 10 steps "
        "(evaluation time is not training time). Medians over every step but each run's first: "
        "`trainer waits` is the time a step waited for its batch, `engine idle` the time the "
        "engine waited for room (or, at K = 0, through the update and push); `generation` is the "
        "engine's time for the step's batch, which at K >= 1 runs beside the update. Mean "
        "staleness: updates between the weights that sampled a batch and those trained on it, "
        "over every step but the first. Records: "
        f"`{ASYNC_CPU}/<arm>/posttrain-s<seed>/bench.json`.",
    ]) + "\n"


RECORD_NAMES = ("bench.json", "record.json")   # and an experiment's NAME.json, TRL's trl-s<seed>.json


def is_record(path: Path, data) -> bool:
    """A measurement a table is read from (not a config, summary or sweep description beside it)."""
    return isinstance(data, dict) and ("provenance" in data or path.name in RECORD_NAMES
                                       or path.name.startswith("trl-s") or "experiment" in data)


@contextlib.contextmanager
def reads() -> Iterator[list[Path]]:
    """The files read while a table renders (its records among them)."""
    seen: list[Path] = []
    real_read, real_open = Path.read_text, builtins.open

    def read(self: Path, *args, **kwargs) -> str:
        seen.append(self)
        return real_read(self, *args, **kwargs)

    def open_(file, *args, **kwargs):
        seen.append(Path(file))
        return real_open(file, *args, **kwargs)
    Path.read_text, builtins.open = read, open_
    try:
        yield seen
    finally:
        Path.read_text, builtins.open = real_read, real_open


# From the commit that moved provenance.py into posttrain/run/ (0039256) to the one that fixed its
# ROOT (e056829), git ran in the package folder, where `git status -- posttrain benchmarks` names
# nothing: a record of those days reads `dirty: false` whatever its tree was
BLIND_FLAG = ("2026-12-05T11:06:00+00:00", "2026-12-06T22:29:00+00:00")


def flag_unverified(prov: dict) -> bool:
    """A record whose `dirty: false` was written while the flag could not see edits."""
    date = datetime.datetime.fromisoformat(str(prov.get("date", "")) or "1970-01-01T00:00:00+00:00")
    start, end = (datetime.datetime.fromisoformat(t) for t in BLIND_FLAG)
    return prov.get("dirty") is False and start <= date <= end


def provenance_line(paths: list[Path]) -> str:
    """One line under a table: how many records it reads, their commits, and which came from a
    tree with uncommitted changes, carry no provenance at all, or say clean when that could not
    be seen (BLIND_FLAG)."""
    commits: dict[str, None] = {}
    n = dirty = unknown = missing = blind = 0
    for path in dict.fromkeys(p for p in paths if p.suffix == ".json" and p.is_file()):
        data = json.loads(path.read_text())
        if not is_record(path, data):
            continue
        n += 1
        prov = data.get("provenance")
        if not prov:
            missing += 1
            continue
        commits[str(prov.get("commit"))[:7]] = None
        dirty += prov.get("dirty") is True
        unknown += prov.get("dirty") is None
        blind += flag_unverified(prov)
    if not n:
        return "Provenance: this table reads no record file (see the records named above)."
    parts = [f"Provenance: {n} record{'s' * (n != 1)}"
             + (f", commit{'s' * (len(commits) != 1)} " + ", ".join(f"`{c}`" for c in commits)
                if commits else "")]
    if dirty:
        parts.append(f"{dirty} run from a tree with uncommitted changes")
    if unknown:
        parts.append(f"{unknown} from a tree not known to be clean")
    if missing:
        parts.append(f"{missing} without provenance (written before records carried it)")
    if blind:
        parts.append(f"{blind} marked clean while that flag could not see edits (2026-12-05 11:06 "
                     "to 2026-12-06 22:29 UTC: CHANGELOG)")
    if not dirty and not unknown and not missing and not blind:
        parts.append("every one run from a clean tree")
    return "; ".join(parts) + "."


def with_provenance(render: Callable[[Path], str]) -> Callable[[Path], str]:
    """`render`, with the provenance line of the records it read appended."""
    def table(root: Path) -> str:
        with reads() as seen:
            text = render(root)
        return text.rstrip("\n") + "\n\n" + provenance_line(seen) + "\n"
    return table


TABLES: dict[str, Callable[[Path], str]] = {
    "lecture-baselines": lecture_baselines_table, "lecture-is": lecture_is_table,
    "lecture-kl": lecture_kl_table, "lecture-length": lecture_length_table,
    "lecture-length-training": lecture_length_training_table,
    "lecture-clip-higher": lecture_clip_higher_table, "lecture-dynamic": lecture_dynamic_table,
    "lecture-opd": lecture_opd_table, "lecture-hacking": lecture_hacking_table,
    "default": default_table, "presets": presets_table, "opd": opd_table, "opsd": opsd_table,
    "lora": lora_table, "gpu": gpu_table, "guess-number": guess_number_table, "chain-sum": chain_sum_table, "rlhf": rlhf_table, "mopd": mopd_table, "dpo": dpo_table, "ppo-rlhf": ppo_rlhf_table,
    "objectives": objectives_table, "perstep": perstep_table, "viewer": viewer_table,
    "vllm-cpu": vllm_cpu_table, "vllm-mismatch": vllm_mismatch_table,
    "async-cpu": async_cpu_table, "ecosystem-envs": ecosystem_envs_table,
    "artifacts": artifacts_table, "vllm-idle": vllm_idle_table,
    "tinker-cookbook": tinker_cookbook_table,
    "tinker-cookbook-sl": tinker_cookbook_sl_table, "tinker-clients": tinker_clients_table,
    "tinker-sampling": tinker_sampling_table,
    "ecosystem-judge": ecosystem_judge_table,
}


def render_page(text: str, root: Path) -> str:
    """The page with each table block replaced by what its records render."""
    def fill(m: re.Match) -> str:
        if m["name"] not in TABLES:
            raise KeyError(f"table {m['name']!r} has no renderer; known: {sorted(TABLES)}")
        return m.group(1) + with_provenance(TABLES[m["name"]])(root) + m.group(4)
    return BLOCK.sub(fill, text)


MARKER = re.compile(r"<!-- table: (?P<name>[\w-]+) -->|<!-- /table -->")


def marker_problems(text: str) -> list[str]:
    """Table markers that do not pair up: a table not closed before the next one opens (BLOCK
    would swallow the next one's marker), a close without its table, a table never closed."""
    problems, open_name = [], None
    for m in MARKER.finditer(text):
        if m["name"] is not None:
            if open_name is not None:
                problems.append(f"table {open_name!r} is not closed before table {m['name']!r}")
            open_name = m["name"]
        else:
            if open_name is None:
                problems.append("'<!-- /table -->' without its '<!-- table: NAME -->'")
            open_name = None
    if open_name is not None:
        problems.append(f"table {open_name!r} is never closed")
    return problems


def pages(root: Path) -> list[Path]:
    return sorted([root / "README.md", *(root / "docs").glob("*.md")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a table differs")
    args = ap.parse_args()
    stale = []
    for page in pages(ROOT):
        text = page.read_text()
        if marker_problems(text):
            sys.exit(f"{page.relative_to(ROOT)}: " + "; ".join(marker_problems(text)))
        new = render_page(text, ROOT)
        if new != text:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    verb = "differ from their records" if args.check else "rewritten from their records"
    print(f"{len(stale)} page(s) {verb}: {', '.join(map(str, stale)) or '-'}")
    sys.exit(1 if args.check and stale else 0)


if __name__ == "__main__":
    main()
