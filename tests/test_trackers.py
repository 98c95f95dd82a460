"""`report_to`: each tracker writes a run that its own reader opens, with the scalars of
metrics.jsonl step by step and a completions table (skipped only where the extra is missing;
.ci/run installs them)."""

import json
import os
import struct
import tempfile
import time
from pathlib import Path

import pytest

from posttrain.config.commands import ConfigError
from posttrain.logs.trackers import flat, wandb_mode
from posttrain.rl.loop import train
from tests.conftest import make_tiny_model
from tests.test_trainer import toy_config

# trackio reads its store's folder when it is imported: a temporary one, never the user's
os.environ.setdefault("TRACKIO_DIR", tempfile.mkdtemp(prefix="posttrain-trackio-"))


def tiny_run(tmp_path, tokenizer, tracker: str) -> tuple[Path, dict[int, float]]:
    cfg = toy_config(tmp_path, "--steps", "2", "--report_to", tracker, "--log_samples", "3")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return run, {r["step"]: r["reward/mean"] for r in rows if "reward/mean" in r}


def test_unknown_or_missing_trackers_are_refused_before_anything_loads(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="report_to='nope' is not valid; accepted: .*'mlflow'"):
        toy_config(tmp_path, "--report_to", "nope")
    monkeypatch.setattr("posttrain.config.sections.missing_package", lambda name: name)
    with pytest.raises(ConfigError, match=r'report_to wandb needs the .wandb. package.*posttrain\[wandb\]'):
        toy_config(tmp_path, "--report_to", "wandb")


def test_wandb_is_offline_without_a_key(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert wandb_mode() == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password k\n")
    assert wandb_mode() == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"
    assert flat({"optim": {"lr": 1e-5}, "steps": 3}) == {"optim.lr": 1e-5, "steps": 3}


def wandb_records(path: Path):
    """The records of an offline .wandb file, parsed with wandb's own protobuf schema (wandb 0.31
    ships no Python reader for them; `wandb sync` needs a server). The file is a 7-byte header,
    then LevelDB's log format: 32 KiB blocks of (crc32c, length, type) chunks."""
    from wandb.proto import wandb_internal_pb2 as pb
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, n, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if n == 0 and kind == 0:   # a block's padding
            pos += left
            continue
        if pos + 7 + n > len(data):   # (a record still being written)
            return
        chunk, pos = data[pos + 7:pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):   # FULL, LAST
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def test_wandb_offline_run_holds_every_step(tmp_path, tokenizer, monkeypatch):
    import wandb  # noqa: F401  (installed by scripts/install-cpu.sh: [trackers])
    monkeypatch.setenv("WANDB_MODE", "offline")
    run, rewards = tiny_run(tmp_path, tokenizer, "wandb")
    [file] = run.glob("wandb/offline-run-*/run-*.wandb")
    # wandb's service process writes the file; under load its last blocks can land a moment after
    # run.finish() returns (the full suite once read no history at all): wait up to 30 s for them
    deadline = time.monotonic() + 30
    while True:
        history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                   for r in wandb_records(file) if r.WhichOneof("record_type") == "history"]
        if len(history) >= len(rewards) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {h["_step"]: h["reward/mean"] for h in history} == rewards
    assert all(h["completions/_type"] == "table-file" and h["completions/nrows"] == 3 for h in history)
    [table] = list(run.glob("wandb/offline-run-*/files/media/table/completions_2_*.table.json"))
    assert json.loads(table.read_text())["columns"] == ["prompt", "completion", "reward", "correct",
                                                        "advantage"]


def test_trackio_local_store_holds_every_step(tmp_path, tokenizer, monkeypatch):
    import trackio  # noqa: F401  (installed by scripts/install-cpu.sh: [trackers])
    monkeypatch.setenv("TRACKIO_PROJECT", f"posttrain-test-{tmp_path.name}")
    run, rewards = tiny_run(tmp_path, tokenizer, "trackio")
    from trackio.sqlite_storage import SQLiteStorage
    project = os.environ["TRACKIO_PROJECT"]
    assert SQLiteStorage.get_runs(project) == ["run"]
    logs = SQLiteStorage.get_logs(project, "run")
    assert {r["step"]: r["reward/mean"] for r in logs if "reward/mean" in r} == rewards
    assert sum("completions" in r for r in logs) == 2


def test_mlflow_file_store_holds_every_step(tmp_path, tokenizer, monkeypatch):
    import mlflow  # noqa: F401  (installed by scripts/install-cpu.sh: [trackers])
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run, rewards = tiny_run(tmp_path, tokenizer, "mlflow")
    import mlflow
    client = mlflow.MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    [found] = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
    assert found.info.run_name == "run" and found.data.params["optim.lr"] == "1e-05"
    history = client.get_metric_history(found.info.run_id, "reward/mean")
    assert {m.step: m.value for m in history} == pytest.approx(rewards)
    tables = client.list_artifacts(found.info.run_id, "completions")
    assert [a.path for a in tables] == ["completions/step_000001.json", "completions/step_000002.json"]
