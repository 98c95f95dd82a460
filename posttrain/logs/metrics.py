"""What a user sees: one JSONL line per step, the trackers it reports to (TensorBoard when
installed, wandb / trackio / mlflow on request: logs/trackers.py), a console line, plots."""

from __future__ import annotations

import json
import os
import math
import shutil
from pathlib import Path
from typing import Any

from posttrain.logs.trackers import TRACKERS, TrackerContext, missing_package

_CONSOLE_KEYS = [("reward/mean", "reward {:.3f}"), ("reward/accuracy", "acc {:.2f}"),
                 ("loss/policy", "loss {:+.4f}"), ("policy/kl_ref", "kl {:.4f}"),
                 ("policy/entropy", "ent {:.2f}"), ("rollout/length_mean", "len {:.1f}"),
                 ("reward/model_score", "rm {:+.2f}"), ("loss/value", "vloss {:.4f}"),
                 ("critic/explained_variance", "ev {:+.2f}"), ("perf/step_s", "{:.1f}s")]


TOKENS_DIR = "tokens"   # per-token records, one Parquet file a step (rl/token_records.py)


def write_json_atomic(path: Path, obj: Any) -> None:
    """`obj` as indented JSON at `path`, renamed into place: a reader (or a run killed while it
    writes) sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


class MetricsLogger:
    """The one writer of a run folder (rank 0's): metrics.jsonl and the trackers, the sample
    files (`append`), config.json and summary.json (`write_json`, atomic)."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, resume: bool = False,
                 report_to: tuple[str, ...] = (), config: dict[str, Any] | None = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self.run_dir = run_dir
        self._file = open(self.path, "a" if resume else "w")
        if not resume:   # a new run in a used folder: no sample rows or token records of the old one
            for name in ("samples.jsonl", "eval_samples.jsonl"):
                (run_dir / name).unlink(missing_ok=True)
            shutil.rmtree(run_dir / TOKENS_DIR, ignore_errors=True)
        names = list(dict.fromkeys((["tensorboard"] if tensorboard else []) + list(report_to)))
        if "tensorboard" in names and "tensorboard" not in report_to and missing_package("tensorboard"):
            names.remove("tensorboard")   # on by default, an optional extra: skipped when absent
        ctx = TrackerContext(run_dir, run_dir.resolve().name, config or {}, resume)
        self.trackers = [TRACKERS[name](ctx) for name in names]

    def truncate_after(self, step: int) -> None:
        """Drop the rows of steps after `step` from metrics.jsonl and the sample files (a run
        resumed from that step's checkpoint redoes them, so none is logged twice), and a last
        line that a killed process left half-written."""
        self._file.close()
        for name in LOG_FILES:
            truncate_jsonl(self.run_dir / name, step)
        self._file = open(self.path, "a")

    def line_counts(self) -> dict[str, int]:
        """Complete rows in each log file now (saved with a checkpoint)."""
        return {name: _complete_lines(self.run_dir / name) for name in LOG_FILES}

    def truncate_to(self, counts: dict[str, int]) -> None:
        """Keep the first `counts[name]` rows of each log file: exactly what was written when
        the checkpoint was (rows logged after it at the same step, such as the final evaluation
        of a run killed before it finished, are redone, not doubled)."""
        self._file.close()
        for name in LOG_FILES:
            path = self.run_dir / name
            if path.is_file():
                lines = path.read_text().splitlines(keepends=True)[:counts.get(name, 0)]
                tmp = path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(lines))
                os.replace(tmp, path)
        self._file = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        for tracker in self.trackers:
            tracker.log(step, {k: v for k, v in record.items() if k != "step"})

    def append(self, name: str, row: dict[str, Any]) -> None:
        """One JSON line appended to the run folder's `name` (samples.jsonl, eval_samples.jsonl)."""
        with open(self.run_dir / name, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def write_json(self, name: str, obj: Any) -> None:
        """The run folder's `name` (config.json, summary.json, eval.json), written atomically."""
        write_json_atomic(self.run_dir / name, obj)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of the step's first responses (prompt, completion, reward, correct,
        advantage) to each tracker."""
        for tracker in self.trackers:
            tracker.log_completions(step, rows)

    def close(self) -> None:
        self._file.close()
        for tracker in self.trackers:
            tracker.close()


class NullLogger:
    """What ranks other than 0 log to: nothing (their metrics are reduced onto rank 0's)."""

    def truncate_after(self, step: int) -> None:
        pass

    def line_counts(self) -> dict[str, int]:
        return {}

    def truncate_to(self, counts: dict[str, int]) -> None:
        pass

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        pass

    def append(self, name: str, row: dict[str, Any]) -> None:
        pass

    def write_json(self, name: str, obj: Any) -> None:
        pass

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


LOG_FILES = ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl")


def _complete_lines(path: Path) -> int:
    return path.read_text().count("\n") if path.is_file() else 0


def resume_logs(logger, state: dict[str, Any]) -> None:
    """A resumed run's logs as they were at its checkpoint (older checkpoints: by step)."""
    if "log_rows" in state:
        logger.truncate_to(state["log_rows"])
    else:
        logger.truncate_after(state["step"])


def truncate_jsonl(path: Path, step: int) -> None:
    """Keep the rows of `path` whose "step" is at most `step` and that parse (atomic rewrite)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("step", 0) <= step:
            keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def _plain(v: Any) -> Any:
    """A metric as JSON: a non-finite float as the string "nan", "inf" or "-inf" (JSON has no
    such numbers, and dropping them would hide exactly the step that went wrong); None (no
    value: e.g. the length of correct answers in a step without one) stays null."""
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def number(v: Any) -> float | None:
    """A logged metric as a float ("nan" / "inf" read back), or None when it has none."""
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return float(v)
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def console_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    parts = [f"step {step}/{total}"]
    for key, fmt in _CONSOLE_KEYS:
        if metrics.get(key) is not None:
            parts.append(fmt.format(metrics[key]))
    return " | ".join(parts)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict[str, Any]], key: str, x: str = "step"):
    """(xs, ys) of `key` over the rows that have both, for a plot."""
    pts = [(r[x], number(r[key])) for r in rows
           if number(r.get(key)) is not None and r.get(x) is not None]
    return zip(*pts) if pts else ([], [])


def plot_run(run_dir: Path) -> Path:
    """training_curves.png: reward, held-out accuracy (vs wall time), length (multi-turn: the
    environment's per-episode counts), KL and entropy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0, 0]
    ax.plot(*series(train, "reward/mean"), label="train reward")
    ax.plot(*series(train, "reward/accuracy"), label="train accuracy")
    if any(r.get("reward/model_score") is not None for r in train):   # RLHF: proxy vs truth
        ax.plot(*series(train, "reward/model_score"), label="reward-model score")
    ax.set_xlabel("step"); ax.set_title("rollout reward"); ax.legend()
    ax = axes[0, 1]
    ax.plot(*series(evals, "eval/accuracy", "perf/train_minutes"), marker="o")
    ax.set_xlabel("training wall time (min)"); ax.set_ylabel("accuracy")
    ax.set_title("held-out greedy accuracy"); ax.set_ylim(0, 1)
    _plot_lengths(axes[1, 0], train)
    _plot_policy(axes[1, 1], train)
    fig.tight_layout()
    out = run_dir / "training_curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def _plot_lengths(ax, train: list[dict[str, Any]]) -> None:
    """Response lengths (correct, incorrect); multi-turn: the environment's per-episode counts."""
    env_keys = sorted({k for r in train for k in r if k.startswith("env/")})
    if env_keys:   # multi-turn episodes: turns, tool calls, malformed calls per episode
        for key in env_keys:
            ax.plot(*series(train, key), label=key[len("env/"):])
        ax.set_xlabel("step"); ax.set_title("environment, per episode"); ax.legend()
        return
    ax.plot(*series(train, "rollout/length_correct"), label="correct")
    ax.plot(*series(train, "rollout/length_incorrect"), label="incorrect")
    ax.set_xlabel("step"); ax.set_title("response length (tokens)"); ax.legend()


def _plot_policy(ax, train: list[dict[str, Any]]) -> None:
    """Entropy, KL to the reference, the high clip fraction; PPO: the value model's fit."""
    ax.plot(*series(train, "policy/entropy"), label="entropy")
    if any(r.get("policy/kl_ref") is not None for r in train):
        ax.plot(*series(train, "policy/kl_ref"), label="KL to ref")
    ax.plot(*series(train, "policy/clip_frac_high"), label="clip frac high")
    if any(r.get("critic/explained_variance") is not None for r in train):   # PPO's value model
        ax.plot(*series(train, "critic/explained_variance"), label="value expl. var.")
        ax.plot(*series(train, "loss/value"), label="value loss")
    ax.set_xlabel("step"); ax.set_title("policy"); ax.legend()
