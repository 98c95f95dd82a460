"""What a measurement's record needs to be checked later: the command, the commit, the packages,
the machine and the date (benchmarks/ and `posttrain experiment` write it into every record)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):   # an installed package, no git: no commit
        return ""


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor())


def provenance(command: str) -> dict:
    """The command, the commit (and whether the package or the benchmarks had uncommitted
    changes), the packages' versions, the machine and the date (UTC)."""
    return {
        "command": command,
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--",
                           "posttrain", "benchmarks", "pyproject.toml")),
        "versions": {name: importlib.metadata.version(name)
                     for name in ("posttrain", "torch", "transformers")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": _cpu_model()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
