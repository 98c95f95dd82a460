"""Verifiers, format reward, overlong shaping and the safe calling of user reward functions."""

import logging
import os
import threading

import pytest
import torch

from posttrain.config.sections import RewardConfig
from posttrain.data.tasks import Problem, countdown_task
from posttrain.rewards import Scorer
from posttrain.util.usercode import call_with_limits, load_function
from posttrain.rewards.verifiers import (countdown_correct, exact_correct, final_answer,
                                         is_bare_answer, math_correct, overlong_penalty)

P42 = Problem("What is 12 + 30?", "42")


@pytest.mark.parametrize("text,ok", [("42", True), ("The answer is 42.", True), ("$42$", True),
                                     ("\\boxed{42}", True), ("42.0", True), ("12 + 30 = 42", True),
                                     ("41. No wait, 43", False), ("forty-two", False), ("", False),
                                     ("42 is the sum of 12 and 30", False),
                                     ("The sum is 1,042", False), ("-42", False),
                                     # reward hacks: a restated question is not an answer
                                     ("To find 12 + 30, we add them", False),
                                     ("\\boxed{12 + 30}", False), ("$12+30$", False)])
def test_math_verifier_uses_the_final_answer(text, ok):
    assert math_correct(text, P42) is ok


def test_final_answer_extraction():
    assert final_answer("so \\boxed{\\frac{1}{2}} and 7") == "\\frac{1}{2}"
    assert final_answer("41, no: 43.") == "43" and final_answer("none") is None
    assert math_correct("\\boxed{\\frac{1}{2}}", Problem("", "0.5"))
    assert math_correct("It is 3/4", Problem("", "3/4"))


def test_exact_verifier():
    assert exact_correct("  42\n", P42) and not exact_correct("42.", P42)


def test_countdown_verifier_checks_numbers_and_value():
    p = Problem("...", "24", {"numbers": [2, 3, 4]})
    assert countdown_correct("(2 + 4) * 4", Problem("...", "24", {"numbers": [2, 4, 4]}))
    assert countdown_correct("Answer: 4 * (3 + 2) + 4 ... no: (3 * 4) * 2", p)
    assert countdown_correct("(3 * 4) * 2 = 24", p)
    assert not countdown_correct("4 * 6", p)             # 6 is not given
    assert not countdown_correct("2 * 3 * 4 * 1", p)     # uses an extra number
    assert not countdown_correct("2 + 3 + 4", p)         # wrong value
    assert not countdown_correct("no idea", p)
    assert not countdown_correct("__import__('os')", p)


def test_countdown_task_solutions_verify():
    task = countdown_task(4)
    task.build_eval(20, 0)
    for prob in task.eval_problems:
        assert countdown_correct(prob.meta["solution"], prob), prob


def test_format_reward():
    assert is_bare_answer("42") and is_bare_answer(" 1,234. ") and is_bare_answer("\\boxed{7}")
    assert not is_bare_answer("The answer is 42")


def test_overlong_penalty_ramps_in_the_buffer():
    lengths = torch.tensor([10, 16, 18, 20])
    torch.testing.assert_close(overlong_penalty(lengths, max_len=20, buffer=4, penalty=1.0),
                               torch.tensor([0.0, 0.0, -0.5, -1.0]))


def test_scorer_sums_verifier_format_and_user_functions():
    cfg = RewardConfig(format_weight=0.5, functions=("tests.toy_rewards:first_letter_a_to_e",))
    res = Scorer(cfg)([P42, P42, P42], ["42", "abc 42", "zz"])
    torch.testing.assert_close(res.rewards_B, torch.tensor([1.5, 2.0, 0.0]))
    assert res.correct_B.tolist() == [True, True, False]


def test_user_function_failures_get_fallback_and_are_counted():
    cfg = RewardConfig(verifier="none", timeout_s=0.2, fallback=-1.0,
                       functions=("tests.toy_rewards:raises", "tests.toy_rewards:hangs",
                                  "tests.toy_rewards:not_a_number"))
    res = Scorer(cfg)([P42], ["42"])
    assert res.rewards_B.tolist() == [-3.0]
    assert dict(res.failures) == {"error": 1, "timeout": 1, "nonfinite": 1}


def test_in_the_worker_pool_a_hang_is_killed_even_when_the_function_cancels_alarms():
    """math-verify's signal.alarm(0) defeats the in-process SIGALRM (workers 0: the call runs its
    full 3 s and its value is taken); in the pool the worker is killed at the timeout. A function
    that kills its own process counts as a crash, and the pool goes on with fresh workers."""
    fns = ("tests.toy_rewards:verify_then_hang",)
    inproc = Scorer(RewardConfig(verifier="none", timeout_s=1.0, workers=0, functions=fns))
    res = inproc([P42], ["42"])
    assert res.rewards_B.tolist() == [1.0] and dict(res.failures) == {}   # the timeout was lost

    pooled = Scorer(RewardConfig(verifier="none", timeout_s=1.0, workers=2, fallback=-1.0,
                                 functions=fns + ("tests.toy_rewards:dies",
                                                  "tests.toy_rewards:first_letter_a_to_e")))
    try:
        res = pooled([P42, P42], ["abc", "zz"])
        assert res.rewards_B.tolist() == [-1.0, -2.0]   # -1 (timeout) - 1 (crash) + first letter
        assert dict(res.failures) == {"timeout": 2, "crash": 2}
        again = pooled([P42], ["abc"])                  # the killed workers were replaced
        assert again.rewards_B.tolist() == [-1.0] and dict(again.failures) == {"timeout": 1, "crash": 1}
    finally:
        pooled.close()


def test_the_pool_spreads_calls_over_its_workers():
    scorer = Scorer(RewardConfig(verifier="none", workers=2, functions=("tests.toy_rewards:slow_pid",)))
    try:
        pids = scorer([P42] * 4, ["a"] * 4).rewards_B.tolist()
        assert len(set(pids)) == 2 and os.getpid() not in pids   # both workers, never the trainer
    finally:
        scorer.close()


def test_a_function_beside_the_run_is_found_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_reward_mod.py").write_text("def fn(prompt, completion, answer):\n    return 0.25\n")
    monkeypatch.chdir(tmp_path)
    for workers in (0, 1):
        scorer = Scorer(RewardConfig(verifier="none", workers=workers, functions=("my_reward_mod:fn",)))
        assert scorer([P42], ["x"]).rewards_B.tolist() == [0.25]
        scorer.close()


def test_timeout_outside_the_main_thread():
    out = {}
    hang = load_function("tests.toy_rewards:hangs")
    worker = threading.Thread(target=lambda: out.setdefault(
        "r", call_with_limits(hang, {"prompt": "", "completion": "", "answer": ""}, 0.2)))
    worker.start()
    worker.join(5)
    assert out["r"] == (None, "timeout", None)


@pytest.mark.parametrize("spec,msg", [("nocolon", "module:function"),
                                      ("no_such_module_xyz:f", "cannot import"),
                                      ("tests.toy_rewards:missing", "no callable")])
def test_bad_function_specs_are_named(spec, msg):
    with pytest.raises(ValueError, match=msg):
        load_function(spec)


def test_one_training_run_survives_every_kind_of_reward_failure(tmp_path, tokenizer):
    """Raise, hang after calling math-verify, NaN, a segfault and os._exit, all in the same run:
    it finishes, and every failure is counted by its kind, on every step."""
    from posttrain.config.options import load_config
    from posttrain.rl.loop import train
    from tests.conftest import make_tiny_model
    bad = ",".join(f"tests.toy_rewards:{f}" for f in ("raises", "verify_then_hang", "not_a_number",
                                                        "segfaults", "dies", "first_letter_a_to_e"))
    cfg = load_config(None, ["--reward.verifier", "none", "--reward.functions", bad,
                             "--reward.timeout_s", "1", "--reward.fallback", "0",
                             "--data.eval_size", "0", "--rollout.max_new_tokens", "3",
                             "--data.system_prompt", "null", "--tensorboard", "false",
                             "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
                             "--steps", "2", "--run_dir", str(tmp_path / "run")])
    summary = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert summary["steps"] == 2 and (tmp_path / "run" / "final_model").is_dir()
    import json
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for r in rows:   # 4 responses a step, one call each of every function
        assert (r["reward/failures_error"], r["reward/failures_timeout"], r["reward/failures_nonfinite"],
                r["reward/failures_crash"]) == (4, 4, 4, 8), r


def test_scoring_in_the_trainers_process_is_announced(caplog):
    """reward.workers 0 runs what scores the model's answers in the trainer's own process: a
    warning says so; the default pool says nothing."""
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        Scorer(RewardConfig(verifier="none", workers=0))
    assert "reward.workers 0" in caplog.text and "debugging only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        pooled = Scorer(RewardConfig(verifier="none", workers=1))
        pooled.close()
    assert "reward.workers 0" not in caplog.text


def test_each_scored_batch_carries_its_own_calls_and_failures():
    """Sampling ahead scores the next batch in the engine's thread while the trainer checks the
    health of the one it trains: each result carries its own calls and failures (nothing shared
    to swap under a writer), so a step counts its own batch's failures, and a batch dropped as too
    stale takes its failures with it."""
    scorer = Scorer(RewardConfig(verifier="none", workers=0,
                                 functions=("tests.toy_rewards:fails_on_bad",)))
    source = "reward function 'tests.toy_rewards:fails_on_bad'"
    out: dict[str, object] = {}

    def score(name, answers):
        out[name] = scorer([Problem("q", "1")] * len(answers), answers)
    threads = [threading.Thread(target=score, args=("a", ["bad", "bad", "ok"] * 20)),
               threading.Thread(target=score, args=("b", ["ok"] * 40))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    a, b = out["a"].tallies[source], out["b"].tallies[source]
    assert (a.calls, a.failures, b.calls, b.failures) == (60, 40, 40, 0)
    assert "ValueError: bad" in a.first_error and b.first_error is None
