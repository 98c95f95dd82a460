"""Plot several runs side by side: held-out accuracy against training wall time and against steps,
and (for RLHF runs) the reward-model score beside the true accuracy of the sampled answers.

    python benchmarks/compare_runs.py RUN_DIR[:LABEL] ... --out docs/compare.png

Prints a table of held-out accuracy at each evaluation (step, minutes) for every run.
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
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for spec in args.runs:
        path, _, label = spec.partition(":")
        runs.append((Path(path), label or Path(path).name))
    has_rm = any(any("reward/model_score" in r for r in load(p)) for p, _ in runs)
    fig, axes = plt.subplots(1, 3 if has_rm else 2, figsize=(15 if has_rm else 10, 4))
    for path, label in runs:
        rows = load(path)
        evals = [r for r in rows if "eval/accuracy" in r]
        axes[0].plot([r["perf/train_minutes"] for r in evals], [r["eval/accuracy"] for r in evals],
                     marker="o", label=label)
        axes[1].plot([r["step"] for r in evals], [r["eval/accuracy"] for r in evals], marker="o",
                     label=label)
        print(f"\n{label} ({path})")
        print("  step  minutes  held-out accuracy")
        for r in evals:
            print(f"  {r['step']:4d}  {r['perf/train_minutes']:7.1f}  {100 * r['eval/accuracy']:6.1f}%")
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
    axes[0].set_xlabel("training wall time (min, 2-core CPU)")
    axes[1].set_xlabel("step")
    for ax in axes[:2]:
        ax.set_ylabel("held-out greedy accuracy")
        ax.set_ylim(0, 1)
        ax.legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=90)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
