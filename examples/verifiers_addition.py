"""The default job's task, 2-digit addition, as a verifiers 0.4 taskset: the same problems
(posttrain's own generator) and, as its rubric, the response's final number (posttrain's
`final_answer`) compared with the sum as an integer, to train through the verifiers adapter
(docs/environments.md) beside the native task:

    posttrain train --data.task verifiers:examples.verifiers_addition

A verifiers rubric runs where verifiers runs it: in the trainer's process, in a thread, not in
posttrain's reward sandbox (docs/safety.md). So this one only reads the text with a regular
expression and compares integers; math-verify (sympy, with a signal-based timeout that refuses
to run in a thread) is what posttrain's own verifier uses in its sandbox.
"""

from __future__ import annotations

import random

import verifiers.v1 as vf

from posttrain.data.tasks import make_task
from posttrain.rewards.verifiers import final_answer

SIZE = 4000          # distinct problems drawn (the held-out split is taken from them)


class AdditionData(vf.TaskData):
    answer: str


class AdditionTask(vf.Task[AdditionData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: AdditionData, trace: vf.Trace) -> float:
        return float(same_number(trace.last_reply or "", task.answer))


def same_number(reply: str, answer: str) -> bool:
    """The reply's final number (its last \\boxed{} or last number), as an integer, is the answer."""
    final = (final_answer(reply) or "").replace(",", "").strip()
    digits = final.removeprefix("-")
    return digits.isdigit() and len(digits) < 30 and int(final) == int(answer)


class AdditionTaskset(vf.Taskset[AdditionTask, vf.TasksetConfig]):
    def load(self):
        task, rng, seen = make_task("addition", 2), random.Random(0), set()
        while len(seen) < SIZE:
            p = task.make_problem(rng)
            if p.prompt not in seen:
                seen.add(p.prompt)
                yield AdditionTask(AdditionData(prompt=p.prompt, answer=p.answer), self.config.task)


__all__ = ["AdditionTask", "AdditionTaskset"]
