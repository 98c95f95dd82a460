"""benchmarks/record.py: the run folder a command gets, and the record it leaves."""

import json
from pathlib import Path

from tests.conftest import benchmark_module


def _record():
    return benchmark_module("record")


def test_a_run_folder_is_added_only_where_the_command_writes_one(tmp_path):
    rec = _record()
    cmd, run = rec.with_run_dir(["posttrain", "dpo", "--beta", "0.1"], tmp_path)
    assert cmd[-2:] == ["--run_dir", str(tmp_path / "run")] and run == tmp_path / "run"
    cmd, run = rec.with_run_dir(["posttrain", "train", "--run_dir", "runs/x"], tmp_path)
    assert cmd == ["posttrain", "train", "--run_dir", "runs/x"] and run == Path("runs/x")
    cmd, run = rec.with_run_dir(["posttrain", "eval", "--model.path", "m"], tmp_path)
    assert cmd[-2:] == ["--run_dir", str(tmp_path / "run")] and run == tmp_path / "run"
    cmd, run = rec.with_run_dir(["posttrain", "generate", "--run_dir", "none"], tmp_path)
    assert cmd == ["posttrain", "generate", "--run_dir", "none"] and run is None
    cmd, run = rec.with_run_dir(["posttrain", "plot", "runs/x"], tmp_path)
    assert cmd == ["posttrain", "plot", "runs/x"] and run is None


def test_the_record_keeps_summary_and_metrics_and_drops_the_weights(tmp_path):
    rec = _record()
    run = tmp_path / "run"
    (run / "final_model").mkdir(parents=True)
    (run / "final_value_model").mkdir()
    (run / "checkpoints" / "step-3").mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"eval_after": {"eval/accuracy": 0.35}}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    path = rec.write_record(tmp_path, ["posttrain", "dpo"], {"commit": "abc"}, 61.26, 3.456, 0, run)
    record = json.loads(path.read_text())
    assert record["summary"]["eval_after"]["eval/accuracy"] == 0.35
    assert (record["wall_s"], record["peak_rss_gb"], record["returncode"]) == (61.3, 3.46, 0)
    assert record["provenance"] == {"commit": "abc"} and record["command"] == "posttrain dpo"
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (run / "final_model").exists() and not (run / "checkpoints").exists()
    assert not (run / "final_value_model").exists()   # PPO's value model is weights too
    kept = tmp_path / "kept"
    (kept / "run" / "final_model").mkdir(parents=True)
    rec.write_record(kept, ["posttrain", "sft"], {}, 1.0, 1.0, 0, kept / "run", keep_weights=True)
    assert (kept / "run" / "final_model").is_dir()
    assert json.loads((kept / "record.json").read_text())["summary"] is None
