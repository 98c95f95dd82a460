"""verifiers environments (PyPI `verifiers` 0.4, `import verifiers.v1`) as posttrain environments
(docs/environments.md): `data.task verifiers:ID` makes the taskset's tasks the problems, and each
episode is one verifiers episode of its task, run as verifiers runs it.

    posttrain episode thread -> verifiers `Env.run_episode(task)` (the package's Env, else
    SingleAgentEnv; loaded by verifiers.v1.utils.loaders.load_environment) -> each seat's agent
    and harness -> verifiers' interception server -> `PolicyVFClient` (envs/verifiers_client.py)
    -> the seat's row in posttrain's batched sampler (rollout/driven.py) -> exact token ids and
    log-probs back to verifiers

What runs where: the environment's own code (its `run`, scripted users, referees, `finalize`),
its harnesses, rubrics and judges run in the trainer's process on one event loop; task-scoped
toolsets are started per rollout and a taskset's shared toolsets once (`Env.serving`), as local
processes. Every seat runs on verifiers' local subprocess runtime (its default is a remote
sandbox). A seat that plays verifiers' plain chat loop (`null`), or names no harness where the
taskset bundles none (verifiers' default would be the `bash` agent), plays through posttrain's
in-process chat harness (envs/verifiers_harness.py: the same loop, with nothing installed from
the network); a harness the taskset bundles, or one a seat names, runs as named. Every seat is
played by the policy (none here pins a client of its own).

Seats: each seat's first trace of an episode is a row of its own (Seated). An untrainable seat
(`trainable = False`, a user simulator) and a seat the episode did not play are left out of the
baseline and the loss; a seat that runs more traces in one episode (a proposer's several solvers)
has them played by the policy but trains its first only (said once in the log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import threading
import uuid
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.data.verifiers_tasks import task_stream
from posttrain.envs.base import Driven, DrivingEnvironment, EpisodeTimeout, no_limit_as_none
from posttrain.envs.verifiers_client import make_client

# verifiers' loader imports a harness by a top-level module name: the harness module is
# registered under this one in sys.modules before the environment loads
HARNESS = "posttrain_verifiers_harness"
log = logging.getLogger("posttrain")


def stream_of(problem: Problem):
    """The TaskStream a problem was drawn from (data/verifiers_tasks.py)."""
    return task_stream(problem.meta["verifiers"], json.loads(problem.meta.get("verifiers_options", "{}")))


def seats_config(env_config: Any) -> dict[str, Any]:
    """The environment's seats in declaration order: each AgentConfig field of its config (as
    verifiers' own `agent_config_fields` reads them)."""
    import verifiers.v1 as vf
    return {name: value for name, value in env_config if isinstance(value, vf.AgentConfig)}


def local_config(env_config: Any, max_turns: int) -> Any:
    """The environment's config as posttrain runs it: each seat on the subprocess runtime, with
    posttrain's chat harness where it would play the `null` loop or verifiers' default `bash`
    agent, and `max_turns` where it sets none; one interception server, on loopback."""
    import verifiers.v1 as vf
    # verifiers.v1.interception (not exported by verifiers.v1): the config of one interception
    # server, on loopback (an Env's default is an elastic pool of them)
    from verifiers.v1.interception import InterceptionServerConfig
    bundled = vf.default_harness_id(env_config.taskset.id) != "bash"
    ours = vf.harness_config_type(HARNESS).model_validate({"id": HARNESS})
    seats = {}
    for name, spec in seats_config(env_config).items():
        plain = spec.harness.id == "null" if spec.harness is not None else not bundled
        seats[name] = spec.model_copy(update={
            "runtime": vf.SubprocessConfig(), "harness": ours if plain else spec.harness,
            "max_turns": spec.max_turns if spec.max_turns is not None else max_turns})
    return env_config.model_copy(update={**seats, "interception": InterceptionServerConfig()})


class Router:
    """One episode's traces to its seats' policy clients: a seat's first trace answers on the
    seat's row; a further trace of the same seat on a detached client (sampled on that row,
    recorded nowhere)."""

    def __init__(self, policies: dict[str, Any], warn) -> None:
        self.policies, self.warn = policies, warn
        self.owner: dict[str, str] = {}       # seat -> the trace id that owns its row
        self.by_trace: dict[str, Any] = {}    # trace id -> the policy client that answers it

    def minted(self, trace) -> None:
        """(verifiers' on_trace: each trace as it is created, its seat stamped.) A seat given no
        client of its own (an evaluation records the first seat only) plays on the first
        seat's row, detached."""
        seat = trace.agent.name if trace.agent is not None else ""
        if trace.id in self.by_trace:
            return
        if seat not in self.policies:
            self.by_trace[trace.id] = next(iter(self.policies.values())).detached()
        elif seat not in self.owner:
            self.owner[seat], self.by_trace[trace.id] = trace.id, self.policies[seat]
        else:
            self.warn(seat)
            self.by_trace[trace.id] = self.policies[seat].detached()

    def policy_for(self, trace_id: str | None) -> Any:
        return self.by_trace.get(trace_id) or next(iter(self.policies.values()))


def seat_ends(episode, seats: tuple[str, ...], owner: dict[str, str],
              answered: bool = True) -> dict[str, Driven]:
    """Each seat's end: its row's trace's rubric (weighted sum and parts) and first error (else
    the episode's: an Env.run or finalize that raised); a seat with no trace, or an untrainable
    one, left out. Solved (eval/accuracy): the task's verifier on its `answer` when the task has
    one (`answered`), else the rubric's full marks (a reward of at least 1, as OpenEnv's
    env.openenv_success)."""
    traces = {t.id: t for t in episode.traces}
    episode_error = (f"{episode.errors[0].type}: {episode.errors[0].message}"
                     if episode.errors else None)
    out = {}
    for seat in seats:
        trace = traces.get(owner.get(seat, ""))
        if trace is None:
            out[seat] = Driven(error=episode_error, left_out=True)
            continue
        parts = {name: r.score * r.weight for name, r in trace.rewards.items() if r is not None}
        error = f"{trace.errors[0].type}: {trace.errors[0].message}" if trace.errors else episode_error
        reward = float(trace.reward or 0.0)
        out[seat] = Driven(reward, None if answered else reward >= 1.0, parts, error=error,
                           left_out=not trace.agent.trainable)
    return out


class VerifiersEnvironment(DrivingEnvironment):
    """Each episode a verifiers episode of the problem's task (`data.task verifiers:ID`), run by
    the taskset's Env on an event loop of its own (one thread, one `Env.serving()` for all)."""

    def __init__(self, max_turns: int = 4, name: str = "verifiers",
                 timeout_s: float | None = None) -> None:
        # timeout_s: an episode's limit; None: the episode's (env.episode_timeout_s, the policy
        # client's `time_left`), so the episode is cancelled when the batch ends it
        self.max_turns, self.name, self.timeout_s = max_turns, name, timeout_s
        self.renders_tools = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._env = None
        self._serving = None
        self._stream = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def start_batch(self) -> None:
        """Said once: a verifiers rubric scores the model's text where verifiers runs it, in the
        trainer's process, not in posttrain's reward sandbox (docs/safety.md)."""
        self._say_once("sandbox", "verifiers: the task's rubric, the environment's own code and "
                       "any tool without a sandbox of its own read the model's text in the "
                       "trainer's process, outside posttrain's reward sandbox (docs/safety.md)")

    def _say_once(self, key: str, text: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(text)

    def warn_extra_trace(self, seat: str) -> None:
        self._say_once(f"seat:{seat}", f"verifiers: seat {seat!r} ran more than one trace in an "
                       "episode; posttrain trains one row per seat and episode (the seat's first "
                       "trace): the others were played by the policy but are not trained")

    def bind(self, tokenizer) -> "VerifiersEnvironment":
        """Tools go to the chat template when it renders them, else to a system message."""
        self.renders_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        return self

    def seats(self, problem: Problem) -> tuple[str, ...]:
        return tuple(seats_config(stream_of(problem).env_config))

    def drive(self, policy: Any, problem: Problem) -> Driven:
        seat = self.seats(problem)[0]
        return self.drive_seats({seat: policy}, problem)[seat]

    def drive_seats(self, policies: dict[str, Any], problem: Problem) -> dict[str, Driven]:
        import verifiers.v1 as vf
        stream = stream_of(problem)
        task = stream.task(problem.meta["verifiers_index"])
        loop, env = self.started(stream)
        router = Router(policies, self.warn_extra_trace)
        key = vf.TrainClientConfig(base_url=f"http://episode-{uuid.uuid4().hex}.invalid/v1",
                                   api_key_var="POSTTRAIN_UNUSED")
        # Env._interception (private): verifiers 0.4 gives no public handle on the live server
        # an Env serves through; its `clients` (one per endpoint config) is where a caller's
        # Client goes, under the key of the episode's own endpoint config
        clients = env._interception.clients
        clients[key.model_dump_json()] = make_client(router.policy_for, self.renders_tools)
        ctx = vf.ModelContext(model="policy", client=key, sampling=vf.SamplingConfig())
        try:
            future = asyncio.run_coroutine_threadsafe(
                env.run_episode(task, ctx, on_trace=router.minted), loop)
            try:
                episode = future.result(self.time_limit(next(iter(policies.values()))))
            except TimeoutError:
                future.cancel()
                raise EpisodeTimeout("the verifiers episode passed its time limit (timeout_s, "
                                     "else env.episode_timeout_s)") from None
        finally:
            clients.pop(key.model_dump_json(), None)
        return seat_ends(episode, tuple(policies), router.owner, answered=bool(problem.answer))

    def time_limit(self, policy: Any) -> float | None:
        """Seconds an episode may still take: timeout_s, else what the episode has left (None:
        no limit; inf is None here, as Future.result cannot wait for inf)."""
        if self.timeout_s is not None:
            return no_limit_as_none(self.timeout_s)
        left = getattr(policy, "time_left", None)
        return no_limit_as_none(left()) if callable(left) else None

    def started(self, stream):
        """The event loop thread and the serving Env, started on the first episode."""
        with self._lock:
            if self._loop is None:
                import verifiers.v1 as vf

                import posttrain.envs.verifiers_harness as verifiers_harness
                sys.modules.setdefault(HARNESS, verifiers_harness)
                env = vf.load_environment(local_config(stream.env_config, self.max_turns))
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name="verifiers").start()
                serving = env.serving()
                asyncio.run_coroutine_threadsafe(serving.__aenter__(), loop).result(120)
                self._loop, self._env, self._serving = loop, env, serving
                self._stream = stream
            if stream is not self._stream:
                raise ValueError(f"one verifiers environment runs one taskset: it serves "
                                 f"verifiers:{self._stream.taskset_id}, and a problem of "
                                 f"verifiers:{stream.taskset_id} came")
            return self._loop, self._env

    def close(self) -> None:
        with self._lock:
            if self._loop is not None:
                asyncio.run_coroutine_threadsafe(self._serving.__aexit__(None, None, None),
                                                 self._loop).result(60)
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._loop, self._env, self._serving, self._stream = None, None, None, None
