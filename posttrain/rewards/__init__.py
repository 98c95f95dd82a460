"""Layer 6: rewards: verifiable checks, an optional format bonus, user functions and reward models, summed
per response (rewards/scorer.py), scored in the reward sandbox (rewards/pool.py, rewards/host.py).

The names below load on first use, so that the reward sandbox's own program imports
`rewards.host` and `rewards.verifiers` without torch (it runs under a memory limit)."""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {"Scorer": "posttrain.rewards.scorer", "RewardResult": "posttrain.rewards.scorer",
           "overlong_penalty": "posttrain.rewards.verifiers"}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'posttrain.rewards' has no attribute {name!r}")
