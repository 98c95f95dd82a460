"""A record's provenance: the commit from git, or from $POSTTRAIN_COMMIT where the code runs
without its .git folder; the GPU's name, or None without one."""

import torch

from posttrain.run import provenance as prov


def test_commit_from_git_in_a_checkout():
    assert len(prov.provenance("x")["commit"]) == 40


def test_commit_from_the_environment_without_git(monkeypatch):
    monkeypatch.setattr(prov, "_git", lambda *a: None)
    monkeypatch.setenv("POSTTRAIN_COMMIT", "abc123")
    record = prov.provenance("posttrain train")
    # without git nobody knows whether the copy was edited: null, never a clean False
    assert record["commit"] == "abc123" and record["dirty"] is None
    monkeypatch.delenv("POSTTRAIN_COMMIT")
    assert prov.provenance("posttrain train")["commit"] == ""


def test_machine_names_its_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prov.provenance("x")["machine"]["gpu"] is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert prov.provenance("x")["machine"]["gpu"] == "NVIDIA H200"


def test_dirty_reads_git_status_of_the_package(monkeypatch):
    monkeypatch.setattr(prov, "_git", lambda *a: " M posttrain/rl/loop.py" if a[0] == "status" else "c" * 40)
    assert prov.provenance("x")["dirty"] is True
    monkeypatch.setattr(prov, "_git", lambda *a: "" if a[0] == "status" else "c" * 40)
    assert prov.provenance("x")["dirty"] is False
