"""The viewer's screenshots in docs/viewer.md, taken in headless Chromium (Debian's package,
driven by Playwright) on real run folders:

    .venv/bin/python benchmarks/viewer_screenshots.py --grpo RUN --opd RUN --ppo RUN [--out docs]

For each run: its rollouts tab with the wrong answers, coloured by the quantity that run's
algorithm puts credit on (GRPO: the advantage; OPD: the teacher's per-token reverse KL, sampled
or exact; PPO: the TD residual), the token under the mouse showing its numbers. For the GRPO run also its curves and
its held-out answers compared between the first and the last evaluation.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.view.server import check_runs, serve   # noqa: E402

ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# (the first of each list that the run recorded: OPD's exact loss records the exact KL)
QUANTITY = {"grpo": ["adv"], "opd": ["kl_teacher", "kl_teacher_exact"], "ppo": ["gae_delta"]}


def shoot(browser, run: Path, kind: str, out: Path) -> list[Path]:
    server = serve(check_runs([run]), port=0, background=True)
    shots = []
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 860})
        page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        page.wait_for_selector("body[data-ready='1']", timeout=60_000)
        if kind == "grpo":
            shots.append(out / "viewer-curves.png")
            page.screenshot(path=str(shots[-1]), full_page=True)
        page.click("nav button[data-tab=rollouts]")
        present = page.locator("#r-quantity option").evaluate_all("os => os.map(o => o.value)")
        page.select_option("#r-quantity", next(q for q in QUANTITY[kind] if q in present))
        page.select_option("#r-filter", "wrong")
        tokens = page.locator(".card .tok:not(.env)")
        if tokens.count():
            tokens.nth(min(3, tokens.count() - 1)).hover()
        shots.append(out / f"viewer-{kind}-tokens.png")
        page.screenshot(path=str(shots[-1]))
        if kind == "grpo":
            page.click("nav button[data-tab=evals]")
            page.check("#e-changed")
            shots.append(out / "viewer-evals.png")
            page.screenshot(path=str(shots[-1]))
        page.close()
    finally:
        server.shutdown()
    return shots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for kind in QUANTITY:
        ap.add_argument(f"--{kind}", type=Path, required=True, help=f"a {kind.upper()} run folder")
    ap.add_argument("--out", type=Path, default=Path("docs"))
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"), args=ARGS)
        for kind in QUANTITY:
            for shot in shoot(browser, getattr(args, kind), kind, args.out):
                print(shot)
        browser.close()


if __name__ == "__main__":
    main()
