"""A verifiers environment's taskset as posttrain's problems (`data.task verifiers:ID`,
docs/environments.md), loaded the way verifiers loads it and drawn on demand.

The id is verifiers' own (`kuhn-poker`, `owner/name@version`: the installed module
`kuhn_poker`, resolved by `verifiers.v1.utils.loaders`), or a dotted module path
(`examples.verifiers_addition`). `data.task_options` is the taskset's config (verifiers'
`--env.taskset.*`), validated by verifiers before any model loads.

Tasks are read from the taskset's `load()` only as far as they are asked for, into a cache by
position: an `INFINITE` taskset (a generator) is read as far as the run's steps draw, never to its
end. The held-out set is `data.eval_size` tasks drawn with `data.eval_seed` from the taskset's
first 5 x eval_size (a taskset with fewer: a fifth of them, as a file's split), the training
stream the other tasks: in load order on the first pass, reshuffled with the run's seed on every
later pass of a finite taskset. Each problem's prompt is its task's text (empty for a task
without a prompt: its environment opens the conversation; the text is for logs, the episode's
messages are verifiers'), its answer the task's `answer` field when it has one, its meta the
taskset id, the task's position and the options (`verifiers`, `verifiers_index`,
`verifiers_options`). The episode itself runs in verifiers (envs/verifiers_env.py). `verifiers`
(PyPI, 0.4.x) is an optional extra, imported here only when such a task is named."""

from __future__ import annotations

import functools
import importlib
import json
import random
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

from posttrain.data.tasks import Problem, Task
from posttrain.util.errors import ConfigError


def vf_id(taskset_id: str) -> str:
    """The id verifiers' loader is given. A dotted module path (posttrain's spelling for a module
    inside a package) is imported here and registered under a top-level alias: verifiers' loader
    probes `verifiers.v1.tasksets.<id>` first, and that probe raises on a dotted name."""
    if "." not in taskset_id or "/" in taskset_id or "@" in taskset_id:
        return taskset_id
    alias = taskset_id.replace(".", "__")
    sys.modules.setdefault(alias, importlib.import_module(taskset_id))
    return alias


@dataclass
class TaskStream:
    """A taskset's tasks by position, read from `load()` as far as asked (thread-safe)."""

    taskset_id: str                 # as the config names it
    env_config: Any                 # verifiers' resolved EnvConfig (the taskset's config in it)
    infinite: bool
    options_json: str = "{}"        # data.task_options (sorted JSON): with the id, the stream's key
    tasks: list[Any] = field(default_factory=list)
    _it: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def read(self, n: int) -> int:
        """Read until `n` tasks are cached or the taskset ends; how many are cached."""
        with self._lock:
            while len(self.tasks) < n and self._it is not None:
                task = next(self._it, None)
                if task is None:
                    self._it = None
                else:
                    self.tasks.append(task)
            return len(self.tasks)

    @property
    def ended(self) -> bool:
        return self._it is None

    def task(self, position: int) -> Any:
        if self.read(position + 1) <= position:
            raise IndexError(f"verifiers:{self.taskset_id} has {len(self.tasks)} tasks; "
                             f"task {position} was asked for")
        return self.tasks[position]


def one_taskset(module: Any) -> None:
    """verifiers' plugin rule, checked first for a message that names the fix: a taskset module
    exports exactly one Taskset subclass in `__all__`."""
    import verifiers.v1 as vf
    found = [obj.__name__ for name in getattr(module, "__all__", ())
             if isinstance(obj := getattr(module, name, None), type)
             and issubclass(obj, vf.Taskset) and obj is not vf.Taskset]
    if len(found) != 1:
        raise ValueError(f"{module.__name__} must export exactly one Taskset subclass in "
                         f"__all__ (found {found})")


def env_config(taskset_id: str, options: dict[str, Any]) -> Any:
    """verifiers' EnvConfig for the taskset with `options` as its config, each narrowed to the
    class the package declares (as `vf-eval --env.taskset.id ID --env.taskset.KEY VALUE`)."""
    import verifiers.v1 as vf
    if "id" in options:
        raise ConfigError("data.task_options: 'id' is the taskset's own (data.task verifiers:ID)")
    one_taskset(vf.import_taskset(vf_id(taskset_id)))
    return vf.resolve_env_config({"taskset": {**options, "id": vf_id(taskset_id)}})


@functools.cache
def _stream(taskset_id: str, options_json: str) -> TaskStream:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ConfigError("data.task verifiers:... needs verifiers 0.4: pip install "
                          "'posttrain[verifiers]'") from None
    try:
        config = env_config(taskset_id, json.loads(options_json))
        taskset = vf.load_taskset(config.taskset)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the loader's own message says what is wrong
        given = f" (data.task_options {options_json})" if options_json != "{}" else ""
        why = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ConfigError(f"data.task verifiers:{taskset_id}{given}: {type(e).__name__}: "
                          f"{why}") from None
    return TaskStream(taskset_id, config, taskset.INFINITE, options_json, _it=iter(taskset))


def task_stream(taskset_id: str, options: dict[str, Any] | None = None) -> TaskStream:
    """The taskset's stream, one per (id, options) in a process (the environment's episodes
    read their tasks from the one the problems came from)."""
    return _stream(taskset_id, json.dumps(options or {}, sort_keys=True))


def task_text(prompt: Any) -> str:
    """A task's prompt as text (a message list: its messages' text, one per line; None: '')."""
    if prompt is None or isinstance(prompt, str):
        return prompt or ""
    return "\n".join(str(getattr(m, "content", m)) for m in prompt)


def as_problem(stream: TaskStream, position: int) -> Problem:
    data = stream.task(position).data
    meta = {"verifiers": stream.taskset_id, "verifiers_index": position}
    if stream.options_json != "{}":
        meta["verifiers_options"] = stream.options_json
    return Problem(task_text(data.prompt), str(getattr(data, "answer", "") or ""), meta=meta)


@dataclass
class VerifiersTask(Task):
    """posttrain's Task over a TaskStream: `held_out` positions for evaluation, the others (in
    order, then the tasks past the `window` read at the start) for training."""

    stream: TaskStream | None = None
    held_out: tuple[int, ...] = ()
    window: int = 0

    def build_eval(self, size: int, seed: int) -> None:
        """(The held-out set is drawn when the task is built.)"""

    def position(self, k: int) -> int:
        """The taskset position of training task k (first pass, load order)."""
        kept = self.window - len(self.held_out)
        if k >= kept:
            return self.window + (k - kept)
        held = set(self.held_out)
        return [i for i in range(self.window) if i not in held][k]

    def train_problem(self, seed: int, index: int) -> Problem:
        """Training problem `index`: on the first pass the taskset's tasks in load order (the
        held-out ones left out); once a finite taskset has ended, every later pass in an order
        drawn from (seed, pass)."""
        position = self.position(index)
        if self.stream.read(position + 1) > position:
            return as_problem(self.stream, position)
        n_train = len(self.stream.tasks) - len(self.held_out)
        rounds, i = divmod(index, n_train)
        order = random.Random(f"{seed}-{rounds}").sample(range(n_train), n_train)
        return as_problem(self.stream, self.position(order[i]))

    @property
    def train_pool(self) -> list[Problem] | None:
        """Every training problem: a finite taskset read to its end (a tool that wants the
        list; training draws with `train_problem`). An INFINITE taskset has none."""
        if self.stream is None or self.stream.infinite:
            return None
        n = self.stream.read(sys.maxsize)
        return [as_problem(self.stream, self.position(k)) for k in range(n - len(self.held_out))]

    @train_pool.setter
    def train_pool(self, value: None) -> None:   # (the dataclass's __init__ sets the base field)
        if value is not None:
            raise ValueError("a verifiers task's training problems are its taskset's")


def verifiers_task(taskset_id: str, eval_size: int, seed: int,
                   options: dict[str, Any] | None = None) -> Task:
    """The taskset as a Task. The held-out set is `eval_size` tasks drawn with `seed` from the
    taskset's first 5 x eval_size (a finite taskset with fewer holds out a fifth of them, as a
    file does); no more than those are read now, whatever the taskset's size."""
    stream = task_stream(taskset_id, options)
    n = stream.read(5 * eval_size + 1)
    if n == 0:
        raise ConfigError(f"data.task verifiers:{taskset_id}: the taskset has no tasks")
    window = min(n, 5 * eval_size)
    n_eval = min(eval_size, window // 5)
    held = sorted(random.Random(seed).sample(range(window), window)[:n_eval])
    return VerifiersTask(f"verifiers:{taskset_id}", lambda rng: as_problem(stream, 0),
                         verifier="none", environment="verifiers",
                         eval_problems=[as_problem(stream, i) for i in held],
                         stream=stream, held_out=tuple(held), window=window)
