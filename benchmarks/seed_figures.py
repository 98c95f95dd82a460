"""The docs' figures of the experiments run once a seed, drawn from their committed records.

    python benchmarks/seed_figures.py    # -> docs/lecture-length-bias.png, ...

Each seed's figure is drawn again by the experiment's own `plot` from its record
(benchmarks/results/lecture-*/NAME-s<seed>/NAME.json) and the seeds on record are stacked, one
row each, so the page shows every seed, not a chosen one.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from posttrain.experiments.common import experiment_module  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LECTURE = ROOT / "benchmarks/results/lecture-2026-12-04"
SEEDS = (0, 1, 2)
NAMES = ("length-bias", "length-training", "clip-higher", "dynamic-sampling", "opd-vs-grpo", "reward-hacking")


def stacked(name: str, out: Path, seeds: list[int]) -> Path:
    """Each of `seeds`' figures of experiment `name`, one row a seed, into `out`."""
    module = experiment_module(name)
    with tempfile.TemporaryDirectory() as tmp:
        images = []
        for seed in seeds:
            record = json.loads((LECTURE / f"{name}-s{seed}" / f"{name}.json").read_text())
            images.append(plt.imread(module.plot(record["numbers"], Path(tmp) / f"s{seed}.png")))
    h, w = images[0].shape[:2]
    fig, axes = plt.subplots(len(images), 1, figsize=(w / 110, len(images) * h / 110), squeeze=False)
    for ax, image, seed in zip(axes[:, 0], images, seeds):
        ax.imshow(image)
        ax.set_axis_off()
        ax.set_title(f"seed {seed}", fontsize=11, loc="left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    for name in NAMES:   # every seed on record (the page's table reads the same ones)
        seeds = [s for s in SEEDS if (LECTURE / f"{name}-s{s}" / f"{name}.json").exists()]
        if seeds:
            print(stacked(name, ROOT / "docs" / f"lecture-{name}.png", seeds))
