"""An external agent harness as the environment (docs/environments.md): `run(base_url, problem)`
runs one episode against the policy behind an OpenAI-compatible endpoint (envs/endpoint.py; any
client: the openai SDK, an agent framework) and returns its reward, or a `Driven` with a verdict
and the reward's parts. posttrain records the exact tokens of every call of the episode and
trains on them (rollout/driven.py); the harness never handles token ids unless it wants to.

    def run(base_url: str, problem: Problem) -> float | Driven:
        client = openai.OpenAI(base_url=base_url, api_key="none")
        reply = client.chat.completions.create(model="policy", messages=[...])
        ...

Each episode gets its own session URL (`.../s/<id>/v1`), alive while `run` runs; a request
after the episode's token budget is answered 400. `run` is your code and runs in the trainer's
process, one daemon thread per episode. An episode that holds its turn past `env.turn_timeout_s`
or runs past `env.episode_timeout_s` is ended (its requests answered 400), counted
(env/timeouts) and left out of the loss; its session URL is dropped when the batch ends (later
requests: 404) and its thread is abandoned, never waited for again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from posttrain.data.tasks import Problem
from posttrain.envs.base import Driven, DrivingEnvironment
from posttrain.envs.endpoint import Endpoint


class AgentEnvironment(DrivingEnvironment):
    """Episodes run by `run(base_url, problem)` against the policy's endpoint."""

    def __init__(self, run: Callable[[str, Problem], Any], max_turns: int = 4,
                 name: str = "agent") -> None:
        self.run, self.max_turns, self.name = run, max_turns, name
        self._endpoint: Endpoint | None = None
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> Endpoint:
        with self._lock:
            if self._endpoint is None:
                self._endpoint = Endpoint(model="policy")
            return self._endpoint

    def drive(self, policy: Any, problem: Problem) -> Driven:
        url = self.endpoint.add(policy)
        if hasattr(policy, "on_end"):   # (a time limit ends the episode: its session goes now,
            policy.on_end(lambda: self.endpoint.drop(url))   # whether or not `run` returns)
        try:
            out = self.run(url, problem)
        finally:
            self.endpoint.drop(url)
        return out if isinstance(out, Driven) else Driven(float(out or 0.0))

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = None
