"""The docs' result tables are what their committed records render (benchmarks/tables.py)."""

import json
from pathlib import Path

import pytest

from tests.conftest import benchmark_module

ROOT = Path(__file__).resolve().parent.parent


def _tables():
    return benchmark_module("tables")


def linked_results(tmp_path: Path) -> None:
    """tmp_path/benchmarks/results: a link to each committed entry (copying the 45 MB tree cost
    2.5 s a test); a test edits a record with `rewrite`, which makes the folders on its path
    real and replaces the record's link with a file."""
    src, dst = ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results"
    dst.mkdir(parents=True)
    for entry in src.iterdir():
        (dst / entry.name).symlink_to(entry)


def rewrite(path: Path, text: str) -> None:
    """Write a record of the linked tree, never through a link into the committed records."""
    results = next(p for p in path.parents if p.name == "results" and p.parent.name == "benchmarks")
    here = results
    for part in path.relative_to(results).parts:
        here = here / part
        if here.is_symlink():
            target = here.resolve()
            here.unlink()
            if target.is_dir():
                here.mkdir()
                for entry in target.iterdir():
                    (here / entry.name).symlink_to(entry)
    assert not path.is_symlink() and path.resolve().is_relative_to(results.resolve())
    path.write_text(text)


def test_every_docs_table_is_what_its_records_render():
    tables = _tables()
    found = set()
    for page in tables.pages(ROOT):
        text = page.read_text()
        assert not tables.marker_problems(text), (page.relative_to(ROOT), tables.marker_problems(text))
        found |= {m["name"] for m in tables.BLOCK.finditer(text)}
        assert tables.render_page(text, ROOT) == text, (
            f"{page.relative_to(ROOT)}: a table differs from its records; run "
            ".venv/bin/python benchmarks/tables.py")
    assert found == set(tables.TABLES)   # every renderer's table is somewhere in the docs


@pytest.mark.parametrize("name, record", [
    ("default", "default-2026-12-07/posttrain-s1/bench.json"),
    ("presets", "presets-2026-12-02/ppo/posttrain-s2/bench.json"),
    ("opd", "opd-2026-12-04/posttrain-s0/bench.json"),
    ("opsd", "opsd-2026-12-04/posttrain-s2/bench.json"),
    ("lora", "lora-2026-12-04/posttrain-s0/bench.json"),
    ("gpu", "gpu-h200-2026-12-04/default/posttrain-s0/bench.json"),
    ("ppo-rlhf", "ppo-recipe-2026-12-04/posttrain-s0/bench.json"),
    ("objectives", "objectives-2026-12-03/gspo/posttrain-s0/bench.json"),
    ("perstep", "perstep-2026-12-07/trl-s0.json"),
    ("async-cpu", "async-cpu-2026-12-05/k1-split/posttrain-s0/bench.json"),
])
def test_an_edited_record_changes_its_table(tmp_path, name, record):
    """The table is read from the records, not written by hand: a record's last held-out
    reading set to 12.3% shows up in its table."""
    tables = _tables()
    linked_results(tmp_path)
    before = tables.TABLES[name](tmp_path)
    path = tmp_path / "benchmarks" / "results" / record
    run = json.loads(path.read_text())
    run["eval_accuracy"][-1] = 0.123
    rewrite(path, json.dumps(run))
    after = tables.TABLES[name](tmp_path)
    assert after != before and "12.3" in after and "12.3" not in before


@pytest.mark.parametrize("name, record, edit", [
    ("lecture-baselines", "baselines.json", lambda n: n["arms"]["group_mean"].update(scale=0.123)),
    ("lecture-is", "importance-sampling.json", lambda n: n["arms"]["clipped"][16].update(ratio_sd=0.123)),
    ("lecture-kl", "kl-estimators.json", lambda n: n["drifts"]["0.08"]["estimators"]["k3"].update(
        coef_forward=0.123)),
])
def test_an_edited_experiment_record_changes_its_table(tmp_path, name, record, edit):
    """The lecture experiments' tables are read from `posttrain experiment`'s records too."""
    tables = _tables()
    linked_results(tmp_path)
    before = tables.TABLES[name](tmp_path)
    path = tmp_path / tables.LECTURE / record
    data = json.loads(path.read_text())
    edit(data["numbers"])
    rewrite(path, json.dumps(data))
    after = tables.TABLES[name](tmp_path)
    assert after != before and "0.12" in after and "0.123" not in before


def test_the_dpo_table_reads_its_record(tmp_path):
    tables = _tables()
    linked_results(tmp_path)
    path = tmp_path / tables.DPO / "record.json"
    rec = json.loads(path.read_text())
    rec["summary"]["behaviour_after"]["behaviour/accuracy"] = 0.123
    rec["summary"]["eval_after"]["dpo/eval_reward_accuracy@correct>wrong"] = 0.5
    rewrite(path, json.dumps(rec))
    text = tables.TABLES["dpo"](tmp_path)
    assert "**12.3%**" in text and "correct>wrong 50%" in text


def test_the_reward_model_rows_read_their_records(tmp_path):
    tables = _tables()
    linked_results(tmp_path)
    path = tmp_path / tables.REWARD_MODELS / "log_ratio" / "record.json"
    rec = json.loads(path.read_text())
    rec["summary"]["eval_after"]["rm/eval_accuracy@correct>wrong"] = 0.123
    rewrite(path, json.dumps(rec))
    assert "(correct > wrong 12%)" in tables.TABLES["ppo-rlhf"](tmp_path)


def test_the_gpu_check_table_reads_its_record(tmp_path):
    """benchmarks/gpu_check.py's rows come from gpu_check.json: an edited step time and an
    unfinished run show up as such; a run measured in another record (gpu_check_lora.json) is
    shown from that record."""
    tables = _tables()
    linked_results(tmp_path)
    path = tmp_path / tables.GPU / "gpu_check.json"
    check = json.loads(path.read_text())
    check["runs"][0]["step_s"] = 12.34
    check["runs"][1] = {"name": "ppo", "error": "out of memory"}
    rewrite(path, json.dumps(check))
    text = tables.TABLES["gpu"](tmp_path)
    assert "| GRPO | 12.3 |" in text and "not measured: out of memory" in text
    check["runs"][2] = {"name": "lora", "error": "time limit"}
    rewrite(path, json.dumps(check))
    text = tables.TABLES["gpu"](tmp_path)
    assert "time limit" not in text and "| GRPO with LoRA r16 and a KL (reference = adapters off) | 10.6 |" in text


def test_spread_is_over_the_seeds_that_have_a_value():
    spread = _tables().spread
    assert spread([1.0, 2.0, 3.0], signed=False) == "2.00 ± 1.00"
    assert spread([1.0, None, 2.0], signed=False, unit="%") == "1.50 ± 0.71% (2 of 3 seeds)"
    assert spread([None, None]) == "-"


def test_an_edited_viewer_record_changes_its_table(tmp_path):
    tables = _tables()
    linked_results(tmp_path)
    before = tables.TABLES["viewer"](tmp_path)
    path = tmp_path / tables.VIEWER / "viewer.json"
    record = json.loads(path.read_text())
    record["figures"]["page_ready_s"] = 12.3
    rewrite(path, json.dumps(record))
    after = tables.TABLES["viewer"](tmp_path)
    assert "12.30 s" in after and "12.30 s" not in before


@pytest.mark.parametrize("name, experiment, edit, shown", [
    ("lecture-length", "length-bias",
     lambda n: n["arms"]["grpo"].update(weight_length_slope=0.777), "+0.78"),
    ("lecture-clip-higher", "clip-higher",
     lambda n: n["arms"]["symmetric"].update(eval_after=0.777), "77.7 ± 0.0"),
    ("lecture-clip-higher", "clip-higher",   # CISPO clips no gradient: its capped weights are shown
     lambda n: n["arms"]["cispo"].update(weight_capped_mean=0.00777), "0.78 ± 0.00% capped, kept"),
    ("lecture-dynamic", "dynamic-sampling",
     lambda n: n["arms"]["on"].update(eval_after=0.777), "77.7 ± 0.0"),
    ("lecture-opd", "opd-vs-grpo",
     lambda n: n["arms"]["opd"]["eval_accuracy"].__setitem__(1, 0.777), "77.7 ± 0.0%"),
    ("lecture-hacking", "reward-hacking",
     lambda n: n["arms"]["policy"].update(accuracy_peak_step=777), "(777)"),
])
def test_an_edited_seed_record_changes_its_table(tmp_path, name, experiment, edit, shown):
    """The experiments run once a seed (`--seed S`); their tables read every seed's record."""
    tables = _tables()
    linked_results(tmp_path)
    before = tables.TABLES[name](tmp_path)
    paths = [tmp_path / tables.LECTURE / f"{experiment}-s{seed}" / f"{experiment}.json"
             for seed in tables.SEEDS]
    assert paths[0].exists()
    for path in (p for p in paths if p.exists()):   # every seed on record
        data = json.loads(path.read_text())
        edit(data["numbers"])
        rewrite(path, json.dumps(data))
    after = tables.TABLES[name](tmp_path)
    assert shown in after and shown not in before


@pytest.mark.parametrize("name, folder, run", [("guess-number", "ENVIRONMENTS", "guess-number"),
                                               ("chain-sum", "ENVIRONMENTS", "chain-sum"),
                                               ("rlhf", "RLHF", "ppo-terse")])
def test_a_run_table_reads_its_metrics(tmp_path, name, folder, run):
    """The environments' and RLHF's tables come from their runs' metrics.jsonl: the last
    evaluation set to 12.3% shows up as 12%."""
    tables = _tables()
    linked_results(tmp_path)
    path = tmp_path / getattr(tables, folder) / run / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    before = tables.TABLES[name](tmp_path)
    rows[-1]["eval/accuracy"] = 0.123
    rewrite(path, "".join(json.dumps(r) + "\n" for r in rows))
    after = tables.TABLES[name](tmp_path)
    shown = ("12%", "12.3%")
    assert any(x in after for x in shown) and not any(x in before for x in shown)


def test_the_mopd_table_reads_each_domain(tmp_path):
    """MOPD's rows are per domain from the runs' metrics.jsonl: the last subtraction reading of the
    run from the base model set to 12.3% shows up as 12%."""
    tables = _tables()
    linked_results(tmp_path)
    path = tmp_path / tables.MOPD / "mopd" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    before = tables.TABLES["mopd"](tmp_path)
    rows[-1]["eval/accuracy@subtraction"] = 0.123
    rewrite(path, "".join(json.dumps(r) + "\n" for r in rows))
    after = tables.TABLES["mopd"](tmp_path)
    assert "| MOPD, step 48 | 82% | 12% |" in after and "12%" not in before


def test_an_unpaired_table_marker_is_named():
    """A table whose closing marker is lost would swallow the next table's opening marker (and a
    table rendered on two pages could hide it from the first test's set of names)."""
    problems = _tables().marker_problems
    good = "<!-- table: a -->\nx\n<!-- /table -->\n<!-- table: b -->\ny\n<!-- /table -->\n"
    assert problems(good) == []
    assert problems(good.replace("x\n<!-- /table -->", "x\n")) == [
        "table 'a' is not closed before table 'b'"]
    assert problems(good.replace("<!-- table: b -->\n", "")) == [
        "'<!-- /table -->' without its '<!-- table: NAME -->'"]
    assert problems(good + "<!-- table: c -->\n") == ["table 'c' is never closed"]


def test_every_table_says_where_its_records_come_from():
    """Under every table: how many records it reads, their commits, and, record by record, which
    ran from a tree with uncommitted changes or carry no provenance (counted from the records
    themselves, so a page never calls a figure clean that is not)."""
    tables = _tables()
    for page in tables.pages(ROOT):
        text = page.read_text()
        for m in tables.BLOCK.finditer(text):
            with tables.reads() as seen:
                tables.TABLES[m["name"]](ROOT)
            line = tables.provenance_line(seen)
            assert line in m.group(0), (page.name, m["name"], line)
            records = [p for p in dict.fromkeys(seen) if p.suffix == ".json" and p.is_file()
                       and tables.is_record(p, json.loads(p.read_text()))]
            missing = [p for p in records if not json.loads(p.read_text()).get("provenance")]
            assert records, (m["name"], "reads no record")
            assert (f"{len(missing)} without provenance" in line) == bool(missing), m["name"]


def test_the_provenance_line_counts_clean_dirty_unknown_and_missing(tmp_path):
    tables = _tables()
    made = []
    for name, prov in (("a", {"commit": "1" * 40, "dirty": False}),
                       ("b", {"commit": "2" * 40, "dirty": True}),
                       ("c", {"commit": "2" * 40, "dirty": None}), ("d", None)):
        (tmp_path / name).mkdir()
        made.append(tmp_path / name / "bench.json")
        made[-1].write_text(json.dumps({"steps": [1], **({"provenance": prov} if prov else {})}))
    (tmp_path / "meta.json").write_text(json.dumps({"overrides": []}))   # not a record
    line = tables.provenance_line([*made, tmp_path / "meta.json"])
    assert line == ("Provenance: 4 records, commits `1111111`, `2222222`; 1 run from a tree with "
                    "uncommitted changes; 1 from a tree not known to be clean; 1 without "
                    "provenance (written before records carried it).")
    assert tables.provenance_line(made[:1]).endswith("every one run from a clean tree.")


def test_a_clean_flag_written_while_it_could_not_see_edits_is_not_called_clean(tmp_path):
    """From 2026-12-05 11:06 to 2026-12-06 22:29 UTC provenance ran git in the package folder and
    wrote `dirty: false` for any tree: a table over such records does not say they were clean."""
    tables = benchmark_module("tables")

    def record(name: str, date: str, dirty) -> Path:
        path = tmp_path / name / "record.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"provenance": {"commit": "a" * 40, "dirty": dirty, "date": date}}))
        return path
    before = record("before", "2026-12-05T10:00:00+00:00", False)
    blind = record("blind", "2026-12-06T20:40:38+00:00", False)
    after = record("after", "2026-12-06T23:00:00+00:00", False)
    edited = record("edited", "2026-12-06T12:00:00+00:00", True)
    assert tables.provenance_line([before, after]).endswith("every one run from a clean tree.")
    line = tables.provenance_line([before, blind, after, edited])
    assert "1 run from a tree with uncommitted changes" in line
    assert "1 marked clean while that flag could not see edits" in line and "every one" not in line
