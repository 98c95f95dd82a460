"""Environments that drive the policy, for tests/test_driven.py: guess-the-number run by its own
loop (in process, and by an external client through the OpenAI-compatible endpoint)."""

from __future__ import annotations

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
