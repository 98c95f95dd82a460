"""Metrics: JSONL lines, TensorBoard events when installed, console line, plot."""

import json

import pytest

from posttrain.logs.metrics import MetricsLogger, console_line, plot_run


def test_jsonl_console_and_plot(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2):
        logger.log(step, {"reward/mean": 0.5 * step, "reward/accuracy": 0.5, "policy/entropy": 1.0,
                          "rollout/length_correct": 4.0, "rollout/length_incorrect": None,
                          "policy/clip_frac_high": 0.0, "loss/policy": float("nan")})
    logger.log(2, {"eval/accuracy": 0.7, "perf/train_minutes": 1.0})
    logger.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows[1]["reward/mean"] == 1.0 and rows[0]["loss/policy"] == "nan"   # said, not dropped
    assert rows[0]["rollout/length_incorrect"] is None                         # no value: null
    assert console_line(3, 10, {"reward/mean": 0.25, "perf/step_s": 2.0}) == \
        "step 3/10 | reward 0.250 | 2.0s"
    assert plot_run(tmp_path).stat().st_size > 10_000


def test_tensorboard_events_when_installed(tmp_path):
    import tensorboard  # noqa: F401  (installed by scripts/install-cpu.sh)
    logger = MetricsLogger(tmp_path, tensorboard=True)
    logger.log(1, {"reward/mean": 0.5})
    logger.log(2, {"reward/mean": 0.75, "loss/policy": -1.5})
    logger.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    read = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert read == {"reward/mean": [(1, 0.5), (2, 0.75)], "loss/policy": [(2, -1.5)]}
