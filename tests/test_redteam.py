"""Red team, rewards side: answers a policy wrote and reward functions a user wrote, each hostile
in its own way, against the trainer that scores them. Every case must be contained (the trainer's
process, files and other processes untouched, the call answered within its deadline) and counted
(a failure status, never a silent pass). The python tool's sandbox has its own red team
(tests/test_sandbox.py); checkpoints theirs (tests/test_checkpoint_safety.py)."""

import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from posttrain import load_config, train
from posttrain.config.sections import RewardConfig
from posttrain.data.tasks import Problem
from posttrain.util.errors import FailingSourceError
from posttrain.util.health import FailureWatch, Tally
from posttrain.rewards import Scorer
from posttrain.rewards.pool import Outcome
from posttrain.sandbox.procs import processes
from posttrain.rollout import make_engine
from tests.conftest import make_tiny_model

EVAL_TASKS = ["spiral_matrix", "string_insertion", "binary_matrix", "n_queens"]     # Python's eval
SYMPY_TASKS = ["puzzle24", "countdown", "polynomial_multiplication", "simple_integration",
               "intermediate_integration"]                                       # sympy's parse_expr


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
    for pid in processes():
        try:
            if b"61.5" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


@pytest.fixture(scope="module")
def gym():
    import reasoning_gym  # noqa: F401  (installed by scripts/install-cpu.sh)
    from posttrain.data.gym import reasoning_gym_task
    return {name: reasoning_gym_task(name, {}, 2, 7, 4).eval_problems[0]
            for name in EVAL_TASKS + SYMPY_TASKS}


@pytest.fixture(scope="module")
def gym_scorer():
    """One reasoning-gym scorer for the tasks below (its sandbox started once; an answer that
    took it over would show in the next task's batch too)."""
    scorer = Scorer(RewardConfig(verifier="math", timeout_s=3.0), "reasoning_gym")
    scorer.start()
    yield scorer
    scorer.close()


@pytest.mark.parametrize("name", EVAL_TASKS + SYMPY_TASKS)
def test_eval_answers_to_reasoning_gym_scorers_run_nothing(gym, gym_scorer, name, tmp_path):
    marker = tmp_path / "PWNED"
    answers = hostile_answers(marker)
    t0 = time.perf_counter()
    result = gym_scorer([gym[name]] * len(answers), answers)
    assert not marker.exists(), f"{name}: an answer's code ran"
    assert result.correct_B.tolist() == [False] * len(answers)
    assert time.perf_counter() - t0 < 20           # 9**9**9**9 never reached eval
    # the true answer still scores: the literal-only check refuses code, not answers
    assert gym_scorer([gym[name]], [gym[name].answer]).correct_B.item()


def test_the_nine_evaluating_tasks_are_exactly_the_gated_ones():
    """Read from reasoning-gym's source: every task whose scorer reaches eval or parse_expr is
    gated, and the gate is chosen by the task an entry came from (a composite's too)."""
    from posttrain.data.gym import EVAL_SCORERS, SYMPY_SCORERS, gate, safe_for_eval, safe_for_sympy
    assert EVAL_SCORERS == set(EVAL_TASKS) and SYMPY_SCORERS == set(SYMPY_TASKS)
    assert gate("composite", {"metadata": {"source_dataset": "countdown"}}) is safe_for_sympy
    assert gate("composite", {"metadata": {"source_dataset": "n_queens"}}) is safe_for_eval
    assert gate("leg_counting", {}) is None


def test_the_arithmetic_check_passes_answers_and_refuses_code():
    from posttrain.data.gym import safe_for_sympy
    assert all(map(safe_for_sympy, ["10*(8 - 5) - 6", "-896*x**3 + 2240*x**2 + 3584*x",
                                    "-4*(-2*x - 8)**(3/2)/3 + C", "-2*x**3*cos(x) + 12*sin(x) + C"]))
    assert not any(map(safe_for_sympy, ["__import__('os').system('x')", "9**9**9**9", "x^2", "3!",
                                        "((9**16)**16)**16", "x**(10**9)", "exp(x).__class__",
                                        "sin(x, evaluate=False)", "[0]*10**9", "a_b", "lambda: 1",
                                        "9**(16/(1/(16/(1/16))))", "x**(1/0)", "x**17.0"]))


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
    if spec.endswith("side_effect"):          # __float__ ran in a worker, never in the trainer,
        assert outcomes[0].value != os.getpid()   # and its file write never left the sandbox
        assert not (tmp_path / "float_ran_in").exists()
    again = scorer([Problem("q", "1")], [str(tmp_path / "again")])   # the pool still answers
    scorer.close()
    assert again.failures[HOSTILE_FUNCTIONS[spec]] == (HOSTILE_FUNCTIONS[spec] != "ok")
    time.sleep(0.2)
    assert not sleepers()


def test_a_missed_deadline_returns_and_the_next_batch_is_answered():
    scorer = Scorer(RewardConfig(verifier="none", timeout_s=30.0, workers=1,
                                 functions=("tests.hostile_rewards:never_returns",)))
    scorer.pool.deadline = lambda n: 1.0          # the batch's deadline, far below the call's timeout
    t0 = time.perf_counter()
    assert scorer([Problem("q", "1")], ["a"]).failures == {"timeout": 1}
    assert time.perf_counter() - t0 < 6 and scorer.pool.rebuilds == 0   # (the host answered)
    assert scorer([Problem("q", "1")], ["a"]).failures == {"timeout": 1}
    scorer.close()


def test_a_share_that_dies_gives_its_other_calls_to_a_new_process():
    """Inside the host: one process runs calls 0-3 one after another; call 1 kills its process.
    Call 1 is a crash, the calls after it run in a new process, and every call is answered once."""
    from posttrain.rewards.host import Batch, _FUNCTIONS
    from tests import toy_rewards
    _FUNCTIONS.update({"ok": toy_rewards.always_one, "dies": toy_rewards.dies})
    kw = {"prompt": "", "completion": "", "answer": ""}
    calls = [("function", name, kw) for name in ("ok", "dies", "ok", "ok")]
    outcomes = Batch(calls, 1, 5.0, 20.0).run()
    assert [o[1] for o in outcomes] == ["ok", "crash", "ok", "ok"]
    assert [o[0] for o in outcomes] == [1.0, None, 1.0, 1.0]


@pytest.mark.parametrize("line,ok", [
    (b'[1.0, "ok", null]', True), (b'[1e999, "ok", null]', False), (b'[NaN, "ok", null]', False),
    (b"[" + b"1" * 400 + b', "ok", null]', False), (b'[1.0, "hacked", null]', False),
    (b'[1.0, "error", null]', False), (b'[null, "error", 5]', False), (b'["1", "ok", null]', False),
    (b"[" * 100_000, False), (b"\x80abc", False), (b'[null, "timeout", "tb"]', True)])
def test_every_outcome_line_is_checked(line, ok):
    """A call's line is the only thing that leaves its process: a number only with 'ok', finite,
    a known status, a traceback of text; anything else is not an outcome (the call a crash)."""
    from posttrain.rewards.host import parse_outcome
    assert (parse_outcome(line) is not None) == ok


# ---------------------------------------------------------------------------------------------
# the sandbox alone: answers that sympy's parse_expr runs, with posttrain's gate left out
# ---------------------------------------------------------------------------------------------

SECRET = "hunter2-reward-secret"


def payloads(marker: Path, port: int, pid: int) -> dict[str, str]:
    """What an answer can make parse_expr (it evaluates Python, builtins included) do."""
    return {
        "writes a file": f"__import__('pathlib').Path('{marker}').write_text('x')",
        # (SystemExit passes the scorers' own `except Exception`: its text comes back as the error)
        "reads the environment": ("__import__('sys').exit(__import__('os').environ.get("
                                  "'POSTTRAIN_TEST_SECRET', 'no'))"),
        "reads the trainer's environ": f"__import__('sys').exit(open('/proc/{pid}/environ').read())",
        # (the port as a string: parse_expr turns number literals, and int(), into sympy objects)
        "opens a socket": (f"__import__('socket').create_connection(('127.0.0.1', "
                           f"__import__('builtins').int('{port}')))"),
        "allocates 8 GB": "len(bytearray(8 * 2**30))",
        "forks and hangs": ("[__import__('os').fork() and 0, __import__('os').execvp('sleep', "
                            "['sleep', '61.5'])][0] if __import__('os').fork() == 0 else "
                            "__import__('time').sleep(60)"),
        "kills its parent": "__import__('os').kill(__import__('os').getppid(), 9)",
    }


@pytest.fixture(scope="module")
def unguarded(gym):
    """A scorer whose reward function calls reasoning-gym's scorer itself (no gate), started
    while the trainer's environment holds a secret; and a loopback server counting connections."""
    os.environ["POSTTRAIN_TEST_SECRET"] = SECRET
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.2)
    scorer = Scorer(RewardConfig(verifier="none", timeout_s=1.0, workers=2, max_failing_steps=0,
                                 functions=("tests.hostile_rewards:gym_unguarded",)))
    scorer.start()
    del os.environ["POSTTRAIN_TEST_SECRET"]
    yield scorer, server
    scorer.close()
    server.close()


def _connections(server) -> int:
    n = 0
    while True:
        try:
            server.accept()[0].close()
            n += 1
        except OSError:
            return n


@pytest.mark.parametrize("payload", ["writes a file", "reads the environment",
                                     "reads the trainer's environ", "opens a socket",
                                     "allocates 8 GB", "forks and hangs", "kills its parent"])
@pytest.mark.parametrize("task", SYMPY_TASKS)
def test_the_sandbox_contains_what_parse_expr_runs(unguarded, gym, task, payload, tmp_path):
    """With the gate left out, each answer runs inside the sandbox: nothing written, nothing
    read, no connection, the 8 GB refused, the fork and hang killed, the trainer alive, the call
    counted as failed, and the next batch answered."""
    scorer, server = unguarded
    marker = tmp_path / "PWNED"
    answer = payloads(marker, server.getsockname()[1], os.getpid())[payload]
    t0 = time.perf_counter()
    outcome = scorer.pool.map(scorer._calls([gym[task]], [answer])[0])[0]
    assert time.perf_counter() - t0 < 15
    assert outcome.value != 1.0                        # (the scorer's own 0.01 for a wrong answer)
    assert not marker.exists() and _connections(server) == 0
    assert SECRET not in (outcome.error or "")
    if payload == "reads the environment" and outcome.status == "error":   # (a bare `except:`
        assert outcome.error.rstrip().endswith("no")   # swallows it) it ran: an empty environment
    if payload == "reads the trainer's environ":       # no such process in its namespace
        assert "PATH=" not in (outcome.error or "")
    if payload == "forks and hangs":                   # killed at reward.timeout_s, counted
        assert outcome.status == "timeout"
    time.sleep(0.2)
    assert not sleepers()
    # the trainer is alive (this line runs) and the sandbox answers the next batch
    again = scorer.pool.map(scorer._calls([gym[task]], [gym[task].answer])[0])[0]
    assert again.status == "ok" and again.value == 1.0


def test_the_payloads_do_what_they_say_outside_the_sandbox(gym, tmp_path, monkeypatch):
    """Not vacuous: scored with reward.sandbox off, the same answers write the file, name the
    secret and connect (so the sandboxed runs above would show each if it got out)."""
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", SECRET)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.5)
    marker = tmp_path / "PWNED"
    scorer = Scorer(RewardConfig(verifier="none", timeout_s=2.0, workers=1, sandbox="off",
                                 functions=("tests.hostile_rewards:gym_unguarded",)))
    live = payloads(marker, server.getsockname()[1], os.getpid())
    answers = [live[k] for k in ("writes a file", "reads the environment", "opens a socket",
                                 "reads the trainer's environ")]
    outcomes = scorer.pool.map(scorer._calls([gym["countdown"]] * 4, answers)[0])
    scorer.close()
    assert marker.exists() and SECRET in outcomes[1].error, outcomes
    assert _connections(server) == 1, outcomes
    assert "PATH=" in outcomes[3].error          # the trainer's environ, read by pid
    server.close()


# ---------------------------------------------------------------------------------------------
# the trainer's side: it never trusts what comes out of the sandbox
# ---------------------------------------------------------------------------------------------

FAKE_HOSTS = {   # what a host taken over by an answer could send back after its ready line
    "infinite reward": b'{"outcomes": [[1e999, "ok", null]], "leftovers_killed": 0}\\n',
    "a huge integer": b'{"outcomes": [[' + b"9" * 400 + b', "ok", null]], "leftovers_killed": 0}\\n',
    "a pickle": "pickle.dumps(print) + b'\\\\n'",
    "endless": "b'[' * 10**7",
    "nothing": "b''",
    "too many rows": b'{"outcomes": [[1.0, "ok", null], [1.0, "ok", null]], "leftovers_killed": 0}\\n',
    "nested": "b'[' * 100000 + b']' * 100000 + b'\\\\n'",
}


@pytest.mark.parametrize("kind", sorted(FAKE_HOSTS))
def test_a_host_that_answers_garbage_is_killed_and_replaced(kind, monkeypatch):
    """A host taken over by an answer writes whatever it likes on its reply pipe: each reply
    out of shape (or none) fails the batch's calls and the host is replaced, within the
    deadline; the trainer raises nothing and the next host answers."""
    import posttrain.rewards.pool as pool_module
    payload = FAKE_HOSTS[kind]
    payload = repr(payload) if isinstance(payload, bytes) else payload
    fake = ("import json, os, pickle, sys, time; c = json.loads(sys.argv[1]); "
            "os.write(c['reply_fd'], b'{\"ready\": true}\\n'); os.read(c['request_fd'], 8); "
            f"data = {payload}; [os.write(c['reply_fd'], data[i:i + 65536]) for i in "
            "range(0, len(data), 65536)]; time.sleep(60)")
    pool = pool_module.RewardPool(("tests.toy_rewards:always_one",), 1, 1.0, "off")
    pool.deadline = lambda n: 0.5
    monkeypatch.setattr(pool_module, "BACKSTOP_S", 1.0)
    monkeypatch.setattr(pool_module, "_BOOT", fake)
    call = ("function", "tests.toy_rewards:always_one", {"prompt": "", "completion": "", "answer": ""})
    t0 = time.perf_counter()
    out = pool.map([call])
    assert time.perf_counter() - t0 < 5 and pool._host is None and pool.rebuilds == 1
    assert out[0].value is None and out[0].status in ("crash", "timeout")
    monkeypatch.undo()                               # a real host answers the next batch
    assert pool.map([call])[0] == Outcome(1.0, "ok")
    pool.close()


def test_a_host_that_stops_reading_cannot_hang_the_trainer(monkeypatch):
    """A request far larger than a pipe holds, to a host that never reads it: the write gives up
    at the deadline, the batch fails, the host is replaced."""
    import posttrain.rewards.pool as pool_module
    fake = ("import json, os, sys, time; c = json.loads(sys.argv[1]); "
            "os.write(c['reply_fd'], b'{\"ready\": true}\\n'); time.sleep(60)")
    pool = pool_module.RewardPool(("tests.toy_rewards:always_one",), 1, 1.0, "off")
    pool.deadline = lambda n: 1.0
    monkeypatch.setattr(pool_module, "_BOOT", fake)
    big = {"prompt": "", "completion": "x" * (4 << 20), "answer": ""}
    t0 = time.perf_counter()
    out = pool.map([("function", "tests.toy_rewards:always_one", big)])
    assert time.perf_counter() - t0 < 8 and out[0].status == "crash" and pool.rebuilds >= 1
    pool.close()


@pytest.mark.slow   # (~20 s; a call killed for memory, quick: tests/test_sandbox_limits.py)
def test_the_sandbox_memory_in_all_is_bounded(tmp_path):
    """Six processes of 300 MB each stay under the per-process limit; together they pass
    reward.memory_mb: the sandbox is killed, the batch counted as the memory limit, the next one
    fine."""
    scorer = Scorer(RewardConfig(verifier="none", timeout_s=60.0, workers=1, memory_mb=1024,
                                 functions=("tests.hostile_rewards:hogs_memory_in_processes",)))
    # (counted as the memory limit, not reward.timeout_s: the kill came before the 60 s timeout;
    # no wall-clock bound, which a loaded machine passes: the host's start is in it too)
    result = scorer([Problem("q", "1")] * 2, ["hog", "x"])
    assert result.failures == {"memory_limit": 2} and scorer.pool.rebuilds == 1
    assert "more than 1024 MB in all" in result.tallies[
        "reward function 'tests.hostile_rewards:hogs_memory_in_processes'"].first_error
    assert scorer([Problem("q", "1")], ["x"]).rewards_B.tolist() == [1.0]
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
    import reasoning_gym  # noqa: F401  (installed by scripts/install-cpu.sh)
    import posttrain.sampling.service as sampling
    marker = tmp_path / "PWNED"
    model = make_tiny_model(tokenizer)
    monkeypatch.setattr(sampling, "make_engine",
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
    from posttrain.logs.metrics import MetricsLogger, number, read_metrics
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
    from posttrain.model.prompts import ReplyEncoder
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
    import posttrain.sampling.service as sampling
    model = make_tiny_model(tokenizer)
    monkeypatch.setattr(sampling, "make_engine", lambda *a, **k: HostileWriter(model, tokenizer, [text]))
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


# ---------------------------------------------------------------------------------------------
# tool calls the model wrote wrong: its errors, never a broken environment
# ---------------------------------------------------------------------------------------------

MALFORMED_CALLS = {
    "name is a list": '<tool_call>{"name": ["calculator"], "arguments": {}}</tool_call>',
    "name is a number": '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    "call is a list": '<tool_call>["calculator", {"expression": "1+1"}]</tool_call>',
    "arguments are a list": '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>',
    "arguments are bad JSON text": '<tool_call>{"name": "calculator", "arguments": "{x"}</tool_call>',
    "nested 100,000 deep": '<tool_call>{"name": "calculator", "arguments": ' + "[" * 100_000 + "</tool_call>",
    "a huge number": '<tool_call>{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}</tool_call>",
    "a number past 2**63": '<tool_call>{"name": "calculator", "arguments": {"expression": 1e400}}</tool_call>',
    "unknown tool": '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    "no closing tag": '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}',
    "an argument of the wrong type": '<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>',
    "unknown argument": '<tool_call>{"name": "calculator", "arguments": {"x": "1"}}</tool_call>',
    "tag format, deep JSON": "<calculator>" + "{" * 50_000 + "</calculator>",
}


@pytest.mark.parametrize("case", sorted(MALFORMED_CALLS))
def test_a_malformed_tool_call_is_the_models_error(case):
    from posttrain.envs.builtin import ToolEnv
    from posttrain.envs.tools import make_tools
    fmt = "tag" if case.startswith("tag") else "json"
    env = ToolEnv(tuple(make_tools(("calculator",))), format=fmt)
    reply = env.step(env.reset(None), MALFORMED_CALLS[case], 1)        # (never raises)
    assert reply.message["content"].startswith("error") and reply.counts["tools_broken"] == 0
    assert reply.counts["malformed_calls"] + reply.counts["tool_failures"] >= 1


def test_a_policy_writing_malformed_calls_cannot_stop_the_run(tmp_path, tokenizer, monkeypatch):
    """Four steps of nothing but malformed calls (the failure watch stops a run after 3 steps
    of a broken environment): the run finishes, every call counted as the model's error."""
    import posttrain.sampling.service as sampling
    model = make_tiny_model(tokenizer)
    texts = [MALFORMED_CALLS[k] for k in ("name is a list", "call is a list", "a number past 2**63",
                                          "arguments are a list")]
    monkeypatch.setattr(sampling, "make_engine", lambda *a, **k: HostileWriter(model, tokenizer, texts))
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "4",
                             "--env.tools", "calculator", "--env.tool_format", "json",
                             "--env.max_turns", "2", "--env.max_tokens", "96"])
    assert train(cfg, model=model, tokenizer=tokenizer, show_progress=False)["steps"] == 4
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in rows if "env/malformed_calls" in r]
    assert len(steps) == 4 and all(r["env/malformed_calls"] > 0 and r["env/tools_broken"] == 0
                                   for r in steps)


def test_tool_time_is_capped_per_step_across_episodes():
    """Each episode stays within its own 30 s, but the batch's episodes together get 0.5 s: the
    later ones are answered that the step's tool time is used up (and start_batch restarts it)."""
    from posttrain.envs.builtin import ToolEnv
    from posttrain.envs.tools import Tool
    nap = Tool("nap", "sleeps", {"type": "object", "properties": {"s": {"type": "string"}}},
               lambda s: time.sleep(float(s)) or "woke")
    env = ToolEnv((nap,), format="tag", timeout_s=5.0, seconds_per_episode=30.0, seconds_per_batch=0.5)
    env.start_batch()
    replies = [env.step(env.reset(None), "<nap>0.2</nap>", 1) for _ in range(4)]
    texts = [r.message["content"] for r in replies]
    assert texts[:2] == ["woke", "woke"] and "step's 0.5 s of tool time are used up" in texts[3]
    env.start_batch()
    assert env.step(env.reset(None), "<nap>0.1</nap>", 1).message["content"] == "woke"


# ---------------------------------------------------------------------------------------------
# no backtracking on model text in the trainer's process
# ---------------------------------------------------------------------------------------------

N = 100_000
ADVERSARIAL = {   # 100,000 characters each
    "number, spaces, letter": "1" + " " * (N - 2) + "x",      # 10 s at 2,000 with the old format regex
    "boxed number, spaces": "\\boxed{1" + " " * (N - 10) + "}x",
    "digits": "1" * N, "digits and commas": "1," * (N // 2), "spaces and dots": " ." * (N // 2),
    "open tool calls": "<tool_call>" * (N // 11), "open tags": "<calculator>" * (N // 12),
    "braces": "{" * N, "brackets": "[" * N, "newlines": "\n" * N, "unicode": "é " * (N // 2),
    "minus signs": "-" * N,
}


def _trainer_side_parsers(tokenizer):
    """Every function of the trainer's own process that reads a whole answer the model wrote."""
    from posttrain.envs.builtin import GuessNumber, ToolEnv
    from posttrain.envs.tools import make_tools, parse_calls
    from posttrain.rewards.verifiers import is_bare_answer
    tools = {t.name: t for t in make_tools(("calculator",))}
    json_env = ToolEnv(tuple(tools.values()), format="json")
    tag_env = ToolEnv(tuple(tools.values()), format="tag")
    return {
        "format reward (is_bare_answer)": is_bare_answer,
        "tool calls, json": lambda t: parse_calls(t, tools, "json"),
        "tool calls, tag": lambda t: parse_calls(t, tools, "tag"),
        "tool environment turn, json": lambda t: json_env.step(json_env.reset(None), t, 1),
        "tool environment turn, tag": lambda t: tag_env.step(tag_env.reset(None), t, 1),
        "guess-number turn": lambda t: GuessNumber().step(5, t, 1),
        "tokenizer (reward model, environment replies)": lambda t: tokenizer(t)["input_ids"],
    }   # (stop strings are looked for in the last few tokens only: rollout/hf.py stop_window)


def test_every_trainer_side_parser_reads_100k_adversarial_characters_in_under_a_second(tokenizer):
    slow = {}
    for pname, parse in _trainer_side_parsers(tokenizer).items():
        for aname, text in ADVERSARIAL.items():
            assert len(text) >= N - 12
            t0 = time.perf_counter()
            parse(text)
            if (took := time.perf_counter() - t0) > 1.0:
                slow[f"{pname} on {aname}"] = round(took, 2)
    assert not slow, slow


def test_the_format_check_is_the_pattern_it_replaced():
    """is_bare_answer without the backtracking regex says what the regex said, on every string
    of up to 5 pieces of the alphabet that matters (111,110 strings)."""
    import itertools
    import re
    from posttrain.rewards.verifiers import is_bare_answer
    old = re.compile(r"^\s*(\\boxed\{)?\s*-?[\d,]+(\.\d+)?\s*\}?\s*\.?\s*$")
    alphabet = ["1", "2", ",", ".", "-", " ", "}", "\\boxed{", "x", "\n"]
    for k in range(1, 6):
        for parts in itertools.product(alphabet, repeat=k):
            text = "".join(parts)
            assert is_bare_answer(text) == bool(old.match(text)), text


def test_a_reused_pid_is_never_taken_for_a_worker():
    """reap kills what is left in a worker's process group; a group whose leader pid now names a
    process started later (the kernel reused the pid) is somebody else's and is left alone."""
    from posttrain.sandbox.procs import reap_groups, start_time
    other = subprocess.Popen(["sleep", "61.3"], start_new_session=True)   # leads its own group
    try:
        time.sleep(0.1)
        killed, forget = reap_groups({other.pid: start_time(other.pid) - 1}, leaders_too=True)
        assert killed == 0 and forget == {other.pid} and other.poll() is None
        killed, forget = reap_groups({other.pid: start_time(other.pid)}, leaders_too=True)
        assert killed == 1 and other.wait(timeout=5) == -9
    finally:
        other.kill()
        other.wait()


def test_a_restarted_host_is_warm_before_the_batch_clock_starts():
    """A batch of right answers after a restart (an answer killed the host) is scored like any
    other: the new host is started, and has imported what the run's verifier imports on first
    use (reasoning-gym: one to two seconds), before the batch is sent and its deadline starts.
    A call's process is a fork of the host, so an import the host did not do runs again in every
    call, and on a slower machine passes a short reward.timeout_s. The batch holds only the
    function (in a scored batch the verifier's call would import reasoning-gym itself first)."""
    import reasoning_gym  # noqa: F401  (installed by scripts/install-cpu.sh)
    from posttrain.rewards.pool import RewardPool
    from posttrain.sandbox.launch import decide
    seen = "tests.toy_rewards:sees_reasoning_gym"
    mode = decide("auto", "the reward host", "reward.sandbox")
    pool = RewardPool((seen,), 1, 10.0, mode, verifiers=("reasoning_gym",))
    call = [("function", seen, {"prompt": "q", "completion": "a", "answer": "1"})]
    try:
        assert [(o.status, o.value) for o in pool.map(call)] == [("ok", 1.0)]
        pool._restart()                          # the host killed between two batches
        assert [(o.status, o.value) for o in pool.map(call)] == [("ok", 1.0)]
        assert pool.rebuilds == 1
    finally:
        pool.close()
