"""What the python tool's sandbox costs per call: bubblewrap, the fallback, and a plain
`python -I -c` subprocess (the tool before the sandbox), side by side in one run.

    .venv/bin/python benchmarks/sandbox_cost.py [--calls 30]

Prints the median and 90th percentile in milliseconds of `print(1)` and of a small computation
(sum of squares below 10^5) for each, and writes a JSON record (figures, command, commit,
versions, machine, date) under benchmarks/results/sandbox-cost-DATE/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from posttrain.sandbox.launch import Limits, bwrap_works  # noqa: E402
from posttrain.sandbox.run import run_python_code  # noqa: E402

PROGRAMS = {"print(1)": "print(1)", "sum of squares": "print(sum(i * i for i in range(10**5)))"}


def plain(code: str) -> None:
    """The python tool before the sandbox: python -I in a subprocess, output captured."""
    subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10,
                   env={"PATH": os.environ.get("PATH", "")})


def timed(fn, calls: int) -> dict[str, float]:
    fn()   # warm: page cache, bwrap's first start
    ms = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ms.append((time.perf_counter() - t0) * 1000)
    ms.sort()
    return {"median_ms": round(statistics.median(ms), 1), "p90_ms": round(ms[int(0.9 * len(ms)) - 1], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    modes = {"plain subprocess (before)": plain,
             "fallback": lambda c: run_python_code(c, Limits(), "fallback")}
    if bwrap_works():
        modes["bwrap"] = lambda c: run_python_code(c, Limits(), "bwrap")
    figures = {name: {prog: timed(lambda: fn(code), args.calls) for prog, code in PROGRAMS.items()}
               for name, fn in modes.items()}
    print(f"{'mode':28s}" + "".join(f"{p + ' (median / p90 ms)':>34s}" for p in PROGRAMS))
    for name, row in figures.items():
        print(f"{name:28s}" + "".join(f"{v['median_ms']:>25.1f} / {v['p90_ms']:<6.1f}" for v in row.values()))
    from posttrain.run.provenance import provenance
    record = {"figures": figures, "calls": args.calls,
              "bwrap": subprocess.run(["bwrap", "--version"], capture_output=True, text=True).stdout.strip()
              if bwrap_works() else None,
              "python": platform.python_version(), "root": os.geteuid() == 0,
              "date": time.strftime("%Y-%m-%d"),
              "provenance": provenance("python benchmarks/sandbox_cost.py " + " ".join(sys.argv[1:]))}
    out = ROOT / "benchmarks" / "results" / f"sandbox-cost-{record['date']}" / "sandbox_cost.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"record: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
