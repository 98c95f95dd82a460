"""The built-in environments: tool use over any task, and guess-the-number with feedback."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from typing import Any

from posttrain.data.preferences import expression
from posttrain.data.tasks import Problem
from posttrain.envs.base import Reply
from posttrain.envs.tools import Tool, calculate, parse_calls, run_call


@dataclass(frozen=True)
class ToolEnv:
    """The policy may call tools before it answers: a turn with tool calls is answered with their
    results (role 'tool'); a turn without one is the final answer, scored by the task's verifier.
    A malformed call is answered with an error message; the counts go to the step's metrics."""

    tools: tuple[Tool, ...]
    max_turns: int = 4
    format: str = "tag"                 # 'tag' or 'json' (envs/tools.py); 'auto' until bound
    timeout_s: float = 5.0
    name: str = "tools"
    calls_per_turn: int = 4             # calls past these caps are answered with an error, not run
    calls_per_episode: int = 16
    seconds_per_episode: float = 30.0   # tool time an episode may use in all
    seconds_per_batch: float = 120.0    # tool time all episodes of a batch (a step's) may use in all
    # the batch's tool seconds so far (start_batch resets it; shared by the batch's episodes)
    _batch: dict = field(default_factory=lambda: {"seconds": 0.0}, compare=False, repr=False)

    @property
    def by_name(self) -> dict[str, Tool]:
        return {t.name: t for t in self.tools}

    @property
    def stop(self) -> tuple[str, ...]:
        if self.format == "json":
            return ("</tool_call>",)
        return tuple(f"</{t.name}>" for t in self.tools)

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """Passed to the chat template when it renders tools itself (format 'json')."""
        return [t.schema for t in self.tools] if self.format == "json" else None

    def bind(self, tokenizer) -> ToolEnv:
        """Resolve format 'auto': the template's own tool format ('json') when it takes tools."""
        if self.format != "auto":
            return self
        template = getattr(tokenizer, "chat_template", None) or ""
        return replace(self, format="json" if "tools" in template else "tag")

    def system_prompt(self, base: str | None) -> str | None:
        if self.format == "json":   # the chat template writes the tool instructions itself
            return base
        lines = [f"- {t.name}: {t.description} Example: <{t.name}>"
                 f"{_example(t)}</{t.name}>" for t in self.tools]
        text = ("You can use tools. To call one, write <NAME>ARGUMENT</NAME>; its result comes "
                "back in the next message. When you know the answer, write it without a tool "
                "call.\nTools:\n" + "\n".join(lines))
        return f"{base}\n\n{text}" if base else text

    def start_batch(self) -> None:
        """A new batch of episodes (a step's rollouts, an evaluation chunk): its tool time restarts."""
        self._batch["seconds"] = 0.0

    def reset(self, problem: Problem) -> Any:
        """An episode's tool budget: calls made and seconds spent so far."""
        return {"calls": 0, "seconds": 0.0}

    def demonstration(self, problem: Problem) -> list[dict[str, str]]:
        """An expert's episode for an arithmetic prompt ('What is 37 * 48?'): one calculator
        call, its result, the answer ('37 * 48 = 1776'); SFT data that teaches the call format
        (`posttrain generate --demonstrate`)."""
        if "calculator" not in self.by_name:
            raise ValueError("demonstrations need the calculator tool (env.tools calculator)")
        expr = expression(problem)
        call = expr.replace(" ", "")
        text = (f"<calculator>{call}</calculator>" if self.format != "json" else
                '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % call)
        result = calculate(expr)
        return [{"role": "assistant", "content": text}, {"role": "tool", "content": result},
                {"role": "assistant", "content": f"{expr} = {result}"}]

    def step(self, state: Any, text: str, turn: int) -> Reply:
        calls, errors = parse_calls(text, self.by_name, self.format)
        if not calls and not errors:                # a final answer (0s: the rates are per episode)
            return Reply(counts={"tool_calls": 0, "malformed_calls": 0, "tool_failures": 0,
                                 "tools_broken": 0, "capped_calls": 0})
        budget = state if state is not None else self.reset(None)
        results, failures, broken, capped = [], 0, 0, 0
        for i, call in enumerate(calls):
            refusal = self._over_budget(budget, i)
            if refusal:
                results.append(refusal)
                capped += 1
                continue
            t0 = time.monotonic()
            timeout = min(self.timeout_s, self.seconds_per_episode - budget["seconds"],
                          self.seconds_per_batch - self._batch["seconds"])
            out, status = run_call(call, self.by_name, timeout)
            budget["calls"] += 1
            budget["seconds"] += time.monotonic() - t0
            self._batch["seconds"] += time.monotonic() - t0
            results.append(out)
            failures += status != "ok"
            broken += status == "failed"
        content = "\n".join(results + [f"error: {e}" for e in errors])
        return Reply({"role": "tool", "content": content},
                     counts={"tool_calls": len(calls) - capped, "malformed_calls": len(errors),
                             "tool_failures": failures, "tools_broken": broken,
                             "capped_calls": capped})

    def _over_budget(self, budget: dict[str, Any], i: int) -> str | None:
        """Why the i-th call of a turn may not run (a cap is reached), or None."""
        if i >= self.calls_per_turn:
            return f"error: at most {self.calls_per_turn} tool calls per turn; this one was not run"
        if budget["calls"] >= self.calls_per_episode:
            return f"error: at most {self.calls_per_episode} tool calls per episode; not run"
        if budget["seconds"] >= self.seconds_per_episode:
            return f"error: the episode's {self.seconds_per_episode:g} s of tool time are used up"
        if self._batch["seconds"] >= self.seconds_per_batch:
            return f"error: this step's {self.seconds_per_batch:g} s of tool time are used up"
        return None


def _example(tool: Tool) -> str:
    return {"calculator": "37*48", "python": "print(2**10)"}.get(tool.name, "...")


_INT = re.compile(r"-?\d+")


@dataclass(frozen=True)
class GuessNumber:
    """Guess a secret integer (the problem's answer); each wrong guess is answered 'Higher.' or
    'Lower.'. Reward 1 for finding it within `max_turns` guesses, 0 otherwise."""

    max_turns: int = 5
    name: str = "guess_number"
    stop: tuple[str, ...] = ()
    tool_schemas: None = None

    def system_prompt(self, base: str | None) -> str | None:
        return base

    def reset(self, problem: Problem) -> Any:
        return int(problem.answer)

    def step(self, secret: int, text: str, turn: int) -> Reply:
        numbers = _INT.findall(text)
        if not numbers or len(numbers[-1]) > 30:   # (int() refuses 4,300 digits: not a guess either)
            return Reply({"role": "user", "content": "Answer with one number."}, correct=False,
                         counts={"invalid_guesses": 1})
        guess, valid = int(numbers[-1]), {"invalid_guesses": 0}   # logged as 0 in a step without one
        if guess == secret:
            return Reply(None, reward=1.0, correct=True, counts=valid)
        return Reply({"role": "user", "content": "Higher." if secret > guess else "Lower."},
                     correct=False, counts=valid)
