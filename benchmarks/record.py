"""Run one posttrain command and keep its record beside its figures.

    .venv/bin/python benchmarks/record.py OUT -- posttrain dpo --data.synthetic addition ...
    .venv/bin/python benchmarks/record.py OUT --keep-weights -- posttrain train --config ...

A command with a run folder (train, sft, dpo, reward-model) runs with `--run_dir OUT/run` unless it
names its own; every command runs with `--no-progress`. OUT gets
record.json (the command, its provenance taken before it started: commit, packages, machine,
date; the wall seconds, the peak resident memory, the exit code and the run folder's
summary.json) and copies of the run's summary.json and metrics.jsonl; the run's weights
(final_model, checkpoints, PPO's final_value_model and reference_model) are deleted unless
--keep-weights, so OUT can be committed under
benchmarks/results/. The log goes to OUT/run.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from posttrain.run.provenance import provenance  # noqa: E402

KEPT = ("summary.json", "metrics.jsonl")
RUN_FOLDER = {"train", "sft", "dpo", "reward-model", "eval", "generate"}   # those that write a run folder
WEIGHTS = ("final_model", "checkpoints", "final_value_model", "reference_model")   # PPO keeps the last two


def with_run_dir(command: list[str], out: Path) -> tuple[list[str], Path | None]:
    """The command with `--run_dir OUT/run` added where it writes a run folder and names none,
    and that folder (None for a command without one, or `--run_dir none`)."""
    if command[1] not in RUN_FOLDER:
        return command, None
    if "--run_dir" in command:
        given = command[command.index("--run_dir") + 1]
        return command, None if given.lower() == "none" else Path(given)
    return [*command, "--run_dir", str(out / "run")], out / "run"


def write_record(out: Path, command: list[str], prov: dict, wall_s: float, peak_rss_gb: float,
                 returncode: int, run_dir: Path | None, keep_weights: bool = False) -> Path:
    """OUT/record.json and the run's kept files; the run's weights deleted unless kept."""
    summary = run_dir / "summary.json" if run_dir else None
    record = {"command": " ".join(command), "provenance": prov, "wall_s": round(wall_s, 1),
              "peak_rss_gb": round(peak_rss_gb, 2), "returncode": returncode,
              "summary": json.loads(summary.read_text()) if summary and summary.is_file() else None}
    for name in KEPT if run_dir and run_dir != out else ():
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, out / name)
    for name in WEIGHTS if run_dir and not keep_weights else ():
        shutil.rmtree(run_dir / name, ignore_errors=True)
    path = out / "record.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--keep-weights", action="store_true")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- posttrain SUBCOMMAND ...")
    args = ap.parse_args()
    command = args.command
    if command[:1] == ["--keep-weights"]:   # REMAINDER takes options written after OUT
        args.keep_weights, command = True, command[1:]
    command = command[1:] if command[:1] == ["--"] else command
    if command[:1] != ["posttrain"] or len(command) < 2:
        ap.error(f"the command must start with 'posttrain SUBCOMMAND', got {' '.join(command)!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    command, run_dir = with_run_dir(command, args.out)
    if "--no-progress" not in command:
        command.append("--no-progress")
    prov = provenance(" ".join(command))       # before the run: the code it ran with
    t0 = time.time()
    with open(args.out / "run.log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", *command[1:]], stdout=log,
                                stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)      # this command's own peak RSS (KiB on Linux)
    code = os.waitstatus_to_exitcode(status)
    path = write_record(args.out, command, prov, time.time() - t0, usage.ru_maxrss / 2**20, code,
                        run_dir, args.keep_weights)
    print(f"{path}: exit {code}, {(time.time() - t0) / 60:.1f} min")
    sys.exit(code)


if __name__ == "__main__":
    main()
