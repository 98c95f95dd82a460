"""Where training prompts come from: the task a config names, and its training stream in order."""

from __future__ import annotations

import random

from posttrain.util.errors import ConfigError
from posttrain.config.sections import DataConfig
from posttrain.data.files import load_problems
from posttrain.data.tasks import MixedTask, Problem, Task, make_task


def build_task(d: DataConfig, needs_answer: bool = True) -> Task:
    """The task `data` names: a built-in task (or a mixture of them) or a user file, with its
    held-out set split off. `needs_answer` False (no verifier scores against the rows' answers):
    a file's prompt-only rows are read too."""
    if d.task == "file":
        pool = load_problems(d.train_path, d.prompt_field, d.answer_field, needs_answer=needs_answer)
        if d.eval_path:
            held_out = load_problems(d.eval_path, d.prompt_field, d.answer_field,
                                     needs_answer=needs_answer)
        else:  # split the held-out set off the file with a fixed seed
            order = random.Random(d.eval_seed).sample(range(len(pool)), len(pool))
            n_eval = min(d.eval_size, len(pool) // 5)
            held_out = [pool[i] for i in order[:n_eval]]
            pool = [pool[i] for i in order[n_eval:]]
        return Task("file", lambda rng: pool[0], train_pool=pool, eval_problems=held_out[:d.eval_size])
    if d.task.startswith("reasoning_gym:"):     # a library's task family (data/gym.py)
        from posttrain.data.gym import reasoning_gym_task
        try:
            return reasoning_gym_task(d.task.partition(":")[2], dict(d.task_options), d.eval_size,
                                      d.eval_seed, d.train_size)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if d.task.startswith("verifiers:"):          # a verifiers taskset (data/verifiers_tasks.py)
        from posttrain.data.verifiers_tasks import verifiers_task
        return verifiers_task(d.task.partition(":")[2], d.eval_size, d.eval_seed,
                              dict(d.task_options))
    parts = []
    for spec in d.task.split("+"):   # 'addition+arithmetic:1': a mixture, difficulty per task
        name, _, level = spec.partition(":")
        if level and not level.isdigit():
            raise ConfigError(f"data.task={d.task!r}: {spec!r} must be NAME or NAME:DIFFICULTY "
                              "(an integer)")
        try:
            parts.append(make_task(name, int(level) if level else d.difficulty))
        except KeyError as e:
            raise ConfigError(f"data.task={d.task!r} is not valid; {e.args[0]}") from None
    task = parts[0] if len(parts) == 1 else MixedTask(parts)
    task.build_eval(d.eval_size, d.eval_seed)
    return task


class PromptStream:
    """Draws training prompts in a fixed order; its position (and the prompts waiting to be asked
    again) are saved in checkpoints.

    With `retries` > 0, a prompt the trainer reports (its group was not all correct) is asked
    again at the next step, up to `retries` times: the simplest form of Kimi k1.5's prioritised
    sampling (sample a problem in proportion to how often it fails). Late in a run most groups
    are all correct and teach nothing; the ones that failed are where the signal is. Prompts
    asked again fill at most half of a draw, so the stream keeps moving, and at most
    `max_waiting` wait (the oldest are dropped)."""

    def __init__(self, task: Task, seed: int, position: int = 0, retries: int = 0,
                 max_waiting: int = 0) -> None:
        self.task, self.seed, self.position = task, seed, position
        self.retries, self.max_waiting = retries, max_waiting
        self.draws = position                   # prompts drawn so far: each draw's noise key
        self.waiting: list[tuple[int, int]] = []     # (stream index, times asked again) to ask again
        self.redo: list[tuple[int, int]] = []   # drawn, never trained on (a stale batch): drawn first
        self._last: list[tuple[int, int]] = []
        self.last_retried = 0                   # prompts of the last draw that were asked again
        self.drawn: list[tuple[int, int]] | None = None   # when a list: every draw's prompts added

    def next(self, n: int) -> list[Problem]:
        """The next n prompts of the stream (no retries: demonstrations, evaluation sweeps)."""
        problems = [self.task.train_problem(self.seed, self.position + i) for i in range(n)]
        self.position += n
        self.draws += n
        return problems

    def draw(self, n: int) -> tuple[list[Problem], list[int]]:
        """n prompts, the ones waiting to be asked again first (at most n // 2), and one noise
        key per prompt (distinct across every draw of the run: a retry gets fresh samples)."""
        first, self.redo = self.redo[:n], self.redo[n:]
        k = (n - len(first)) // 2
        again, self.waiting = self.waiting[:k], self.waiting[k:]
        self.last_retried = len(again)
        fresh = list(range(self.position, self.position + n - len(first) - len(again)))
        self.position += len(fresh)
        self._last = first + [(i, asked + 1) for i, asked in again] + [(i, 0) for i in fresh]
        if self.drawn is not None:
            self.drawn += self._last
        keys = list(range(self.draws, self.draws + n))
        self.draws += n
        return [self.task.train_problem(self.seed, i) for i, _ in self._last], keys

    def report(self, ask_again: list[bool]) -> None:
        """Which prompts of the last `draw` to ask again (the trainer's `data.retry_if`: not
        solved by every answer of its group, or solved by some but not all); they wait while
        they have retries left."""
        if len(ask_again) != len(self._last):
            raise ValueError(f"report() got {len(ask_again)} verdicts for {len(self._last)} prompts drawn")
        if self.retries:
            self.waiting += [(i, asked) for (i, asked), again in zip(self._last, ask_again)
                             if again and asked < self.retries]
            if self.max_waiting:
                self.waiting = self.waiting[-self.max_waiting:]
        self._last = []

    def give_back(self, drawn: list[tuple[int, int]]) -> None:
        """Prompts drawn but never trained on (asynchronous training dropped their stale batch):
        they come first in the next draws, as they were (and no longer wait to be retried: the
        dropped batch's report is void)."""
        given = {i for i, _ in drawn}
        self.waiting = [w for w in self.waiting if w[0] not in given]
        self.redo += [tuple(d) for d in drawn]

    def state(self) -> dict:
        return {"position": self.position, "draws": self.draws,
                "waiting": [list(w) for w in self.waiting], "redo": [list(w) for w in self.redo]}

    def load_state(self, state: dict) -> None:
        self.position = state["position"]
        self.draws = state.get("draws", self.position)
        self.waiting = [(int(i), int(a)) for i, a in state.get("waiting", [])]
        self.redo = [(int(i), int(a)) for i, a in state.get("redo", [])]
