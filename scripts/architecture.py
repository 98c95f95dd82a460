"""docs/architecture.md from the tree: the house (two services every command composes), then
every layer and module with the first sentence of its docstring. `python scripts/architecture.py`
writes it; tests/test_architecture.py checks the committed page is what the tree gives."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "posttrain"
PAGE = ROOT / "docs" / "architecture.md"

HOUSE = """\
# Architecture

*Generated from the tree by `python scripts/architecture.py` (tests/test_architecture.py fails
when this page and the code disagree): edit the docstrings, not this page.*

## The house: two services and the commands' loops

Every command composes at most two services; `train`, `eval` and `generate` write their own
loop, the three offline stages share one (`stages/common.py::train_batches`):

- **`Sampling`** (`posttrain/sampling/service.py`): the engine over the policy (built by the
  `rollout.ENGINES` registry in one place), the environment, the reward scorer, the prompts and
  the seed policy. `collect` samples and scores one batch now (`sample_and_score`, the one
  sample-then-score, with DAPO's refills); `next` / `sync` give a step's batch and hand the
  engine new weights, by a `BatchSource` (`InTurn`, or `Ahead` sampling while the trainer
  updates: two implementations of one protocol); `evaluate` runs the one held-out evaluator;
  `close` owns the engine's, sandbox's and environment's end.
- **`Learner`** (`posttrain/run/learner.py`): a model and what trains it: optimizer, schedule,
  the non-finite guard, the atomic checkpoint (save and restore) and the final save. `train`
  uses `PolicyLearner` (`posttrain/rl/learner.py`: with pi_ref, the teachers and PPO's value
  model); sft, dpo and reward-model use it as it is.
- **The loop** is written in the frame of `run/lifecycle.py::Steps` (budget, stop signals,
  checkpoint cadence), a context manager around a plain `for`. `train`'s, in
  `posttrain/rl/loop.py`:

```python
with Steps(run, cfg.steps, "train") as steps:
    for step in steps:
        with steps.timed(step):
            batch, metrics = sampling.next(step, timings, tallies)      # 1. sample and score
            batch, frozen = frozen_passes(learner, batch, timings)      # 2. pi_ref, teacher, pi_old
            batch, adv = compute_advantages(learner, batch)             # 3. advantages
            update = update_policy(learner, batch)                      # 4. clipped updates
            sampling.sync(step)                                         # 5. the engine's weights
        if steps.evaluation_due(step, cfg.eval_every): run_eval(run, step, ...)
        if steps.checkpoint_due(step):
            with steps.saving(step): checkpoint(run, step)
```

(`train_step` holds steps 1-5 and the log; the lines above are its shape.)

| command | Sampling | Learner | loop |
|---|---|---|---|
| `train` | `Sampling` with a batch source (`rl/job.py`) | `PolicyLearner` | `rl/loop.py::run_training` |
| `sft`, `dpo`, `reward-model` | held-out greedy answers of a synthetic task | `Learner` | their one loop, `stages/common.py::train_batches` |
| `eval`, `generate` | `open_sampling` | none | `stages/evaluate.py`, `stages/generate.py` |
| `serve` | `Sampling` without a scorer (`serve_model`, `stop_serving`) | none | the endpoint's requests (`stages/serve.py`) |
| `experiment NAME` | the `train` run's `Sampling` | its `PolicyLearner` | the experiment's own |

Adding a rollout engine: one module and its registration in `rollout.ENGINES`
(`posttrain/rollout/__init__.py`); an environment: a class with `reset`/`step` (or
`demonstration`) in `envs/`, and its name in the registry; an objective: one function
registered in `losses/` (`POLICY_LOSSES`, `ADVANTAGES`, ...).

## Layers

One folder per layer, lowest first; a module imports from its own folder and the folders below,
never above, with no cycle; a function has at most 50 lines and 6 parameters (options with
defaults, keyword-only, aside), a module at most 400 lines (`tests/test_layout.py`).
"""


def first_sentence(doc: str | None) -> str:
    """The docstring's first sentence, on one line ('' when there is none)."""
    text = " ".join((doc or "").split())
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return m.group(1) if m else text


def layers() -> list[tuple[int, str, str]]:
    """(layer, folder, its __init__'s description) for every subpackage, lowest layer first."""
    out = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        m = re.match(r"Layer (\d+)[:,]\s*(.*)", " ".join(doc.split()))
        out.append((int(m.group(1)), init.parent.name, first_sentence(m.group(2))))
    return sorted(out)


def modules(folder: str) -> list[tuple[str, str]]:
    """(module file, the first sentence of its docstring) in a folder, __init__ aside."""
    return [(f.name, first_sentence(ast.get_docstring(ast.parse(f.read_text()))))
            for f in sorted((PACKAGE / folder).glob("*.py")) if f.name != "__init__.py"]


def page() -> str:
    lines = [HOUSE]
    for layer, folder, what in layers():
        lines.append(f"### {layer}. `{folder}/`: {what}\n")
        lines += [f"- `{name}`: {about}" for name, about in modules(folder)]
        lines.append("")
    lines.append("### Entry point\n")
    lines.append(f"- `cli.py`: {first_sentence(ast.get_docstring(ast.parse((PACKAGE / 'cli.py').read_text())))}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(0 if PAGE.read_text() == page() else "docs/architecture.md is stale: run "
                 "python scripts/architecture.py")
    PAGE.write_text(page())
    print(f"wrote {PAGE.relative_to(ROOT)}")
