"""Plot several runs side by side: held-out accuracy against training wall time and against steps,
and (for RLHF runs) the reward-model score beside the true accuracy of the sampled answers.

    python benchmarks/compare_runs.py RUN_DIR[:LABEL[:START_MIN]] ... --out docs/compare.png [--per_domain]

START_MIN shifts a run's wall-time axis (minutes spent before it, e.g. an SFT warm-up), so
pipelines compare on their whole cost. --per_domain draws one line per domain of a task mixture
(eval/accuracy@<domain>) instead of the overall accuracy. Prints a table of held-out accuracy at
each evaluation (step, minutes) for every run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def load(run: Path) -> list[dict]:
    return [json.loads(line) for line in open(run / "metrics.jsonl") if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--title", default="")
    p.add_argument("--per_domain", action="store_true", help="one line per eval/accuracy@<domain>")
    p.add_argument("--reference", action="append", default=[], metavar="ACC:LABEL",
                   help="a dashed level, e.g. a teacher's accuracy: 0.85:'teacher A'")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for spec in args.runs:
        path, _, rest = spec.partition(":")
        label, _, start = rest.partition(":")
        runs.append((Path(path), label or Path(path).name, float(start or 0)))
    has_rm = any(any("reward/model_score" in r for r in load(p)) for p, _, _ in runs)
    fig, axes = plt.subplots(1, 3 if has_rm else 2, figsize=(15 if has_rm else 10, 4))
    for path, label, start in runs:
        rows = load(path)
        evals = [r for r in rows if "eval/accuracy" in r]
        # slices such as eval/accuracy_borrow=true are not domains
        keys = (sorted({k for r in evals for k in r if k.startswith("eval/accuracy@")})
                if args.per_domain else []) or ["eval/accuracy"]
        for key in keys:
            name = f"{label} · {key.partition('@')[2]}" if "@" in key else label
            axes[0].plot([start + r["perf/train_minutes"] for r in evals], [r[key] for r in evals],
                         marker="o", label=name)
            axes[1].plot([r["step"] for r in evals], [r[key] for r in evals], marker="o", label=name)
        print(f"\n{label} ({path})")
        print("  step  minutes  " + "  ".join(k.partition("@")[2] or "held-out accuracy" for k in keys))
        for r in evals:
            print(f"  {r['step']:4d}  {start + r['perf/train_minutes']:7.1f}  "
                  + "  ".join(f"{100 * r[k]:6.1f}%" for k in keys))
        if has_rm and any("reward/model_score" in r for r in rows):
            train = [r for r in rows if "reward/model_score" in r]
            ax = axes[2]
            ax.plot([r["step"] for r in train], [r["reward/model_score"] for r in train],
                    label=f"{label}: reward-model score (normalised)")
            ax.plot([r["step"] for r in train], [r["reward/accuracy"] for r in train],
                    label=f"{label}: true accuracy of samples")
            ax.set_xlabel("step")
            ax.set_title("proxy vs truth (RLHF)")
            ax.legend(fontsize=7)
    axes[0].set_xlabel("training wall time (min, 2-core CPU)"
                       + (", from the warm-up's start" if any(s for _, _, s in runs) else ""))
    axes[1].set_xlabel("step")
    for ax in axes[:2]:
        for i, ref in enumerate(args.reference):
            level, _, name = ref.partition(":")
            ax.axhline(float(level), linestyle="--", linewidth=1, color=f"C{7 + i % 3}", label=name)
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, loc="lower right")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
