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
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import learning  # noqa: E402
from learning import at_minutes  # noqa: E402

BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


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
    step30 = pct([at_step(r, 30) for r in runs])
    end = pct([r["eval_accuracy"][-1] for r in runs])
    three = pct([r["final"]["3digit"]["accuracy"] for r in runs])
    return (f"| {label} | {len(runs)} | {at[0]} | {at[1]} | {end} | {per_seed_end(runs)} | {step30} | "
            f"{median_step_s(runs):.1f} | {three} |")


OBJECTIVES = "benchmarks/results/objectives-2026-12-03"
OBJECTIVE_LABELS = {
    "gspo": "GSPO (sequence ratio, clip 3e-4 / 4e-4)",
    "cispo": "CISPO (capped IS weight as a constant, cap 5)",
    "sapo": "SAPO (soft gate, tau 1.0 / 1.05)",
    "gmpo": "GMPO (geometric mean, log-ratio clip 0.4)",
}


def objectives_table(root: Path) -> str:
    """The field's current objectives on the default task, 4 minibatches, 10 minutes."""
    lines = ["| preset | seeds | held-out 2 min | 5 min | after 10 min | per seed after 10 min "
             "(steps) | step 30 | s/step (median) | 3-digit |", "|---" * 9 + "|"]
    runs_with = []
    for name, label in OBJECTIVE_LABELS.items():
        lines.append(preset_row(label, load_runs(root / OBJECTIVES / name)))
        meta = json.loads((root / OBJECTIVES / name / "meta.json").read_text())
        runs_with.append(f"`{name}`: `{' '.join(meta['overrides'])}`")
    lines.append(f"\nRecords: `{OBJECTIVES}/<preset>/posttrain-s<seed>/bench.json`; each row ran "
                 "the default recipe with " + "; ".join(runs_with) + ".")
    return "\n".join(lines) + "\n"


PERSTEP = "benchmarks/results/perstep-2026-12-02"


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


TABLES: dict[str, Callable[[Path], str]] = {
    "objectives": objectives_table, "perstep": perstep_table,
}


def render_page(text: str, root: Path) -> str:
    """The page with each table block replaced by what its records render."""
    def fill(m: re.Match) -> str:
        if m["name"] not in TABLES:
            raise KeyError(f"table {m['name']!r} has no renderer; known: {sorted(TABLES)}")
        return m.group(1) + TABLES[m["name"]](root) + m.group(4)
    return BLOCK.sub(fill, text)


def pages(root: Path) -> list[Path]:
    return sorted([root / "README.md", *(root / "docs").glob("*.md")])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if a table differs")
    args = ap.parse_args()
    stale = []
    for page in pages(ROOT):
        text = page.read_text()
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
