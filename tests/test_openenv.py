"""OpenEnv environments through the adapter (envs/openenv.py): in process and served over
OpenEnv's WebSocket sessions on loopback, checked against the built-in guess_number environment
they re-express (examples/openenv_guess_number.py)."""

import json
import socket
import threading
import time

import pytest

pytest.importorskip("openenv.core")

from posttrain.config.options import load_config
from posttrain.data.tasks import Problem
from posttrain.envs import GuessNumber, make_env
from posttrain.envs.openenv import OpenEnvEnvironment, problem_seed
from posttrain.data.source import build_task
from posttrain.rl.loop import train
from tests.conftest import make_tiny_model

SPEC = "examples.openenv_guess_number:GuessNumberEnv"
RUN = ["--data.task", "guess_number", "--data.difficulty", "8", "--data.eval_size", "0",
       "--env.max_turns", "3", "--env.max_tokens", "24", "--rollout.max_new_tokens", "4",
       "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--steps", "2",
       "--data.system_prompt", "null", "--tensorboard", "false", "--threads", "2",
       "--algorithm.kl_coef", "0"]


class Served:
    """The example environment served by OpenEnv's own app on a free loopback port."""

    def __init__(self, sessions: int) -> None:
        import uvicorn
        from openenv.core.env_server.http_server import create_fastapi_app

        from examples.openenv_guess_number import GuessAction, GuessNumberEnv, GuessObservation
        app = create_fastapi_app(GuessNumberEnv, GuessAction, GuessObservation,
                                 max_concurrent_envs=sessions)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def guesses(env, problem, texts):
    state = env.reset(problem)
    return [env.step(state, t, i + 1) for i, t in enumerate(texts)]


def test_the_adapter_replies_exactly_as_the_native_environment():
    problem = Problem("Guess", "5")
    cfg = load_config(None, [*RUN, "--env.name", "openenv", "--env.openenv", SPEC]).env
    adapted = make_env(cfg, build_task(load_config(None, RUN).data))
    texts = ["I guess 3", "maybe 7", "5"]
    ours, native = guesses(adapted, problem, texts), guesses(GuessNumber(3), problem, texts)
    assert [r.message for r in ours] == [r.message for r in native] == [
        {"role": "user", "content": "Higher."}, {"role": "user", "content": "Lower."}, None]
    assert [r.reward for r in ours] == [0.0, 0.0, 1.0] and ours[-1].correct is True
    # the last allowed turn ends the episode, found or not
    last = guesses(adapted, problem, ["1", "2", "3"])[-1]
    assert last.message is None and last.correct is False
    assert problem_seed(problem) == problem_seed(Problem("Guess", "5")) != problem_seed(Problem("Guess", "6"))


def test_a_served_environment_runs_concurrent_sessions_and_closes_them():
    problem = Problem("Guess", "5")
    with Served(sessions=2) as srv:
        env = OpenEnvEnvironment(url=srv.url, max_turns=3)
        a, b = env.reset(problem), env.reset(Problem("Guess", "2"))   # two sessions at once
        assert env.step(a, "4", 1).message == {"role": "user", "content": "Higher."}
        assert env.step(b, "4", 1).message == {"role": "user", "content": "Lower."}
        assert env.step(a, "5", 2).reward == 1.0 and len(env.open) == 1   # a's session closed
        env.start_batch()                                          # b's, cut short, too
        assert env.open == []
        env.reset(problem), env.reset(problem)                     # both slots free again
        with pytest.raises(RuntimeError, match=r"refused session 3 .*max_concurrent_envs=N"):
            env.reset(problem)
        env.start_batch()


def run_dir_rows(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def test_native_in_process_and_served_train_the_same_episodes(tmp_path, tokenizer):
    """Two steps of GRPO from the same tiny model and seed: the native environment, the OpenEnv
    one in process and the served one give the same rewards, step by step (the same replies, so
    the same tokens), and the environment's tokens stay out of the loss."""
    runs = {"native": [], "inproc": ["--env.name", "openenv", "--env.openenv", SPEC]}
    with Served(sessions=4) as srv:
        runs["served"] = ["--env.name", "openenv", "--env.openenv", srv.url]
        for name, extra in runs.items():
            cfg = load_config(None, [*RUN, "--run_dir", str(tmp_path / name), *extra])
            train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer,
                  show_progress=False)
    rows = {name: run_dir_rows(tmp_path / name) for name in runs}
    keys = ("reward/mean", "env/turns", "rollout/length_mean", "policy/grad_norm")
    assert all(k in r for r in rows["native"] for k in keys)
    for k in keys:
        assert [r.get(k) for r in rows["inproc"]] == [r.get(k) for r in rows["native"]], k
        assert [r.get(k) for r in rows["served"]] == [r.get(k) for r in rows["native"]], k
    assert all(r["env/turns"] > 1 for r in rows["native"])   # feedback reached the policy
