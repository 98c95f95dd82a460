"""OpenEnv environments as posttrain environments (docs/environments.md, "Bring your OpenEnv
environment"): an OpenEnv `Environment` driven in process (no server), or one served by OpenEnv's
app over its WebSocket session API (`ws://HOST/ws`: one session per episode, the state kept by
the server). `openenv` (the PyPI distribution, `pip install 'posttrain[openenv]'`) is imported
only when an OpenEnv environment is made.

    reset(seed, answer, prompt, the row's fields)  -> what it shows opens the episode: after the
        problem's prompt, or as the prompt when the problem has none (rollout/sessions.py)
    policy turn -> action(text) -> step(action)     -> reward added, `done` ends it, else the
        observation's text is the environment's next message (envs/openenv_io.py)

An MCP environment (OpenEnv's MCPEnvironment: ListToolsAction / CallToolAction) offers its tools
to the policy as posttrain tools (their schemas in the chat template, or the system prompt); each
call the policy writes is sent as a CallToolAction and the tool's result is the environment's
reply. Every episode of a problem is reset with the same arguments (its seed, derived from the
problem, and the row's fields), so GRPO compares answers to one task.

A served environment runs at most as many sessions as it accepts (env.openenv_sessions, else
what its first refusal shows): episodes past that queue for a session (rollout/sessions.py).

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
from dataclasses import dataclass
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.envs.base import EnvironmentFull, EpisodeTimeout, Reply, no_limit_as_none
from posttrain.envs.builtin import ToolEnv
from posttrain.envs.openenv_io import (Session, call_action, close, close_soon, fields_of,
                                       list_action, mcp_tools, observation_text, open_session,
                                       tool_result_text)
from posttrain.envs.tools import Tool, parse_calls
from posttrain.util.errors import ConfigError

__all__ = ["OpenEnvEnvironment", "Session", "action_maker", "from_config", "observation_text",
           "problem_seed", "reset_kwargs"]


def problem_seed(problem: Problem) -> int:
    """A seed that names the problem (its prompt and answer): the same for every episode of a
    group and in every run."""
    digest = hashlib.sha256(f"{problem.prompt}\x00{problem.answer}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def reset_kwargs(problem: Problem) -> dict[str, Any]:
    """What reset is handed for a problem (the keys it takes): `seed` (problem_seed), `answer`,
    `prompt`, then the row's other fields (a file row's columns), which win: a row's own `seed`,
    `options` or `dataset_name` is its task. Values that are not JSON are left out (a served
    reset receives JSON)."""
    kwargs: dict[str, Any] = {"seed": problem_seed(problem), "answer": problem.answer,
                              "prompt": problem.prompt}
    for key, value in problem.meta.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kwargs[key] = value
    return kwargs


def require_openenv() -> None:
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ConfigError("an OpenEnv environment needs the openenv package: pip install "
                          "'posttrain[openenv]'") from None


@dataclass
class Episode:
    """One episode's own environment (in process) or session (served), and what its reset
    showed, as text."""

    handle: Any
    opening: str = ""
    ended: bool = False


@dataclass(frozen=True)
class Probe:
    """What one look at the environment tells, before any episode: its MCP tools (none: not an
    MCP environment) and whether its reset can be handed a task (takes_task)."""

    tools: tuple[Tool, ...] = ()
    takes_task: bool = True


class OpenEnvEnvironment:
    """An OpenEnv environment: `factory` (its Environment class, or a function making one) in
    process, or `url` (a served one). `action(text)` makes the action from the policy's turn
    (default: the dict {'message': text}); `observation`: the field the policy reads (None: the
    rule of envs/openenv_io.py); `sessions`: the most episodes at once (None: no limit in
    process; served, as many as the server accepts). Solved (`correct`: eval/accuracy,
    data.retry_if): the episode ended (`done`) with a reward of at least `success` (1: a partial
    credit, reasoning-gym's 0.25 for a wrong number, is not a solve)."""

    def __init__(self, factory: Callable[[], Any] | None = None, url: str | None = None,
                 action: Callable[[str], Any] | None = None, *, max_turns: int = 4,
                 name: str = "openenv", turn_timeout_s: float | None = 300.0,
                 episode_timeout_s: float | None = 1800.0, observation: str | None = None,
                 sessions: int | None = None, tool_format: str = "auto",
                 calls_per_turn: int = 4, success: float = 1.0) -> None:
        if (factory is None) == (url is None):
            raise ConfigError("OpenEnvEnvironment: give an environment factory (in process) or "
                              "a url (served), not both")
        require_openenv()
        self.factory, self.url, self.observation = factory, url, observation
        self.action = action or (lambda t: {"message": t})
        self.max_turns, self.name, self.limit = max_turns, name, sessions
        self.format, self.calls_per_turn, self.success = tool_format, calls_per_turn, success
        self.open: list[Any] = []   # served sessions now open
        # (None or inf: no limit)
        self.turn_timeout_s = no_limit_as_none(turn_timeout_s)
        self.episode_timeout_s = no_limit_as_none(episode_timeout_s)
        self.batch_started: float | None = None   # the episodes' clock (start_batch)
        self._probe: Probe | None = None

    # ---- what the policy is told: MCP tools (DescribesTools), the opening (OpensEpisodes) ----

    def probe(self) -> Probe:
        if self._probe is None:
            self._probe = probe_in_process(self.factory) if self.url is None else \
                probe_served(self.url, self.turn_timeout_s)
        return self._probe

    @property
    def takes_task(self) -> bool:
        return self.probe().takes_task

    @property
    def tools(self) -> tuple[Tool, ...]:
        return self.probe().tools

    def toolset(self) -> ToolEnv:
        """The tools' call format, stop strings and instructions (envs/builtin.py ToolEnv)."""
        return ToolEnv(self.tools, self.max_turns, "json" if self.format == "json" else "tag")

    def bind(self, tokenizer) -> OpenEnvEnvironment:
        """Resolve env.tool_format 'auto': the chat template's own format when it takes tools."""
        if self.format == "auto" and self.tools:
            self.format = ToolEnv(self.tools, format="auto").bind(tokenizer).format
        return self

    @property
    def stop(self) -> tuple[str, ...]:
        return self.toolset().stop if self.tools else ()

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return self.toolset().tool_schemas if self.tools else None

    def system_prompt(self, base: str | None) -> str | None:
        return self.toolset().system_prompt(base) if self.tools else base

    def opening(self, state: Episode) -> str:
        return state.opening

    def text(self, fields: dict[str, Any]) -> str:
        return observation_text(fields, self.observation)

    # ---- sessions (HoldsSessions) and time limits ----

    @property
    def max_episodes(self) -> int | None:
        return self.limit

    def start_batch(self) -> None:
        """Close the sessions a batch left open; the batch's clock starts."""
        for session in self.open:
            close(session)
        self.open = []
        self.batch_started = time.monotonic()

    def end(self, state: Episode) -> None:
        """The episode is over: its environment closed, its session given back."""
        if state.ended:
            return
        state.ended = True
        if state.handle in self.open:
            self.open.remove(state.handle)
        close(state.handle)

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

    # ---- an episode ----

    def reset(self, problem: Problem) -> Episode:
        kwargs = reset_kwargs(problem)
        if self.factory is not None:
            env = self.factory()
            obs = self.bounded(lambda: env.reset(**_accepted(env.reset, kwargs)), "reset")
            return Episode(env, self.text(fields_of(obs)))
        try:   # (a session opened after its time is closed)
            session = self.bounded(lambda: open_session(self.url, kwargs, len(self.open),
                                                        self.turn_timeout_s),
                                   "session's reset", late=close)
        except EnvironmentFull:
            self.limit = len(self.open)   # what this server lets this run hold
            raise
        self.open.append(session)
        return Episode(session, self.text(session.first.observation))

    def step(self, state: Episode, text: str, turn: int) -> Reply:
        if self.tools:
            return self.tool_turn(state, text, turn)
        fields, reward, done = self.act(state, self.action(text))
        if done or turn >= self.max_turns:
            self.end(state)
            return Reply(None, reward=reward, correct=bool(done and reward >= self.success))
        return Reply({"role": "user", "content": self.text(fields)}, reward=reward)

    def act(self, state: Episode, action: Any) -> tuple[dict[str, Any], float, bool]:
        """One step of the episode's environment: (the observation's fields, reward, done). A
        step past its time ends the episode: its environment is abandoned to the stuck call (a
        served session is closed aside)."""
        try:
            obs = self.bounded(lambda: state.handle.step(action), "step")
        except EpisodeTimeout:
            state.ended = True
            if state.handle in self.open:
                self.open.remove(state.handle)
                close_soon(state.handle)
            raise
        fields = obs.observation if self.url is not None else fields_of(obs)
        return fields, float(obs.reward or 0.0), bool(obs.done)

    def tool_turn(self, state: Episode, text: str, turn: int) -> Reply:
        """An MCP environment's turn: each tool call the policy wrote (envs/tools.py formats) is
        sent as a CallToolAction, the results are the environment's reply (role 'tool'); a turn
        without one is the final answer: the episode ends, the task's verifier scores it."""
        calls, errors = parse_calls(text, {t.name: t for t in self.tools}, self.toolset().format)
        results, reward, done = [], 0.0, False
        for call in calls[:self.calls_per_turn]:
            fields, r, done = self.act(state, call_action(call, self.url is not None))
            results.append(tool_result_text(fields))
            reward += r
            if done:
                break
        counts = {"tool_calls": len(results), "malformed_calls": len(errors),
                  "tool_failures": sum(r.startswith("error: ") for r in results),
                  "tools_broken": 0, "capped_calls": max(len(calls) - self.calls_per_turn, 0)}
        results += [f"error: at most {self.calls_per_turn} tool calls per turn; not "
                    "run"] * counts["capped_calls"]
        if done or turn >= self.max_turns or not (calls or errors):
            self.end(state)
            return Reply(None, reward=reward, correct=(reward >= self.success) if done else None,
                         counts=counts)
        content = "\n".join(results + [f"error: {e}" for e in errors])
        return Reply({"role": "tool", "content": content}, reward=reward, counts=counts)


def probe_in_process(factory: Callable[[], Any]) -> Probe:
    """One environment made and closed: its MCP tools (ListToolsAction), and whether its reset
    takes anything a row could fill (a seed, **kwargs, any parameter besides episode_id)."""
    from openenv.core.env_server.mcp_environment import MCPEnvironment
    env = factory()
    try:
        params = inspect.signature(env.reset).parameters
        takes = any(name != "episode_id" for name in params)
        if not isinstance(env, MCPEnvironment):
            return Probe((), takes)
        return Probe(mcp_tools(fields_of(env.step(list_action(False)))), takes)
    finally:
        close(env)


def probe_served(url: str, timeout_s: float | None) -> Probe:
    """A served environment's MCP tools: when its /schema says its actions are MCP's (or the
    generic Action), one session lists them. Its reset's parameters are the server's to filter:
    taken as able to receive a task."""
    import httpx
    try:
        schema = httpx.get(url.rstrip("/") + "/schema", timeout=timeout_s or 60.0).json()
        title = schema["action"].get("title")
    except Exception:  # noqa: BLE001 - no schema to read: ask for the tools anyway
        title = None
    if title not in (None, "Action", "CallToolAction", "ListToolsAction"):
        return Probe()
    session = open_session(url, {}, 0, timeout_s)
    try:
        return Probe(mcp_tools(session.step(list_action(True)).observation))
    except Exception:  # noqa: BLE001 - not an MCP environment: its action refused list_tools
        return Probe()
    finally:
        close(session)


def from_config(cfg) -> OpenEnvEnvironment:
    """env.name openenv: `env.openenv` a URL (served) or 'module:Class' (in process); the
    policy's turn goes into the action's field `env.openenv_action`."""
    field = cfg.openenv_action
    options = dict(max_turns=cfg.max_turns, turn_timeout_s=cfg.turn_timeout_s,
                   episode_timeout_s=cfg.episode_timeout_s, observation=cfg.openenv_observation,
                   sessions=cfg.openenv_sessions, tool_format=cfg.tool_format,
                   calls_per_turn=cfg.max_tool_calls_per_turn, success=cfg.openenv_success)
    if cfg.openenv.startswith(("http://", "https://")):
        return OpenEnvEnvironment(url=cfg.openenv, action=lambda t: {field: t}, **options)
    from posttrain.util.usercode import load_function
    factory = load_function(cfg.openenv)
    return OpenEnvEnvironment(factory, action=action_maker(factory, field), **options)


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
