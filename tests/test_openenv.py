"""OpenEnv environments through the adapter (envs/openenv.py): in process and served over
OpenEnv's WebSocket sessions on loopback, checked against the built-in guess_number environment
they re-express (examples/openenv_guess_number.py); the observation and opening rules, a served
environment's session limit, and the refusal of groups that could face different tasks.
OpenEnv's own environments run in tests/test_openenv_published.py."""

import json
import socket
import threading
import time

import openenv.core  # noqa: F401  (installed by scripts/install-cpu.sh: a broken install fails)
import pytest

from posttrain.config.options import load_config
from posttrain.data.tasks import Problem
from posttrain.envs import GuessNumber, make_env
from posttrain.envs.base import EnvironmentFull
from posttrain.envs.openenv import OpenEnvEnvironment, problem_seed, reset_kwargs
from posttrain.envs.openenv_io import observation_text
from posttrain.data.source import build_task
from posttrain.rl.loop import train
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import EpisodeSettings, run_episodes
from posttrain.rollout.sessions import opened
from tests.conftest import make_tiny_model

SPEC = "examples.openenv_guess_number:GuessNumberEnv"
RUN = ["--data.task", "guess_number", "--data.difficulty", "8", "--data.eval_size", "0",
       "--env.max_turns", "3", "--env.max_tokens", "24", "--rollout.max_new_tokens", "4",
       "--rollout.prompts_per_step", "2", "--rollout.group_size", "2", "--steps", "2",
       "--data.system_prompt", "null", "--tensorboard", "false", "--threads", "2",
       "--algorithm.kl_coef", "0"]


def guess_app(sessions: int):
    """The example environment in OpenEnv's own app, `sessions` at once."""
    from openenv.core.env_server.http_server import create_fastapi_app

    from examples.openenv_guess_number import GuessAction, GuessNumberEnv, GuessObservation
    return create_fastapi_app(GuessNumberEnv, GuessAction, GuessObservation,
                              max_concurrent_envs=sessions)


class Served:
    """An OpenEnv server app on a free loopback port, in a thread."""

    def __init__(self, app) -> None:
        import uvicorn
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


def test_an_observation_reads_as_the_documented_rule():
    """TextArena's `messages` before its `prompt`; a named field; the other fields as JSON."""
    arena = {"prompt": "You are playing Wordle.", "metadata": {"x": 1}, "reward": 0.0,
             "messages": [{"sender_id": -1, "content": "Guess a word.", "category": "PROMPT"},
                          {"sender_id": -1, "content": "Feedback: B G Y", "category": "MESSAGE"}]}
    assert observation_text(arena) == "Guess a word.\nFeedback: B G Y"
    assert observation_text(arena, "prompt") == "You are playing Wordle."
    assert observation_text({"question": "2+2?", "score": None}) == "2+2?"
    assert observation_text({"message": "", "board": [[0, 1]], "done": False,
                             "metadata": {"m": "x"}}) == '{"board": [[0, 1]]}'
    assert observation_text({"message": "", "metadata": {"message": "ready"}}) == ""
    with pytest.raises(ValueError, match=r"openenv_observation='board': .*fields: \['prompt'\]"):
        observation_text({"prompt": "p"}, "board")


def test_an_episode_opens_after_the_prompt_or_in_its_place():
    assert opened(Problem("Answer in digits.", "4"), "How many legs?").prompt == \
        "Answer in digits.\n\nHow many legs?"
    assert opened(Problem("", "", {"seed": 3}), "How many legs?").prompt == "How many legs?"
    chat = Problem("Hi", "", messages=({"role": "system", "content": "S"},
                                       {"role": "user", "content": "Hi"}))
    assert opened(chat, "Board: X.").messages == ({"role": "system", "content": "S"},
                                                  {"role": "user", "content": "Hi\n\nBoard: X."})
    assert opened(chat, "") is chat


def test_reset_is_handed_the_rows_fields_and_they_win():
    row = Problem("Q", "7", {"seed": 11, "dataset_name": "leg_counting", "size": 1,
                             "not_json": object()})
    assert reset_kwargs(row) == {"seed": 11, "answer": "7", "prompt": "Q",
                                 "dataset_name": "leg_counting", "size": 1}
    assert reset_kwargs(Problem("Q", "7"))["seed"] == problem_seed(Problem("Q", "7"))


def test_a_served_environment_gives_sessions_back_and_learns_its_limit():
    problem = Problem("Guess", "5")
    with Served(guess_app(2)) as srv:
        env = OpenEnvEnvironment(url=srv.url, max_turns=3)
        assert env.max_episodes is None                            # (not known yet)
        a, b = env.reset(problem), env.reset(Problem("Guess", "2"))   # two sessions at once
        assert env.step(a, "4", 1).message == {"role": "user", "content": "Higher."}
        assert env.step(b, "4", 1).message == {"role": "user", "content": "Lower."}
        assert env.step(a, "5", 2).reward == 1.0 and env.open == [b.handle]   # a's given back
        c = env.reset(problem)                                     # (in a's place)
        assert env.open == [b.handle, c.handle]
        with pytest.raises(EnvironmentFull, match="holds 2 of this run's sessions and refused"):
            env.reset(problem)
        assert env.max_episodes == 2                               # the server's, as refused
        env.end(b), env.end(b)                                     # (twice is harmless)
        env.start_batch()                                          # c's, cut short, too
        assert env.open == []
        others = [held_session(srv.url) for _ in range(2)]   # another client's
        try:
            with pytest.raises(RuntimeError, match=r"none of this run's was open .*"
                                                   r"max_concurrent_envs=N"):
                env.reset(problem)
        finally:
            for other in others:
                other.close()


def held_session(url: str):
    """A session of another client (retried while the server frees the ones just closed)."""
    from openenv.core import GenericEnvClient
    for _ in range(100):
        client = GenericEnvClient(base_url=url).sync()
        try:
            client.reset(answer="3")
            return client
        except RuntimeError:
            client.close()
            time.sleep(0.02)
    raise AssertionError("the server never freed a session")


class Untaskable:
    """An OpenEnv environment whose reset takes nothing: a problem's task cannot reach it."""

    def __new__(cls):
        from examples.openenv_guess_number import GuessNumberEnv, GuessObservation

        class NoTask(GuessNumberEnv):
            def reset(self, episode_id=None):
                return GuessObservation(message="Guess my number.")
        return NoTask()


class OpensDifferently:
    """Each reset shows another task, whatever it is handed."""

    count = 0

    def __new__(cls):
        from examples.openenv_guess_number import GuessNumberEnv, GuessObservation

        class Counter(GuessNumberEnv):
            def reset(self, seed=None, **kwargs):
                OpensDifferently.count += 1
                return GuessObservation(message=f"Task {OpensDifferently.count}.")
        return Counter()


def test_a_group_that_could_face_different_tasks_is_refused(tokenizer):
    engine = make_engine("hf", make_tiny_model(tokenizer, seed=3), tokenizer)
    settings = EpisodeSettings(None, True, None, 24, 16)
    problems = [Problem("Guess", "5")]
    no_task = OpenEnvEnvironment(Untaskable, max_turns=1)
    with pytest.raises(ValueError, match=r"reset takes no seed .* the 2 episodes of a problem "
                                         r".*rollout.group_size 1"):
        run_episodes(engine, tokenizer, no_task, problems, 2, SamplingParams(2), settings=settings)
    one = run_episodes(engine, tokenizer, no_task, problems, 1, SamplingParams(2), settings=settings)
    assert "Guess\n\nGuess my number." in tokenizer.decode(one.rollout.prompt_ids_B_L[0])
    OpensDifferently.count = 0
    differing = OpenEnvEnvironment(OpensDifferently, max_turns=1)
    with pytest.raises(ValueError, match=r"problem 0 of the batch opened differently "
                                         r"\('Task 1.' vs 'Task 2.'\)"):
        run_episodes(engine, tokenizer, differing, problems, 2, SamplingParams(2), settings=settings)


def run_dir_rows(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def test_native_in_process_and_served_train_the_same_episodes(tmp_path, tokenizer):
    """Two steps of GRPO from the same tiny model and seed: the native environment, the OpenEnv
    one in process and the served one give the same rewards, step by step (the same replies, so
    the same tokens), and the environment's tokens stay out of the loss."""
    runs = {"native": [], "inproc": ["--env.name", "openenv", "--env.openenv", SPEC]}
    with Served(guess_app(4)) as srv:
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
