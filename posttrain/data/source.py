"""Where training prompts come from: the task a config names, and its training stream in order."""

from __future__ import annotations

import random

from posttrain.config import ConfigError, DataConfig
from posttrain.data.files import load_problems
from posttrain.data.tasks import MixedTask, Problem, Task, make_task


def build_task(d: DataConfig) -> Task:
    """The task `data` names: a built-in task (or a mixture of them) or a user file, with its
    held-out set split off."""
    if d.task == "file":
        pool = load_problems(d.train_path, d.prompt_field, d.answer_field)
        if d.eval_path:
            held_out = load_problems(d.eval_path, d.prompt_field, d.answer_field)
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


class Sampler:
    """Draws training prompts in a fixed order; the position is saved in checkpoints."""

    def __init__(self, task: Task, seed: int, position: int = 0) -> None:
        self.task, self.seed, self.position = task, seed, position

    def next(self, n: int) -> list[Problem]:
        problems = [self.task.train_problem(self.seed, self.position + i) for i in range(n)]
        self.position += n
        return problems
