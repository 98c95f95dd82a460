"""What a measurement's record needs to be checked later: the command, the commit, the packages,
the machine and the date (benchmarks/ and `posttrain experiment` write it into every record)."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the checkout (this file: posttrain/run/provenance.py)


def _git(*args: str) -> str | None:
    """git's output in this tree; None where git cannot say (no git, not a checkout)."""
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):   # an installed package, no git: no commit
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _dirty() -> bool | None:
    """Uncommitted changes to the package or the benchmarks' code (not their results, which a
    record run over an earlier one rewrites); None when unknown (no checkout)."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", "posttrain", "benchmarks",
                  "pyproject.toml", ":(exclude)benchmarks/results")
    return None if status is None else bool(status)


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor())


def _cpu_features() -> list[str]:
    """The vector instruction sets that decide CPU speed here (AVX-512 and its bf16, AMX): two
    machines both named "AMD EPYC" can differ 80x on a bf16 matmul (util/perf.native_bf16)."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16"))


def _gpu() -> str | None:
    """The first CUDA device's name, or None on a machine without one."""
    import torch     # here, not at the top: reading a record's provenance needs no torch
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def provenance(command: str) -> dict:
    """The command, the commit (and whether the package or the benchmarks had uncommitted
    changes: null when that is unknown), the packages' versions, the machine (its GPU too) and the date (UTC). A copy of the
    code without its .git folder (a container, a remote machine) names its commit in
    $POSTTRAIN_COMMIT."""
    return {
        "command": command,
        "commit": _git("rev-parse", "HEAD") or os.environ.get("POSTTRAIN_COMMIT", ""),
        "dirty": _dirty(),
        "versions": {name: importlib.metadata.version(name)
                     for name in ("posttrain", "torch", "transformers")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "cpu": _cpu_model(),
                    "cpu_features": _cpu_features(), "gpu": _gpu()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
