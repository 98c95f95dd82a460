"""docs/mopd-two-domains.png, drawn from the MOPD records (benchmarks/results/mopd-2026-12-04).

    python benchmarks/mopd_figure.py

Held-out accuracy per domain (addition, subtraction) against training minutes: MOPD from the base
model, and MOPD after the SFT warm-up on both teachers' answers (its minutes start after the
warm-up's), with the teachers' own accuracy as dashed lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MOPD = ROOT / "benchmarks/results/mopd-2026-12-04"
DOMAINS = ("addition", "subtraction")


def metrics(run: str) -> list[dict]:
    return [json.loads(line) for line in (MOPD / run / "metrics.jsonl").read_text().splitlines() if line]


def evaluations(run: str) -> list[dict]:
    """The per-domain evaluations in a run's metrics.jsonl."""
    return [r for r in metrics(run) if "eval/accuracy@addition" in r]


def teachers() -> dict[str, float]:
    """Each domain's teacher accuracy from its record (A: a train run, B: an SFT run)."""
    a = json.loads((MOPD / "teacher-a/record.json").read_text())["summary"]["eval_after"]["eval/accuracy"]
    b = json.loads((MOPD / "teacher-b/record.json").read_text())["summary"]["behaviour_after"]
    return {"addition": a, "subtraction": b.get("eval/accuracy", b.get("behaviour/accuracy"))}


def draw(out: Path) -> Path:
    warm_up = sum(r["perf/step_s"] for r in metrics("sft-mix") if "perf/step_s" in r) / 60   # its steps' times
    runs = {"MOPD from the base model": (evaluations("mopd"), 0.0),
            "SFT warm-up, then MOPD": (evaluations("sft-then-mopd"), warm_up)}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, domain in zip(axes, DOMAINS):
        for label, (evals, offset) in runs.items():
            ax.plot([offset + r["perf/train_minutes"] for r in evals],
                    [100 * r[f"eval/accuracy@{domain}"] for r in evals], marker="o", label=label)
        ax.axhline(100 * teachers()[domain], ls="--", c="grey", label="its teacher")
        ax.set(title=f"held-out {domain} (100 problems, greedy)", xlabel="training minutes")
    axes[0].set_ylabel("accuracy %")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(draw(ROOT / "docs" / "mopd-two-domains.png"))
