"""An episode that never answers must not hang the run (rollout/turns.py, run/lifecycle.py):
one past env.turn_timeout_s or env.episode_timeout_s is ended, counted (env/timeouts, an
environment error) and left out of its group's baseline and the loss while the batch goes on;
an OpenEnv step that never answers ends its episode the same way; and a stop signal ends a run
whose step cannot finish within checkpoint.stop_grace_s (or at once, at a second signal), the
last checkpoint kept and summary.json saying so. Nothing is lost on the way: a finished
episode's result, an OpenEnv session opened late, the engine left alone once the step stops;
and inf, which the options accept as "no limit", is no limit everywhere."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from posttrain.config.options import load_config
from posttrain.data.tasks import Problem
from posttrain.rl.loop import train
import posttrain.rl.loop as trainer
from posttrain.envs.base import Driven
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.driven import (DrivenBatch, EpisodeOver, PolicyClient, Recorder, Session,
                                      TurnBatcher)
from posttrain.rollout.episodes import EpisodeSettings, run_episodes
from tests import agents
from tests.agents import DrivenGuess
from tests.conftest import make_tiny_model
from tests.test_driven import PARAMS, PROBLEMS, SEEDS

ROOT = Path(__file__).resolve().parent.parent
HUNG = threading.Event()   # what a hung episode waits on: set when each test ends


@pytest.fixture(autouse=True)
def release_hung_threads():
    HUNG.clear()
    agents.RELEASE.clear()
    agents.STARTED.update(episodes=0, steps=0)
    yield
    HUNG.set()
    agents.RELEASE.set()


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_engine("hf", make_tiny_model(tokenizer, seed=3), tokenizer)


def limits(turn: float | None, episode: float | None) -> EpisodeSettings:
    return EpisodeSettings(None, True, None, 24, 16, turn, episode)


class HangsOnRow(DrivenGuess):
    """DrivenGuess whose episode of row `row` never asks after its first turn (a harness stuck
    in a tool); `slow`: every episode waits that long before each request."""

    def __init__(self, row: int | None = 1, slow: float = 0.0) -> None:
        super().__init__(3)
        self.row, self.slow = row, slow

    def drive(self, policy, problem):
        inner = policy.chat

        def chat(messages, *a, **kw):
            if self.slow:
                time.sleep(self.slow)
            if policy.row == self.row and len(messages) > 1:
                HUNG.wait()
            return inner(messages, *a, **kw)
        policy.chat = chat
        return super().drive(policy, problem)


def test_a_hung_episode_is_ended_counted_and_left_out_while_the_batch_goes_on(engine, tokenizer):
    whole = run_episodes(engine, tokenizer, HangsOnRow(None), PROBLEMS, 2, PARAMS,
                         settings=limits(None, None), seeds=SEEDS)
    t0 = time.monotonic()
    out = run_episodes(engine, tokenizer, HangsOnRow(1), PROBLEMS, 2, PARAMS,
                       settings=limits(1.0, None), seeds=SEEDS)
    assert time.monotonic() - t0 < 30
    assert out.timed_out == [False, True, False, False]
    assert out.counts["timeouts"] == 1 and out.counts["env_errors"] == 1
    assert "env.turn_timeout_s=1" in out.errors["environment"]
    assert out.scored(None, "cpu").tolist() == [True, False, True, True]
    judged = torch.tensor([True, True, False, True])   # (and an unscorable response stays out)
    assert out.scored(judged, "cpu").tolist() == [True, False, False, True]
    assert out.tallies()["environment"].failures == 1
    ro, ref = out.rollout, whole.rollout
    assert ro.policy_tokens_B_T[1].sum() == 0 and out.env_rewards_B[1] == 0
    for r in (0, 2, 3):   # the others went on as if nothing hung
        n = int(ref.response_mask_B_T[r].sum())
        assert ro.response_ids_B_T[r, :n].tolist() == ref.response_ids_B_T[r, :n].tolist()
    assert out.counts["turns"] > 4


def test_an_episode_past_its_whole_time_limit_is_ended(engine, tokenizer):
    out = run_episodes(engine, tokenizer, HangsOnRow(None, slow=0.4), PROBLEMS, 2, PARAMS,
                       settings=limits(30.0, 0.6), seeds=SEEDS)
    assert any(out.timed_out) and out.counts["timeouts"] == sum(out.timed_out)
    assert "env.episode_timeout_s=0.6" in out.errors["environment"]
    assert all(out.rollout.policy_tokens_B_T[r].sum() == 0 for r in range(4) if out.timed_out[r])


def test_an_openenv_step_that_never_answers_ends_its_episode(engine, tokenizer):
    import openenv.core  # noqa: F401  (installed by scripts/install-cpu.sh)
    from examples.openenv_guess_number import GuessAction, GuessNumberEnv
    from posttrain.envs.openenv import OpenEnvEnvironment, action_maker

    class Stuck(GuessNumberEnv):
        def step(self, action: GuessAction, timeout_s=None, **kwargs):
            if self._state.secret == 2:   # (the second problem's episodes)
                HUNG.wait()
            return super().step(action, timeout_s, **kwargs)

    env = OpenEnvEnvironment(Stuck, action=action_maker(Stuck, "message"), max_turns=3,
                             turn_timeout_s=0.5)
    t0 = time.monotonic()
    out = run_episodes(engine, tokenizer, env, PROBLEMS, 2, PARAMS, settings=limits(None, None),
                       seeds=SEEDS)
    assert time.monotonic() - t0 < 30
    assert out.timed_out == [False, False, True, True] and out.counts["timeouts"] == 2
    assert "did not answer within 0.5 s (env.turn_timeout_s)" in out.errors["environment"]
    assert out.scored(None, "cpu").tolist() == [True, True, False, False]


class PaysOne(DrivenGuess):
    """DrivenGuess whose every episode ends with reward 1."""

    def drive(self, policy, problem):
        super().drive(policy, problem)
        return Driven(1.0, parts={"paid": 1.0})


def test_every_finished_episodes_result_is_read_out(engine, tokenizer, monkeypatch):
    """An episode's outcome reaches the batch before its row leaves the live set: recording
    it slowly loses none (the last episode's reward was read out as 0 before it was recorded)."""
    real = DrivenBatch.record

    def slow(self, *args):
        time.sleep(0.5)
        real(self, *args)
    monkeypatch.setattr(DrivenBatch, "record", slow)
    out = run_episodes(engine, tokenizer, PaysOne(3), PROBLEMS, 2, PARAMS,
                       settings=limits(None, None), seeds=SEEDS)
    assert out.env_rewards_B.tolist() == [1.0] * 4 and out.parts == [{"paid": 1.0}] * 4


class Counting:
    """An engine that counts its calls (every turn: two tokens)."""

    def __init__(self):
        self.calls = 0

    def generate(self, prompts, G, params, generator=None, seeds=None):
        from posttrain.rollout.episodes import padded_rollout
        from posttrain.rollout.sessions import EpisodeRows
        self.calls += 1
        rows = EpisodeRows(prompts, [[5, 6]] * len(prompts), [[-1.0, -1.0]] * len(prompts),
                           [[1.0, 1.0]] * len(prompts), [False] * len(prompts))
        return padded_rollout(rows, 1, 0, torch.device("cpu"))


def asking(batcher, rows):
    """Rows 1.. ask for a turn in threads; what each got (a turn or the exception)."""
    got = {}

    def ask(row):
        try:
            got[row] = batcher.ask(row, [1, 2], 2)
        except Exception as e:  # noqa: BLE001
            got[row] = e
    threads = [threading.Thread(target=ask, args=(r,), daemon=True) for r in rows]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(batcher.pending) < len(rows) and time.monotonic() < deadline:
        time.sleep(0.01)
    return got, threads


class Stop(Exception):
    pass


def test_a_stopped_step_never_calls_the_engine_again():
    """Row 0 hangs, rows 1 and 2 wait for it; a stop signal arrives: every episode ends at
    once and the engine is not called (ending row 0 first made the others ready, and the
    stopping thread sampled them: with a stuck engine, the stop waited for the hard exit)."""
    engine = Counting()
    batcher = TurnBatcher(engine, SamplingParams(2, 1.0), 3)
    got, threads = asking(batcher, [1, 2])

    def stop(signum, frame):
        raise Stop
    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident,
                                                   signal.SIGUSR1)).start()
        t0 = time.monotonic()
        with pytest.raises(Stop):
            batcher.watch()
    finally:
        signal.signal(signal.SIGUSR1, previous)
    for t in threads:
        t.join(timeout=10)
    assert time.monotonic() - t0 < 5 and engine.calls == 0
    assert all(isinstance(got[r], EpisodeOver) for r in (1, 2)) and not batcher.live


def test_the_episode_limit_ends_every_row_before_any_turn_is_sampled():
    """All three rows pass env.episode_timeout_s in one sweep (two of them waiting for the
    third): no turn is sampled for rows the sweep ends."""
    engine = Counting()
    batcher = TurnBatcher(engine, SamplingParams(2, 1.0), 3, episode_timeout_s=0.5)
    got, threads = asking(batcher, [1, 2])
    batcher.watch()
    for t in threads:
        t.join(timeout=10)
    assert engine.calls == 0 and sorted(batcher.timed_out) == [0, 1, 2]
    assert all(isinstance(got[r], EpisodeOver) for r in (1, 2))


def test_an_ended_episodes_request_is_refused_before_it_is_tokenised(tokenizer):
    from posttrain.model.prompts import ReplyEncoder
    batcher = TurnBatcher(Counting(), SamplingParams(2, 1.0), 1)
    batcher.done(0)
    session = Session()
    client = PolicyClient(0, session, Recorder(tokenizer, ReplyEncoder(tokenizer, True, None), {}),
                          batcher, PARAMS, 24)
    with pytest.raises(EpisodeOver):
        client.chat([{"role": "user", "content": "Guess a number from 1 to 8."}])
    with pytest.raises(EpisodeOver):
        client.complete("Guess a number")
    assert session.prompt is None and session.ids == []


def test_a_hung_harness_gives_back_its_endpoint_session(engine, tokenizer):
    """The endpoint session of an episode a time limit ended is dropped with the batch, though
    its harness never returns (abandoned episodes' sessions piled up, step after step)."""
    from posttrain.envs.agent import AgentEnvironment
    urls = []

    def harness(base_url, problem):
        urls.append(base_url)
        if problem.answer == "2":
            HUNG.wait()
        return 1.0
    env = AgentEnvironment(harness, 3)
    try:
        out = run_episodes(engine, tokenizer, env, PROBLEMS, 2, PARAMS,
                           settings=limits(0.5, None), seeds=SEEDS)
        assert out.timed_out == [False, False, True, True] and len(urls) == 4
        assert env.endpoint.sessions == {}
    finally:
        env.close()


def test_inf_is_no_limit_for_episodes(engine, tokenizer):
    """inf, accepted as "no limit" (env.turn_timeout_s, env.episode_timeout_s), reaches no wait
    as inf (Thread.join(inf) raised OverflowError: every OpenEnv reset failed)."""
    import openenv.core  # noqa: F401  (installed by scripts/install-cpu.sh)
    from examples.openenv_guess_number import GuessNumberEnv
    from posttrain.envs.openenv import OpenEnvEnvironment, action_maker
    inf = float("inf")
    cfg = load_config(None, ["--env.turn_timeout_s", "inf", "--env.episode_timeout_s", "inf",
                             "--checkpoint.stop_grace_s", "inf"])
    assert cfg.env.turn_timeout_s == inf and cfg.checkpoint.stop_grace_s == inf
    env = OpenEnvEnvironment(GuessNumberEnv, action=action_maker(GuessNumberEnv, "message"),
                             max_turns=2, turn_timeout_s=inf, episode_timeout_s=inf)
    out = run_episodes(engine, tokenizer, env, PROBLEMS, 2, PARAMS, settings=limits(inf, inf),
                       seeds=SEEDS)
    assert out.counts.get("env_errors", 0) == 0 and not any(out.timed_out)
    batcher = TurnBatcher(engine, PARAMS, 1, turn_timeout_s=inf, episode_timeout_s=inf)
    assert batcher.time_left() is None   # (what a verifiers rollout waits: Future.result(None))


def test_inf_is_no_limit_for_a_verifiers_rollout(tokenizer):
    import verifiers.v1  # noqa: F401  (installed by scripts/install-cpu.sh)
    from posttrain.data.source import build_task
    from posttrain.envs import for_tokenizer, make_env
    inf = float("inf")
    cfg = load_config(None, ["--data.task", "verifiers:tests.vf_sum", "--data.eval_size", "1"])
    task = build_task(cfg.data)
    env = for_tokenizer(make_env(cfg.env, task), tokenizer)
    engine = make_engine("hf", make_tiny_model(tokenizer, seed=3), tokenizer)
    try:
        out = run_episodes(engine, tokenizer, env, task.train_pool[:1], 2, PARAMS,
                           settings=EpisodeSettings(None, True, None, 32, 16, inf, inf),
                           seeds=SEEDS[:2])
    finally:
        env.close()
    assert out.counts.get("env_errors", 0) == 0, out.errors
    assert env.time_limit(type("P", (), {"time_left": lambda self: inf})()) is None


def test_an_openenv_call_is_not_started_once_the_batchs_time_is_spent():
    import openenv.core  # noqa: F401  (installed by scripts/install-cpu.sh)
    from examples.openenv_guess_number import GuessNumberEnv
    from posttrain.envs.base import EpisodeTimeout
    from posttrain.envs.openenv import OpenEnvEnvironment
    resets = []

    class Counted(GuessNumberEnv):
        def reset(self, *args, **kwargs):
            resets.append(1)
            return super().reset(*args, **kwargs)
    env = OpenEnvEnvironment(Counted, episode_timeout_s=0.05)
    env.start_batch()
    time.sleep(0.1)
    with pytest.raises(EpisodeTimeout, match="no time left"):
        env.reset(PROBLEMS[0])
    time.sleep(0.2)
    assert resets == []


def test_a_served_session_opened_after_its_reset_timed_out_is_closed(monkeypatch):
    """A served environment caps its sessions: one whose reset answered too late is closed
    when it does answer, not left open on the server."""
    import posttrain.envs.openenv as openenv
    from posttrain.envs.base import EpisodeTimeout
    closed = threading.Event()

    class Session:
        def close(self):
            closed.set()

    def late(url, kwargs, already_open, timeout_s):
        time.sleep(0.5)
        return Session()
    monkeypatch.setattr(openenv, "open_session", late)
    env = openenv.OpenEnvEnvironment(url="http://127.0.0.1:9/", turn_timeout_s=0.1)
    with pytest.raises(EpisodeTimeout, match="did not answer within 0.1 s"):
        env.reset(PROBLEMS[0])
    assert closed.wait(10) and env.open == []


def test_a_one_turn_environments_timeouts_are_logged(tmp_path, tokenizer):
    """env/timeouts is logged whenever an episode timed out, one-turn environments included."""
    import openenv.core  # noqa: F401  (installed by scripts/install-cpu.sh)
    cfg = load_config(None, [*RUN, "--env.name", "openenv", "--env.openenv",
                             "tests.agents:StuckOnceAStep", "--env.max_turns", "1", "--steps", "1",
                             "--env.turn_timeout_s", "1", "--run_dir", str(tmp_path / "r")])
    train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert [r.get("env/timeouts") for r in rows] == [0.25]


RUN = ["--data.task", "guess_number", "--data.difficulty", "8", "--data.eval_size", "0",
       "--env.max_tokens", "24", "--rollout.max_new_tokens", "4", "--rollout.prompts_per_step",
       "2", "--rollout.group_size", "2", "--data.system_prompt", "null", "--tensorboard", "false",
       "--algorithm.kl_coef", "0"]


def agent_config(tmp_path, harness: str, *extra: str):
    return load_config(None, ["--data.task", "guess_number", "--data.difficulty", "8",
                              "--data.eval_size", "0", "--env.name", "agent", "--env.agent",
                              f"tests.agents:{harness}", "--env.max_turns", "3",
                              "--env.max_tokens", "24", "--rollout.max_new_tokens", "4",
                              "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
                              "--data.system_prompt", "null", "--tensorboard", "false",
                              "--algorithm.kl_coef", "0", "--run_dir", str(tmp_path / "r"), *extra])


def test_a_run_with_a_hung_harness_finishes_its_steps_without_the_hung_episodes(
        tmp_path, tokenizer, monkeypatch):
    seen = []
    real = trainer.log_step

    def keep_batch(run, step, batch, *a, **kw):
        seen.append(batch)
        real(run, step, batch, *a, **kw)
    monkeypatch.setattr(trainer, "log_step", keep_batch)
    cfg = agent_config(tmp_path, "hangs_once_a_step", "--steps", "2", "--env.turn_timeout_s", "3")
    t0 = time.monotonic()
    train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer, show_progress=False)
    assert time.monotonic() - t0 < 120
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["env/timeouts"] == 0.25 for r in rows)
    for batch in seen:   # one hung episode a step: out of the baseline and the loss
        hung = (~batch.scored_B).nonzero().flatten().tolist()
        assert len(hung) == 1 and batch.loss_mask_B_T[hung[0]].sum() == 0
        assert batch.adv_B_T[hung[0]].abs().sum() == 0


def run_cli(tmp_path, tiny_dir, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "--no-progress",
           "--model.path", str(tiny_dir), "--data.task", "guess_number", "--data.difficulty", "8",
           "--data.eval_size", "0", "--env.name", "agent",
           "--env.agent", "tests.agents:hangs_after_the_first_step", "--env.max_turns", "3",
           "--env.max_tokens", "24", "--rollout.max_new_tokens", "4",
           "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--steps", "3",
           "--data.system_prompt", "null", "--tensorboard", "false", "--threads", "1",
           "--algorithm.kl_coef", "0", "--checkpoint.every_steps", "1",
           "--run_dir", str(tmp_path / "r"), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def stopped_after(proc: subprocess.Popen, run_dir: Path, signals: int, within: float) -> float:
    """Once step 1's checkpoint is written (step 2 hangs), send SIGTERM `signals` times; the
    seconds the process took to exit after the first (the test fails past `within`)."""
    try:
        deadline = time.monotonic() + 180
        while not (run_dir / "checkpoints" / "step_000001").is_dir():
            assert proc.poll() is None, proc.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "step 1 never finished"
            time.sleep(0.2)
        time.sleep(1.0)   # (step 2 under way, its hung episode started)
        t0 = time.monotonic()
        for _ in range(signals):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
        try:
            proc.wait(timeout=within)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run was still alive {within} s after SIGTERM")
        return time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_stopped(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["abandoned_step"] == 2
    assert summary["steps"] == 1 and summary["checkpoint"].endswith("step_000001")
    assert (run_dir / "checkpoints" / "step_000001").is_dir()
    assert not (run_dir / "checkpoints" / "step_000002").exists()
    assert not (run_dir / "final_model").exists()
    return summary


@pytest.mark.slow   # (~17 s, a whole run; the mechanism, quick: tests/test_lifecycle.py grace tests)
def test_sigterm_ends_a_run_whose_step_cannot_finish_within_the_grace(tmp_path, tiny_dir):
    proc = run_cli(tmp_path, tiny_dir, "--checkpoint.stop_grace_s", "3")
    took = stopped_after(proc, tmp_path / "r", 1, within=60)
    assert took >= 3 and proc.returncode == 0, proc.stderr.read()[-3000:]
    check_stopped(tmp_path / "r")


@pytest.mark.slow   # (14 s: a second run in a process of its own; the grace's end is quick above)
def test_a_second_signal_ends_a_stuck_run_at_once(tmp_path, tiny_dir):
    proc = run_cli(tmp_path, tiny_dir)   # (the default grace: minutes)
    stopped_after(proc, tmp_path / "r", 2, within=60)
    assert proc.returncode == 0, proc.stderr.read()[-3000:]
    check_stopped(tmp_path / "r")


@pytest.mark.slow
def test_a_stopped_run_whose_cleanup_hangs_still_ends(tmp_path, tiny_dir):
    """The last resort: the step abandoned after the grace, the environment's close hangs too;
    the process ends stop_grace_s later, with summary.json written and the checkpoint kept.
    (Slow: a third run in a process of its own, 15 s; the two above keep the bounded stop in the
    quick suite.)"""
    proc = run_cli(tmp_path, tiny_dir, "--checkpoint.stop_grace_s", "2",
                   "--env.name", "tests.agents:closes_never")
    took = stopped_after(proc, tmp_path / "r", 1, within=60)
    assert took >= 4 and proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()[-3000:]
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["hard_exit"] and summary["stopped_by"] == "SIGTERM" and summary["steps"] == 1
    assert (tmp_path / "r" / "checkpoints" / "step_000001").is_dir()
