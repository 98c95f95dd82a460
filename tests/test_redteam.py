"""Red team, rewards side: answers a policy wrote and reward functions a user wrote, each hostile
in its own way, against the trainer that scores them. Every case must be contained (the trainer's
process, files and other processes untouched, the call answered within its deadline) and counted
(a failure status, never a silent pass). The python tool's sandbox has its own red team
(tests/test_sandbox.py); checkpoints theirs (tests/test_checkpoint_safety.py)."""

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain import load_config, train
from posttrain.sections import RewardConfig
from posttrain.data.tasks import Problem
from posttrain.errors import FailingSourceError
from posttrain.health import FailureWatch, Tally
from posttrain.rewards import Scorer
from posttrain.rewards.pool import process_groups
from posttrain.rollout import make_engine
from tests.conftest import make_tiny_model

EVAL_TASKS = ["spiral_matrix", "string_insertion", "binary_matrix", "n_queens"]


def hostile_answers(marker: Path) -> list[str]:
    """What a policy may write as its final answer to a task whose scorer calls `eval`."""
    return [f"[__import__('os').system('touch {marker}')]",
            f"__import__('pathlib').Path('{marker}').touch()",
            "exit()",
            "9**9**9**9",
            "__import__('os').kill(__import__('os').getppid(), 9)",
            f"The answer is\n<answer>[open('{marker}', 'w').write('x')]</answer>"]


def sleepers() -> list[int]:
    """Processes left by tests.hostile_rewards:forks_and_leaves (`sleep 61.5`)."""
    found = []
    for pid in process_groups():
        try:
            if b"61.5" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def gym():
    pytest.importorskip("reasoning_gym")
    from posttrain.data.gym import reasoning_gym_task
    return {name: reasoning_gym_task(name, {}, 2, 7, 4).eval_problems[0] for name in EVAL_TASKS}


@pytest.mark.parametrize("name", EVAL_TASKS)
def test_eval_answers_to_reasoning_gym_scorers_run_nothing(gym, name, tmp_path):
    marker = tmp_path / "PWNED"
    answers = hostile_answers(marker)
    scorer = Scorer(RewardConfig(verifier="math", timeout_s=3.0), "reasoning_gym")
    t0 = time.perf_counter()
    result = scorer([gym[name]] * len(answers), answers)
    scorer.close()
    assert not marker.exists(), f"{name}: an answer's code ran"
    assert result.correct_B.tolist() == [False] * len(answers)
    assert time.perf_counter() - t0 < 20           # 9**9**9**9 never reached eval
    # the true answer still scores: the literal-only check refuses code, not answers
    assert Scorer(RewardConfig(), "reasoning_gym")([gym[name]], [gym[name].answer]).correct_B.item()


def test_literal_check_passes_literals_and_refuses_code():
    from posttrain.data.gym import safe_for_eval
    assert all(map(safe_for_eval, ["[1, 2, 3]", "1 2 3", "['a', 'b']", "[[1, 0], [0, 1]]", "-5"]))
    assert safe_for_eval("ABBA") and safe_for_eval("exit")   # a look-up calls nothing
    assert not any(map(safe_for_eval, ["exit()", "9**9**9**9", "[x for x in ()]", "exit()[0]",
                                       "().__class__", "[__import__('os')]", "'a' * 10**9"]))


def test_a_verifier_that_hangs_is_killed_and_counted():
    """math-verify on an exponent tower takes its own 5 s (its timeout is no hard limit): the
    worker is killed at reward.timeout_s and the answer counts as a verifier timeout."""
    scorer = Scorer(RewardConfig(timeout_s=1.0))
    t0 = time.perf_counter()
    result = scorer([Problem("q", "1")] * 2, ["\\boxed{9**9**9**9}", "\\boxed{1}"])
    scorer.close()
    assert time.perf_counter() - t0 < 4.5
    assert result.correct_B.tolist() == [False, True]
    assert result.failures == {"verifier_timeout": 1}


HOSTILE_FUNCTIONS = {   # spec -> the status its calls must get
    "tests.hostile_rewards:raises_unpicklable": "error",
    "tests.hostile_rewards:returns_huge": "error",
    "tests.hostile_rewards:exits": "error",
    "tests.hostile_rewards:never_returns": "timeout",
    "tests.toy_rewards:dies": "crash",
    "tests.toy_rewards:segfaults": "crash",
    "tests.hostile_rewards:forks_and_leaves": "ok",
    "tests.hostile_rewards:forks_then_hangs": "timeout",
    "tests.hostile_rewards:returns_side_effect": "ok",
}


@pytest.mark.parametrize("spec", sorted(HOSTILE_FUNCTIONS))
def test_a_hostile_reward_function_is_contained_and_the_pool_goes_on(spec, tmp_path):
    cfg = RewardConfig(verifier="none", timeout_s=1.0, workers=2, max_failing_steps=0,
                       functions=(spec, "tests.hostile_rewards:writes_pid"))
    scorer = Scorer(cfg)
    t0 = time.perf_counter()
    calls, _ = scorer._calls([Problem("q", "1")] * 2, [str(tmp_path / "float_ran_in")] * 2)
    outcomes = scorer.pool.map(calls)
    assert time.perf_counter() - t0 < 8
    assert [o.status for o in outcomes[::2]] == [HOSTILE_FUNCTIONS[spec]] * 2
    pids = {o.value for o in outcomes[1::2]}
    assert all(o.status == "ok" for o in outcomes[1::2]) and os.getpid() not in pids
    if spec.endswith("raises_unpicklable"):   # the traceback crossed as text
        assert "Unpicklable" in outcomes[0].error
    if spec.endswith("side_effect"):          # __float__ ran in a worker, never in the trainer
        assert int((tmp_path / "float_ran_in").read_text()) != os.getpid()
    if "forks" in spec:                       # the call's leftover child was killed
        assert scorer.pool.leftovers_killed >= 1
    again = scorer([Problem("q", "1")], [str(tmp_path / "again")])   # the pool still answers
    scorer.close()
    assert again.failures[HOSTILE_FUNCTIONS[spec]] == (HOSTILE_FUNCTIONS[spec] != "ok")
    time.sleep(0.2)
    assert not sleepers()


def test_a_broken_pool_is_rebuilt_and_a_missed_deadline_returns():
    from pebble.pool.base_pool import PoolStatus
    scorer = Scorer(RewardConfig(verifier="none", timeout_s=30.0, workers=1,
                                 functions=("tests.hostile_rewards:never_returns",)))
    scorer.pool.deadline = lambda n: 1.0          # the batch's deadline, far below the call's timeout
    t0 = time.perf_counter()
    assert scorer([Problem("q", "1")], ["a"]).failures == {"timeout": 1}
    assert time.perf_counter() - t0 < 6 and scorer.pool.rebuilds == 1
    scorer.pool._started()._context.status = PoolStatus.ERROR   # as pebble marks a broken pool
    scorer.pool.deadline = lambda n: 1.0
    assert scorer([Problem("q", "1")], ["a"]).failures == {"timeout": 1}
    assert scorer.pool.rebuilds >= 2
    scorer.close()


# ---------------------------------------------------------------------------------------------
# end to end: a 2-step run whose policy writes hostile answers and whose rewards are hostile
# ---------------------------------------------------------------------------------------------

TINY = ["--data.eval_size", "0", "--data.system_prompt", "null", "--tensorboard", "false",
        "--threads", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "4",
        "--checkpoint.every_minutes", "null", "--optim.lr", "1e-3", "--rollout.max_new_tokens", "4"]


class HostileWriter:
    """An engine whose responses are the given texts (row i gets texts[i % len]): a policy
    that writes exactly what the red team wants scored."""

    def __init__(self, model, tokenizer, texts):
        self.model, self.tokenizer, self.texts = model, tokenizer, texts
        self.inner = make_engine("hf", model, tokenizer)

    def sync_weights(self):
        pass

    def generate(self, prompts, group_size, params, generator=None, seeds=None):
        out = self.inner.generate(prompts, group_size, replace(params, max_new_tokens=1),
                                  generator, seeds)
        B = len(out.truncated_B)
        rows = [self.tokenizer(self.texts[i % len(self.texts)], add_special_tokens=False)["input_ids"]
                + [self.tokenizer.eos_token_id] for i in range(B)]
        T = max(map(len, rows))
        ids = torch.full((B, T), self.tokenizer.pad_token_id)
        mask = torch.zeros(B, T)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1.0
        return replace(out, response_ids_B_T=ids, response_mask_B_T=mask, logp_B_T=torch.zeros(B, T),
                       truncated_B=torch.zeros(B, dtype=torch.bool))


def test_a_training_run_scores_hostile_answers_and_rewards_and_finishes(tmp_path, tokenizer, monkeypatch):
    pytest.importorskip("reasoning_gym")
    import posttrain.train_run as train_run
    marker = tmp_path / "PWNED"
    model = make_tiny_model(tokenizer)
    monkeypatch.setattr(train_run, "make_engine",
                        lambda *a, **k: HostileWriter(model, tokenizer, hostile_answers(marker)[:4]))
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "2",
                             "--data.task", "reasoning_gym:spiral_matrix", "--data.train_size", "8",
                             "--reward.timeout_s", "1", "--reward.functions",
                             "tests.hostile_rewards:forks_and_leaves,tests.hostile_rewards:raises_unpicklable,"
                             "tests.hostile_rewards:returns_huge"])
    summary = train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    assert summary["steps"] == 2 and not marker.exists()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in rows if "reward/mean" in r]
    # every call of the two failing functions (8 answers each) is counted as a failure: mostly
    # errors, but returns_huge building its 160 MB list can pass the 1 s timeout on a loaded
    # machine (a full suite on 2 cores), and is then counted as a timeout
    failed = [sum(r.get(f"reward/failures_{k}", 0) for k in ("error", "timeout", "crash"))
              for r in steps]
    assert failed == [16, 16]
    assert all(r["reward/failures_error"] >= 8 for r in steps)   # raises_unpicklable: always
    assert [r["reward/accuracy"] for r in rows if "reward/mean" in r] == [0.0, 0.0]
    time.sleep(0.2)
    assert not sleepers()


def test_a_reward_that_always_fails_stops_the_run_with_its_traceback(tmp_path, tokenizer):
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "6",
                             "--reward.functions", "tests.toy_rewards:raises"])
    with pytest.raises(FailingSourceError) as e:
        train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    msg = str(e.value)
    assert "reward function 'tests.toy_rewards:raises'" in msg and "3 steps in a row" in msg
    assert 'raise RuntimeError("broken reward")' in msg      # the first failure's traceback
    steps = [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert max(steps) == 2                                   # stopped at step 3, before its update


def test_failure_watch_needs_most_calls_failing_on_consecutive_steps():
    watch = FailureWatch(patience=2)
    bad, half, good = Tally(4, 3, "tb"), Tally(4, 2), Tally(4, 0)
    assert watch.check(1, {"f": bad}) is None
    assert watch.check(2, {"f": half}) is None        # half is not most: the count restarts
    assert watch.check(3, {"f": bad}) is None
    assert "f failed on 3 of 4" in watch.check(4, {"f": bad}) and "tb" in watch.check(5, {"f": bad})
    assert watch.check(6, {"g": good}) is None and "f" not in watch.streaks   # not called: reset
    assert FailureWatch(0).check(1, {"f": Tally(1, 1)}) is None


def test_a_nonfinite_metric_is_logged_as_such(tmp_path):
    from posttrain.logging import MetricsLogger, number, read_metrics
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss/policy": float("nan"), "policy/kl_ref": torch.tensor(float("inf")),
                   "rollout/length_correct": None, "reward/mean": 0.5})
    logger.close()
    row = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert row == {"step": 1, "loss/policy": "nan", "policy/kl_ref": "inf",
                   "rollout/length_correct": None, "reward/mean": 0.5}
    assert number(row["policy/kl_ref"]) == float("inf") and number(row["rollout/length_correct"]) is None


def test_a_chat_template_that_raises_is_reported(tokenizer):
    import copy
    from posttrain.prompts import ReplyEncoder
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                            "{{ raise_exception('roles must be user/assistant') }}{% endif %}"
                            "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(ValueError, match="raised on a 'tool' message.*roles must be user/assistant"):
        ReplyEncoder(strict).encode({"role": "tool", "content": "42"}, policy_wrote_eos=True)


@pytest.mark.parametrize("tool,text,stops", [
    ("tests.toy_rewards:tool_raises", "<tool_raises>a</tool_raises>", True),   # a broken tool
    ("calculator", "<calculator>2+</calculator>", False)])                     # the model's bad input
def test_a_broken_tool_stops_the_run_and_bad_arguments_do_not(tmp_path, tokenizer, monkeypatch,
                                                              tool, text, stops):
    import posttrain.train_run as train_run
    model = make_tiny_model(tokenizer)
    monkeypatch.setattr(train_run, "make_engine", lambda *a, **k: HostileWriter(model, tokenizer, [text]))
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "4",
                             "--env.tools", tool, "--env.max_turns", "2"])
    if stops:
        with pytest.raises(FailingSourceError, match="(?s)tools failed on 16 of 16 calls.*broken tool"):
            train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    else:
        assert train(cfg, model=model, tokenizer=tokenizer, show_progress=False)["steps"] == 4
        rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
        assert all(r["env/tool_failures"] == r["env/tool_calls"] > 0 and r["env/tools_broken"] == 0.0
                   for r in rows if "env/tool_failures" in r)
