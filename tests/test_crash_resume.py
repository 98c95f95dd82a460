"""The crash harness in small: a run killed with SIGKILL three times at random moments and resumed
each time ends bit for bit where an uninterrupted run ends (benchmarks/crash_resume.py runs 20)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from crash_resume import crash_and_resume  # noqa: E402


@pytest.mark.slow   # (~70 s; tests/test_checkpoint_safety.py kills and resumes in the quick suite)
def test_three_sigkills_and_resumes_end_like_an_uninterrupted_run(tmp_path):
    result = crash_and_resume(tmp_path, kills=3, seed=1, steps=6)
    assert result["kills"] >= 1, result
    assert result["weights"] == 0 and result["optimizer"] == 0 and result["metrics_rows"] == 0, result
    assert result["n_weights"] > 0 and result["n_optimizer"] > 0 and result["n_rows"] >= 6


@pytest.mark.slow   # (~40 s each)
@pytest.mark.parametrize("kind", ["sft", "dpo", "reward-model"])
def test_the_offline_stages_survive_sigkills_bit_for_bit(tmp_path, kind):
    result = crash_and_resume(tmp_path, kills=2, seed=1, steps=6, kind=kind)
    assert result["kills"] >= 1, result
    assert result["weights"] == 0 and result["optimizer"] == 0 and result["metrics_rows"] == 0, result
    assert result["n_weights"] > 0 and result["n_optimizer"] > 0 and result["n_rows"] >= 6
