"""A verifiers taskset as posttrain's problems (`data.task verifiers:ID`, docs/environments.md):
each task of the taskset `ID` (an importable module exporting one `verifiers.v1.Taskset`) is a
problem whose prompt is the task's, whose answer is its `answer` field when it has one, and whose
meta names the task (`verifiers`, `verifiers_index`); the episode itself runs in verifiers
(envs/verifiers_env.py). A held-out split is taken off the taskset with a fixed seed, as for a
file. `verifiers` (PyPI, 0.4.x) is an optional extra, imported here only."""

from __future__ import annotations

import functools
import importlib
import random
from typing import Any

from posttrain.data.tasks import Problem, Task
from posttrain.util.errors import ConfigError


@functools.cache
def load_taskset_tasks(taskset_id: str) -> tuple[Any, ...]:
    """The taskset's tasks, loaded once per process."""
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("data.task verifiers:... needs verifiers 0.4: pip install "
                          "'posttrain[verifiers]'") from None
    try:
        cls = taskset_class(importlib.import_module(taskset_id), vf.Taskset)
        from verifiers.v1.utils.generic import concrete_type
        config = concrete_type(cls, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        tasks = tuple(cls(config(id=taskset_id)))
    except Exception as e:  # noqa: BLE001 - the loader's own message says what is wrong
        raise ConfigError(f"data.task verifiers:{taskset_id}: {type(e).__name__}: {e}") from None
    if not tasks:
        raise ConfigError(f"data.task verifiers:{taskset_id}: the taskset has no tasks")
    return tasks


def taskset_class(module, base: type) -> type:
    """The one `base` subclass a module exports in `__all__` (verifiers' plugin rule). Loaded
    here rather than by verifiers' loader, which only finds top-level module names."""
    found = [obj for name in getattr(module, "__all__", ()) if isinstance(obj := getattr(module, name, None), type)
             and issubclass(obj, base) and obj is not base]
    if len(found) != 1:
        raise ValueError(f"{module.__name__} must export exactly one {base.__name__} subclass in "
                         f"__all__ (found {[c.__name__ for c in found]})")
    return found[0]


def task_text(prompt: Any) -> str:
    """A task's prompt as text (a message list: its messages' text, one per line)."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    return "\n".join(str(getattr(m, "content", m)) for m in prompt)


def verifiers_task(taskset_id: str, eval_size: int, seed: int) -> Task:
    tasks = load_taskset_tasks(taskset_id)
    pool = [Problem(task_text(t.data.prompt), str(getattr(t.data, "answer", "") or ""),
                    meta={"verifiers": taskset_id, "verifiers_index": i})
            for i, t in enumerate(tasks)]
    order = random.Random(seed).sample(range(len(pool)), len(pool))
    n_eval = min(eval_size, len(pool) // 5)
    held_out = [pool[i] for i in order[:n_eval]]
    train = [pool[i] for i in order[n_eval:]]
    return Task(f"verifiers:{taskset_id}", lambda rng: train[0], verifier="none",
                train_pool=train, eval_problems=held_out, environment="verifiers")
