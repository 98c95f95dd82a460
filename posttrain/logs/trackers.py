"""The experiment trackers a run reports to (`report_to`): TensorBoard, Weights & Biases, trackio,
MLflow. Each gets the same scalars as metrics.jsonl, one row a step, and a completions table
(prompt, completion, reward, correct, advantage) of the step's first responses.

Each is an optional extra (`pip install "posttrain[wandb]"`, `[trackio]`, `[mlflow]`); a run that
asks for one that is not installed is refused before any model loads (config.validate), and each
works offline:

- wandb: online when WANDB_MODE says so or an API key is configured (WANDB_API_KEY, or
  `wandb login`), else offline into RUN/wandb (`wandb sync RUN/wandb/offline-run-*` uploads it);
- trackio: its local store (TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`);
- mlflow: MLFLOW_TRACKING_URI when set, else a file store in RUN/mlruns (mlflow-skinny has no
  database backend; `mlflow ui --backend-store-uri RUN/mlruns` shows it).
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from posttrain.util.registry import Registry

PROJECT = "posttrain"


@dataclass(frozen=True)
class TrackerContext:
    run_dir: Path
    name: str                            # the run's name in the tracker: its folder's name
    config: dict[str, Any] = field(default_factory=dict)
    resume: bool = False


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...
    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None: ...
    def close(self) -> None: ...


TRACKERS: Registry = Registry("tracker")
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio",
            "mlflow": "mlflow"}
COLUMNS = ["prompt", "completion", "reward", "correct", "advantage"]


def missing_package(name: str) -> str | None:
    """The package tracker `name` needs, when it is not installed."""
    package = PACKAGES[name]
    return None if importlib.util.find_spec(package) is not None else package


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'optim': {'lr': 1e-5}} -> {'optim.lr': 1e-5} (what MLflow's params and trackers' config
    panels show)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def finite(scalars: dict[str, float]) -> dict[str, float]:
    """Only numbers (a tracker would refuse a string or reject the step); NaN and Inf kept as the
    floats they are (metrics.jsonl keeps them as strings)."""
    return {k: float(v) for k, v in scalars.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            or (isinstance(v, str) and v in ("nan", "inf", "-inf"))}


@TRACKERS.register("tensorboard")
class TensorBoardTracker:
    def __init__(self, ctx: TrackerContext) -> None:
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(str(ctx.run_dir / "tensorboard"))

    def log(self, step: int, scalars: dict[str, float]) -> None:
        for k, v in finite(scalars).items():
            self.writer.add_scalar(k, v, step)   # (NaN and Inf as TensorBoard shows them)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for r in rows:
            cells = [str(r[c]).replace("|", "\\|").replace("\n", " ") for c in COLUMNS]
            lines.append("| " + " | ".join(cells) + " |")
        self.writer.add_text("completions", "\n".join(lines), step)

    def close(self) -> None:
        self.writer.close()


def wandb_mode() -> str:
    """WANDB_MODE if set; online with an API key (environment or `wandb login`'s netrc); else
    offline (nothing leaves the machine; `wandb sync` uploads later)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return "online" if netrc.is_file() and "api.wandb.ai" in netrc.read_text() else "offline"


class RunTracker:
    """What wandb and trackio share (trackio copies wandb's API): `self.lib` is the package and
    `self.run` its run; scalars go to run.log, the completions as a lib.Table."""

    lib: Any
    run: Any
    keep_nonfinite = True   # (trackio refuses NaN and Inf)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        values = finite(scalars)
        if not self.keep_nonfinite:
            values = {k: v for k, v in values.items() if math.isfinite(v)}
        self.run.log(values, step=step)

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        table = self.lib.Table(columns=COLUMNS, data=[[r[c] for c in COLUMNS] for r in rows])
        self.run.log({"completions": table}, step=step)

    def close(self) -> None:
        self.run.finish()


@TRACKERS.register("wandb")
class WandbTracker(RunTracker):
    def __init__(self, ctx: TrackerContext) -> None:
        import wandb
        self.lib = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=ctx.name,
                              dir=str(ctx.run_dir), config=ctx.config, mode=wandb_mode(),
                              resume="allow" if ctx.resume else None, reinit="finish_previous")


@TRACKERS.register("trackio")
class TrackioTracker(RunTracker):
    keep_nonfinite = False

    def __init__(self, ctx: TrackerContext) -> None:
        import trackio
        self.lib = trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT), name=ctx.name,
                                config=ctx.config, resume="allow" if ctx.resume else "never",
                                embed=False, auto_log_cpu=False, auto_log_gpu=False)


@TRACKERS.register("mlflow")
class MlflowTracker:
    def __init__(self, ctx: TrackerContext) -> None:
        import mlflow
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:   # a file store in the run folder: no server, no database package to install
            uri = (ctx.run_dir / "mlruns").resolve().as_uri()
            # (MLflow 3 keeps the file store in maintenance mode behind this opt-in; its own
            # `mlflow ui --backend-store-uri RUN/mlruns` reads it)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(PROJECT)
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(PROJECT)
        found = self.client.search_runs([exp_id], f"tags.mlflow.runName = '{ctx.name}'") if ctx.resume else []
        self.run_id = found[0].info.run_id if found else self.client.create_run(exp_id, run_name=ctx.name).info.run_id
        if not found:
            for k, v in flat(ctx.config).items():
                self.client.log_param(self.run_id, k, str(v)[:6000])

    def log(self, step: int, scalars: dict[str, float]) -> None:
        from mlflow.entities import Metric
        import time
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step)
                                                    for k, v in finite(scalars).items()])

    def log_completions(self, step: int, rows: list[dict[str, Any]]) -> None:
        self.client.log_table(self.run_id, {c: [r[c] for r in rows] for c in COLUMNS},
                              f"completions/step_{step:06d}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
