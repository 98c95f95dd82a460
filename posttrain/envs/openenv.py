"""OpenEnv environments as posttrain environments (docs/environments.md): an OpenEnv `Environment`
driven in process (no server), or one served by OpenEnv's app over its WebSocket session API
(`ws://HOST/ws`: one session per episode, the state kept by the server).

    reset(seed, answer, prompt) -> observation      (the problem's prompt opens the episode)
    policy turn -> action(text) -> step(action) -> observation: reward added, `done` ends it,
    else its text is the environment's next message (tokens appended, the policy's never
    re-tokenised: rollout/episodes.py)

Every episode of a group is reset with the same seed (derived from the problem), so GRPO
compares answers to the same environment. A served environment must accept as many sessions as
a step runs episodes at once (prompts_per_step x group_size); OpenEnv's default is one, and the
error says so. `openenv-core` is an optional extra (`pip install 'posttrain[openenv]'`), imported
only when an OpenEnv environment is made.

Time limits: a reset or step that does not answer within `turn_timeout_s`, or past the batch's
`episode_timeout_s` (env.turn_timeout_s, env.episode_timeout_s), ends its episode with
EpisodeTimeout (counted, and left out of its group's baseline and the loss); the call is made in
a daemon thread that is abandoned, never waited for again.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.envs.base import EpisodeTimeout, Reply, no_limit_as_none
from posttrain.util.errors import ConfigError

TEXT_FIELDS = ("message", "feedback", "text", "content", "prompt")   # an observation's text, in turn


def problem_seed(problem: Problem) -> int:
    """A seed that names the problem (its prompt and answer): the same for every episode of a
    group and in every run."""
    digest = hashlib.sha256(f"{problem.prompt}\x00{problem.answer}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def observation_text(obs: dict[str, Any]) -> str:
    """What the policy reads of an observation: its first text field of TEXT_FIELDS, else the
    whole observation as JSON."""
    for name in TEXT_FIELDS:
        if isinstance(obs.get(name), str):
            return obs[name]
    return json.dumps(obs, default=str)


def _fields(obs: Any) -> dict[str, Any]:
    """An observation's fields (a pydantic model in process, a dict over the wire)."""
    if isinstance(obs, dict):
        return obs
    return obs.model_dump(exclude={"reward", "done", "metadata"})


def require_openenv() -> None:
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ConfigError("an OpenEnv environment needs openenv-core: pip install "
                          "'posttrain[openenv]'") from None


class OpenEnvEnvironment:
    """An OpenEnv environment: `factory` (its Environment class, or a function making one) in
    process, or `url` (a served one). `action(text)` makes the action from the policy's turn
    (default: the action with field `message`, or the dict {'message': text} over the wire);
    `text(observation_fields)` what the policy reads of an observation (default
    `observation_text`). Correct: the episode ended (`done`) with a positive reward."""

    stop: tuple[str, ...] = ()
    tool_schemas = None

    def __init__(self, factory: Callable[[], Any] | None = None, url: str | None = None,
                 action: Callable[[str], Any] | None = None,
                 text: Callable[[dict[str, Any]], str] = observation_text,
                 max_turns: int = 4, name: str = "openenv", turn_timeout_s: float | None = 300.0,
                 episode_timeout_s: float | None = 1800.0) -> None:
        if (factory is None) == (url is None):
            raise ConfigError("OpenEnvEnvironment: give an environment factory (in process) or "
                              "a url (served), not both")
        require_openenv()
        self.factory, self.url, self.text = factory, url, text
        self.action = action or (lambda t: {"message": t})
        self.max_turns, self.name = max_turns, name
        self.open: list[Any] = []   # served sessions of the current batch
        # (None or inf: no limit)
        self.turn_timeout_s = no_limit_as_none(turn_timeout_s)
        self.episode_timeout_s = no_limit_as_none(episode_timeout_s)
        self.batch_started: float | None = None   # the episodes' clock (start_batch)

    def system_prompt(self, base: str | None) -> str | None:
        return base

    def start_batch(self) -> None:
        """Close the sessions a batch left open (an episode cut by its token budget)."""
        for session in self.open:
            _close(session)
        self.open = []
        self.batch_started = time.monotonic()

    def bounded(self, fn: Callable[[], Any], what: str,
                late: Callable[[Any], None] | None = None) -> Any:
        """fn(), given at most turn_timeout_s and what is left of the batch's episode_timeout_s
        (EpisodeTimeout past it; at once, without calling fn, once the batch's time is spent);
        `late(value)`: what to do with a value fn returns after its caller gave up on it."""
        if self.batch_started is None:
            self.batch_started = time.monotonic()
        limits = {"env.turn_timeout_s": self.turn_timeout_s}
        if self.episode_timeout_s is not None:
            limits["env.episode_timeout_s"] = (self.batch_started + self.episode_timeout_s
                                               - time.monotonic())
        given = {k: v for k, v in limits.items() if v is not None}
        if not given:
            return fn()
        option = min(given, key=given.get)
        limit = given[option]
        if limit <= 0:
            raise EpisodeTimeout(f"the OpenEnv {what} was not started: no time left ({option})")
        return call_bounded(fn, limit, f"the OpenEnv {what} did not answer within {limit:g} s "
                                       f"({option})", late)

    def reset(self, problem: Problem) -> Any:
        kwargs = {"seed": problem_seed(problem), "answer": problem.answer, "prompt": problem.prompt}
        if self.factory is not None:
            env = self.factory()
            self.bounded(lambda: env.reset(**_accepted(env.reset, kwargs)), "reset")
            return env
        session = self.bounded(lambda: open_session(self.url, kwargs, len(self.open),
                                                    self.turn_timeout_s), "session's reset",
                               late=_close)   # (a session opened after all is closed)
        self.open.append(session)
        return session

    def step(self, env: Any, text: str, turn: int) -> Reply:
        action = self.action(text)
        try:
            obs = self.bounded(lambda: env.step(action), "step")
        except EpisodeTimeout:
            if self.url is not None:   # (the session is given up)
                _close_soon(env)
                self.open.remove(env)
            raise
        if self.url is not None:   # a StepResult: the observation's fields, reward, done
            reward, done, fields = obs.reward, obs.done, obs.observation
        else:
            reward, done, fields = obs.reward, obs.done, _fields(obs)
        reward = float(reward or 0.0)
        if done or turn >= self.max_turns:
            if self.url is not None:
                _close(env)
                self.open.remove(env)
            return Reply(None, reward=reward, correct=bool(done and reward > 0))
        return Reply({"role": "user", "content": self.text(fields)}, reward=reward)


def from_config(cfg) -> OpenEnvEnvironment:
    """env.name openenv: `env.openenv` a URL (served) or 'module:Class' (in process); the
    policy's turn goes into the action's field `env.openenv_action`."""
    field = cfg.openenv_action
    limits = dict(max_turns=cfg.max_turns, turn_timeout_s=cfg.turn_timeout_s,
                  episode_timeout_s=cfg.episode_timeout_s)
    if cfg.openenv.startswith(("http://", "https://")):
        return OpenEnvEnvironment(url=cfg.openenv, action=lambda t: {field: t}, **limits)
    from posttrain.util.usercode import load_function
    factory = load_function(cfg.openenv)
    return OpenEnvEnvironment(factory, action=action_maker(factory, field), **limits)


def action_maker(factory: Callable[[], Any], field: str) -> Callable[[str], Any]:
    """text -> the environment's own Action (the type its `step` takes) with `field` set."""
    import typing
    try:
        kind = typing.get_type_hints(getattr(factory, "step", None)).get("action")
    except Exception:  # noqa: BLE001 - no usable annotation: a dict
        kind = None
    if kind is None or not hasattr(kind, "model_validate"):
        return lambda t: {field: t}
    return lambda t: kind.model_validate({field: t})


def _accepted(fn: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes (all of them when it has **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def open_session(url: str, reset_kwargs: dict[str, Any], already_open: int,
                 timeout_s: float | None = 300.0):
    """A new WebSocket session with the served environment, reset (the server passes on the keys
    its reset takes); a server at its session limit is a one-line error naming the fix. The
    client gives up on a message after `timeout_s` (env.turn_timeout_s; None: no limit)."""
    from openenv.core import GenericEnvClient
    session = GenericEnvClient(base_url=url, connect_timeout_s=min(timeout_s or 60.0, 60.0),
                               message_timeout_s=timeout_s).sync()
    try:
        session.reset(**reset_kwargs)
    except Exception as e:   # noqa: BLE001 - a RuntimeError or ConnectionClosed, by timing
        _close(session)
        if "CAPACITY_REACHED" in str(e) or "ConnectionClosed" in type(e).__name__:
            raise RuntimeError(
                f"the OpenEnv server at {url} refused session {already_open + 1} ({e}): a step "
                f"runs prompts_per_step x group_size episodes at once; serve the environment "
                f"with create_app(..., max_concurrent_envs=N) for N at least that, and "
                f"SUPPORTS_CONCURRENT_SESSIONS = True on the Environment") from None
        raise
    return session


def _close(session: Any) -> None:
    try:
        session.close()
    except Exception:  # noqa: BLE001 - a session the server already dropped
        pass


def _close_soon(session: Any) -> None:
    """Close a session that stopped answering, in a daemon thread (closing may block too)."""
    threading.Thread(target=_close, args=(session,), daemon=True, name="openenv-close").start()


def call_bounded(fn: Callable[[], Any], timeout_s: float, message: str,
                 late: Callable[[Any], None] | None = None) -> Any:
    """fn() in a daemon thread, waited for at most `timeout_s` seconds: EpisodeTimeout(message)
    past it (the thread is abandoned: Python cannot stop a call stuck in a server or user code).
    A value fn returns after that goes to `late` (a session opened too late is closed)."""
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            value = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
            return
        with lock:
            box["value"] = value
            abandoned = box.get("abandoned", False)
        if abandoned and late is not None:
            late(value)
    worker = threading.Thread(target=run, daemon=True, name="openenv-call")
    worker.start()
    worker.join(timeout_s)
    with lock:
        if "value" not in box and "error" not in box:
            box["abandoned"] = True
            raise EpisodeTimeout(message)
    if "error" in box:
        raise box["error"]
    return box["value"]
