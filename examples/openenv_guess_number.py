"""Guess-the-number as an OpenEnv environment: the built-in `guess_number` environment
(posttrain/envs/builtin.py) re-expressed in OpenEnv's types, to train through the OpenEnv adapter
(docs/environments.md). In process:

    posttrain train --config posttrain/recipes/guess_number.yaml \
        --env.name openenv --env.openenv examples.openenv_guess_number:GuessNumberEnv

Served (one session per episode; with fewer sessions than prompts_per_step x group_size, the
episodes queue for one):

    python examples/openenv_guess_number.py --port 8001 --sessions 32 &
    posttrain train --config posttrain/recipes/guess_number.yaml \
        --env.name openenv --env.openenv http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str                      # the policy's turn


class GuessObservation(Observation):  # (done and reward come with Observation)
    message: str = ""


class GuessState(State):
    secret: int | None = None


class GuessNumberEnv(Environment[GuessAction, GuessObservation, GuessState]):
    """The secret is the problem's answer (posttrain passes it to reset); a wrong guess is
    answered 'Higher.' or 'Lower.', reward 1 and done when it is found. Its reset shows nothing
    (the built-in's prompt is the whole task): the episodes are the built-in's, token for token."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None,
              answer: str | None = None, **kwargs: Any) -> GuessObservation:
        self._state = GuessState(episode_id=episode_id, step_count=0, secret=int(answer))
        return GuessObservation()   # no text: the problem's prompt alone opens the episode

    def step(self, action: GuessAction, timeout_s: float | None = None,
             **kwargs: Any) -> GuessObservation:
        self._state.step_count += 1
        numbers = re.findall(r"-?\d+", action.message)
        if not numbers or len(numbers[-1]) > 30:
            return GuessObservation(message="Answer with one number.", reward=0.0)
        guess, secret = int(numbers[-1]), self._state.secret
        if guess == secret:
            return GuessObservation(message="Correct.", reward=1.0, done=True)
        return GuessObservation(message="Higher." if secret > guess else "Lower.", reward=0.0)

    @property
    def state(self) -> GuessState:
        return self._state


def serve(port: int, sessions: int, host: str = "127.0.0.1"):
    """The environment on http://host:port (WebSocket sessions at /ws), `sessions` at once."""
    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app
    app = create_fastapi_app(GuessNumberEnv, GuessAction, GuessObservation,
                             max_concurrent_envs=sessions)
    uvicorn.run(app, host=host, port=port, log_level="warning")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--sessions", type=int, default=32)
    args = parser.parse_args()
    serve(args.port, args.sessions)
