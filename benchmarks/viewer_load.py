"""The viewer's costs: disk per step of the per-token records, and the page's load time on a
1,000-step run, in headless Chromium (Debian's package, driven by Playwright).

    .venv/bin/python benchmarks/viewer_load.py RUN [--steps 1000] [--out benchmarks/results/viewer-DATE]

RUN is a real run folder (its tokens/*.parquet and metrics.jsonl). The 1,000-step run is built from
it: its step records and metric rows repeated, renumbered, up to --steps (the same bytes a step as
the real run; written to a temporary folder). Measured: the real run's bytes a step, the 1,000-step
run's folder size, the time until the page has drawn every chart and the newest step's rollouts
(median of 5 loads), and the time to switch to another step. Prints the figures and writes
viewer.json (figures, command, provenance).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.run.provenance import provenance   # noqa: E402
from posttrain.view.server import serve, token_steps   # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def long_run(real: Path, steps: int, out: Path) -> Path:
    """`real`'s records and metric rows repeated and renumbered to `steps` steps."""
    run = out / "run-1000"
    (run / "tokens").mkdir(parents=True)
    files = sorted((real / "tokens").glob("step_*.parquet"))
    rows = [json.loads(x) for x in (real / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if "reward/mean" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    with open(run / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({**train[(s - 1) % len(train)], "step": s}) + "\n")
            if s % 50 == 0 and evals:
                f.write(json.dumps({**evals[-1], "step": s}) + "\n")
    for s in range(1, steps + 1):
        shutil.copyfile(files[(s - 1) % len(files)], run / "tokens" / f"step_{s:06d}.parquet")
    for name in ("config.json", "eval_samples.jsonl"):
        if (real / name).is_file():
            shutil.copyfile(real / name, run / name)
    return run


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def page_times(run: Path, loads: int) -> dict:
    from playwright.sync_api import sync_playwright
    server = serve([run], port=0, background=True)
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    ready, switch = [], []
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
            for _ in range(loads):
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                t0 = time.perf_counter()
                page.goto(url)
                page.wait_for_selector("body[data-ready='1']", timeout=60_000)
                ready.append(time.perf_counter() - t0)
                page.click("nav button[data-tab=rollouts]")
                t0 = time.perf_counter()
                page.click("#r-prev")
                page.wait_for_function("document.querySelector('#r-step').value !== '%d'"
                                       % token_steps(run)[-1])
                page.wait_for_selector(".card")
                switch.append(time.perf_counter() - t0)
                page.close()
            browser.close()
    finally:
        server.shutdown()
    return {"page_ready_s": statistics.median(ready), "page_ready_s_all": ready,
            "step_switch_s": statistics.median(switch), "step_switch_s_all": switch}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--loads", type=int, default=5)
    ap.add_argument("--out", type=Path, help="folder for viewer.json")
    args = ap.parse_args()
    real = args.run
    files = sorted((real / "tokens").glob("step_*.parquet"))
    if not files:
        sys.exit(f"{real}: no tokens/step_*.parquet (a run made with log_tokens > 0)")
    per_step = statistics.mean(f.stat().st_size for f in files)
    import pyarrow.parquet as pq
    rows_per_step = statistics.mean(pq.read_metadata(f).num_rows for f in files)
    with tempfile.TemporaryDirectory() as tmp:
        run = long_run(real, args.steps, Path(tmp))
        figures = {"run": str(real), "real_steps": len(files),
                   "responses_per_step": rows_per_step, "bytes_per_step": per_step,
                   "steps": args.steps, "tokens_folder_bytes": folder_bytes(run / "tokens"),
                   "metrics_bytes": (run / "metrics.jsonl").stat().st_size,
                   **page_times(run, args.loads)}
    for k, v in figures.items():
        if not k.endswith("_all"):
            print(f"{k:22} {v}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"benchmark": "viewer_load", "figures": figures,
                  "provenance": provenance(" ".join([".venv/bin/python", *sys.argv]))}
        (args.out / "viewer.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"record: {args.out / 'viewer.json'}")


if __name__ == "__main__":
    main()
