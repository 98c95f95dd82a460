"""`posttrain view`: its data answers on a tiny run, its server, and the page in a real headless
Chromium (Debian's package, driven by Playwright; .ci/run installs both)."""

import json
import math
import shutil
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from posttrain.cli import main
from posttrain.rl.loop import train
from posttrain.view.server import ViewError, Viewer, check_runs, run_names, serve
from tests.conftest import make_tiny_model
from tests.test_trainer import toy_config

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tokenizer):
    """Three GRPO steps on a tiny model, with held-out evaluations before, at step 2 and after."""
    out = tmp_path_factory.mktemp("view")
    cfg = toy_config(out, "--steps", "3", "--log_tokens", "8", "--optim.minibatches", "2",
                     "--optim.lr", "0.05", "--data.eval_size", "5", "--eval_every", "2")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    return out / "run"


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read()


def test_runs_are_checked_before_serving(tmp_path):
    with pytest.raises(ViewError, match="is not a folder"):
        check_runs([tmp_path / "missing"])
    with pytest.raises(ViewError, match="has no metrics.jsonl"):
        check_runs([tmp_path])
    assert main(["view", str(tmp_path / "missing")]) == 2
    assert run_names([Path("a/run"), Path("b/run"), Path("c/x")]) == ["a/run", "b/run", "x"]


def test_viewer_answers_from_the_run_folder(tiny_run):
    v = Viewer([tiny_run])
    assert [r["preset"] for r in v.answer("runs", {})] == ["grpo"]
    assert [r["step"] for r in v.answer("metrics", {"run": "0"}) if "reward/mean" in r] == [1, 2, 3]
    assert v.answer("steps", {"run": "0"}) == [1, 2, 3]
    rows = v.answer("rollouts", {"run": "0", "step": "2"})
    stored = pq.read_table(tiny_run / "tokens" / "step_000002.parquet").to_pylist()
    assert [r["adv"] for r in rows] == [r["adv"] for r in stored] and len(rows) == 8
    assert [e["label"] for e in v.answer("evals", {"run": "0"})] == ["before", "step 2", "after"]
    assert len(v.answer("evals", {"run": "0"})[0]["samples"]) == 5   # every held-out answer
    # a line being written when the page asks is skipped, not an error
    with open(tiny_run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "reward/me')
    try:
        assert len(v.answer("metrics", {"run": "0"})) == len(tiny_run.joinpath("metrics.jsonl").read_text().splitlines()) - 1
    finally:
        text = (tiny_run / "metrics.jsonl").read_text()
        (tiny_run / "metrics.jsonl").write_text(text[:text.rindex("\n") + 1])


def test_server_serves_the_page_its_assets_and_data_only(tiny_run):
    server = serve([tiny_run], port=0, background=True)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert b"posttrain view" in get(base + "/")
        assert len(get(base + "/vendor/uPlot.iife.min.js")) > 40_000      # from the package, no CDN
        assert json.loads(get(base + "/api/steps?run=0")) == [1, 2, 3]
        for bad in ("/../../pyproject.toml", "/api/nothing", "/api/rollouts?run=7&step=1"):
            with pytest.raises(urllib.error.HTTPError) as e:
                get(base + bad)
            assert e.value.code == 404
    finally:
        server.shutdown()


def test_a_request_for_another_host_is_refused(tiny_run):
    """DNS rebinding: a page on evil.example whose name now points at 127.0.0.1 sends
    `Host: evil.example:PORT`; the viewer refuses it, and still answers its own names."""
    server = serve([tiny_run], port=0, background=True)
    port = server.server_address[1]
    try:
        for host, code in ((f"evil.example:{port}", 403), (f"127.0.0.1:{port}", 200),
                           (f"localhost:{port}", 200), ("localhost:1", 403), ("", 403)):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/api/runs", headers={"Host": host})
            try:
                got = urllib.request.urlopen(request, timeout=10).status
            except urllib.error.HTTPError as e:
                got = e.code
            assert got == code, host
    finally:
        server.shutdown()


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium (scripts/install-cpu.sh installs it as root or with sudo; else apt-get install chromium)")
def test_page_in_a_real_browser(tiny_run, tmp_path):
    """Loads the page, switches the per-token quantity, filters, hovers a token, compares two
    evaluations; no error in the browser console."""
    import playwright.sync_api as playwright   # (the [test] extra: installed)
    stored = pq.read_table(tiny_run / "tokens" / "step_000003.parquet").to_pylist()
    server = serve([tiny_run, tiny_run], port=0, background=True)
    errors = []
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_selector("body[data-ready='1']", timeout=20_000)
            titles = page.locator(".chart h3").all_inner_texts()
            assert "rollout reward" in titles and "held-out accuracy" in titles
            assert page.locator(".chart").first.locator(".u-legend tr").count() == 3   # 2 runs overlaid

            page.click("nav button[data-tab=rollouts]")
            assert page.input_value("#r-step") == "3"
            assert page.locator(".card").count() == len(stored)
            first_updated = next(r for r in stored if r["updated"])
            token = page.locator(f".card[data-row='{first_updated['row']}'] .tok").first
            by_adv = token.evaluate("e => e.style.background")
            page.select_option("#r-quantity", "entropy")
            assert token.evaluate("e => e.style.background") != by_adv
            assert "entropy" in page.inner_text("#legend")
            token.hover()
            tip = page.inner_text("#tip")
            assert "adv" in tip and "ratio" in tip and f"{first_updated['adv'][0]:.4f}" in tip
            page.select_option("#r-filter", "correct")
            assert page.locator(".card").count() == sum(r["correct"] for r in stored)
            page.select_option("#r-filter", "wrong")
            assert page.locator(".card").count() == sum(not r["correct"] for r in stored)
            page.fill("#r-search", stored[0]["prompt"])
            assert page.locator(".card").count() == sum(
                r["prompt"] == stored[0]["prompt"] and not r["correct"] for r in stored)
            page.screenshot(path=str(tmp_path / "rollouts.png"))

            page.click("nav button[data-tab=evals]")
            assert page.locator("#e-table tr").count() == 1 + 5
            assert "before" in page.inner_text("#e-summary")

            # a run still writing: a new step appears on the next refresh, and the page, which
            # was on the newest step, follows it
            page.click("nav button[data-tab=rollouts]")
            page.select_option("#r-filter", "all")
            page.fill("#r-search", "")
            shutil.copyfile(tiny_run / "tokens" / "step_000003.parquet", tiny_run / "tokens" / "step_000004.parquet")
            page.evaluate("refreshNow()")
            page.wait_for_function("document.querySelector('#r-step').value === '4'", timeout=10_000)
            assert page.locator(".card").count() == len(stored)
            browser.close()
    finally:
        server.shutdown()
        (tiny_run / "tokens" / "step_000004.parquet").unlink(missing_ok=True)
    assert errors == []


def test_a_served_tinker_clients_folder_in_a_real_browser(tmp_path, tokenizer):
    """A training client's folder of `posttrain tinker-serve` (tinker/clients.py): its records
    carry no reward or verdict, and the page shows their tokens and numbers without either."""
    import playwright.sync_api as playwright
    import torch
    from posttrain.tinker.clients import ClientLogs
    from posttrain.tinker.models import TrainingRun
    from posttrain.tinker.wire import Datum, ForwardBackward
    ids = tokenizer("What is 2 + 3? 5")["input_ids"]
    n = len(ids) - 1
    d = Datum(ids[:-1], {"target_tokens": torch.tensor(ids[1:]), "logprobs": torch.full((n,), -1.0),
                         "advantages": torch.tensor([0.0] * (n - 2) + [1.0, 1.0])})
    run = TrainingRun("sess-1-x:train:0", {"rank": 4}, [], None)
    logs = ClientLogs(tmp_path, tokenizer)
    logs.log(run, "tiny", {"op": "forward_backward", "loss:sum": 1.5, "loss_fn": "ppo"})
    logs.record(run, "tiny", ForwardBackward(run.model_id, 1, "ppo", False, {}, [d]), [torch.full((n,), -0.5)])
    logs.close()
    folder = check_runs([tmp_path / "clients" / "sess-1-x_train_0"])[0]
    server = serve([folder], port=0, background=True)
    errors = []
    try:
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/")
            page.wait_for_selector("body[data-ready='1']", timeout=20_000)
            page.click("nav button[data-tab=rollouts]")
            assert page.locator(".card").count() == 1
            assert page.locator(".card .badge").count() == 0 and "reward" not in page.inner_text(".card .head")
            assert page.locator(".card .tok").count() == n
            assert page.locator(".card .tok.noloss").count() == n - 2
            page.locator(".card .tok").last.hover()
            tip = page.inner_text("#tip")
            assert f"{math.exp(0.5):.4f}" in tip and "logp_sampler" in tip   # ratio exp(-0.5 + 1)
            browser.close()
    finally:
        server.shutdown()
    assert errors == []
