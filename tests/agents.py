"""Environments that drive the policy, for tests/test_driven.py and tests/test_hung_episodes.py:
guess-the-number run by its own loop (in process, and by an external client through the
OpenAI-compatible endpoint), and harnesses that never answer."""

from __future__ import annotations

import threading

from posttrain.data.tasks import Problem
from posttrain.envs import GuessNumber
from posttrain.envs.base import Driven

CALLS: dict[str, list[dict]] = {}   # each episode's endpoint replies, by the problem's answer


class DrivenGuess:
    """The built-in GuessNumber's episode, driven: ask, read the guess, answer, ask again.
    `rewrite`: send the policy's reply back edited (a template that rewrites history)."""

    name, stop, tool_schemas = "driven_guess", (), None

    def __init__(self, max_turns: int = 3, rewrite: bool = False) -> None:
        self.max_turns, self.rewrite = max_turns, rewrite

    def system_prompt(self, base):
        return base

    def drive(self, policy, problem: Problem) -> Driven:
        from posttrain.rollout.driven import EpisodeOver
        native, reward = GuessNumber(self.max_turns), 0.0
        secret, messages = native.reset(problem), [{"role": "user", "content": problem.prompt}]
        for turn in range(1, self.max_turns + 1):
            try:
                out = policy.chat(messages)
            except EpisodeOver:
                return Driven(reward)
            said = out.text + " (edited)" if self.rewrite else out.text
            messages = messages + [{"role": "assistant", "content": said}]
            reply = native.step(secret, out.text, turn)
            reward += reply.reward
            if reply.message is None or turn == self.max_turns:
                return Driven(reward, reply.correct, parts={"found": reward})
            messages.append(reply.message)
        return Driven(reward)


def guess_over_http(base_url: str, problem: Problem) -> float:
    """An external harness: the openai SDK against the policy's endpoint, the replies kept."""
    import openai
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    native = GuessNumber(3)
    secret, messages = native.reset(problem), [{"role": "user", "content": problem.prompt}]
    calls = CALLS.setdefault(base_url, [])
    for turn in range(1, 4):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages)
        except openai.BadRequestError:   # the episode's token budget is spent
            return 0.0
        calls.append(reply.model_dump())
        text = reply.choices[0].message.content
        answer = native.step(secret, text, turn)
        if answer.message is None or turn == 3:
            return answer.reward
        messages += [{"role": "assistant", "content": text}, answer.message]
    return 0.0


RELEASE = threading.Event()   # set by a test when it is done: a hung harness's thread ends
STARTED = {"episodes": 0}     # episodes the hanging harnesses began, in this process
_LOCK = threading.Lock()
EPISODES_PER_STEP = 4         # (the tests' runs: 2 prompts x group 2)


def _nth_episode() -> int:
    with _LOCK:
        STARTED["episodes"] += 1
        return STARTED["episodes"] - 1


def hangs_once_a_step(base_url: str, problem: Problem) -> float:
    """guess_over_http, except that the first episode to start in each step never answers: it
    sleeps until the test releases it (forever, in a run of its own)."""
    if _nth_episode() % EPISODES_PER_STEP == 0:
        RELEASE.wait()
        return 0.0
    return guess_over_http(base_url, problem)


def hangs_after_the_first_step(base_url: str, problem: Problem) -> float:
    """guess_over_http for the first step's episodes; every later episode never answers: a
    step that cannot finish."""
    if _nth_episode() >= EPISODES_PER_STEP:
        RELEASE.wait()
        return 0.0
    return guess_over_http(base_url, problem)


def closes_never(cfg):
    """env.name for a run whose cleanup hangs: the agent environment of
    hangs_after_the_first_step, whose `close` never returns."""
    from posttrain.envs.agent import AgentEnvironment

    class ClosesNever(AgentEnvironment):
        def close(self) -> None:
            RELEASE.wait()
    return ClosesNever(hangs_after_the_first_step, cfg.max_turns)


try:   # (openenv is an optional extra)
    from examples.openenv_guess_number import GuessAction, GuessNumberEnv
except ImportError:   # pragma: no cover - the tests that use it skip
    GuessNumberEnv = None
else:
    class StuckOnceAStep(GuessNumberEnv):
        """The example OpenEnv environment whose first step of each batch of
        EPISODES_PER_STEP never answers (until the test releases it)."""

        def step(self, action: GuessAction, timeout_s: float | None = None, **kwargs):
            with _LOCK:
                STARTED["steps"] = STARTED.get("steps", 0) + 1
                first = STARTED["steps"] % EPISODES_PER_STEP == 1
            if first:
                RELEASE.wait()
            return super().step(action, timeout_s, **kwargs)
