"""Bad input, fuzzed: hundreds of generated bad invocations and bad data files, each refused with
one line naming the field and what it accepts, exit code 2, no traceback, before any model
loads, and without leaving a run folder behind."""

from __future__ import annotations

import typing
from typing import Literal

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.cli import main
from posttrain.config.commands import StageConfig, TrainConfig
from posttrain.config.options import hint_path, option_names

_BOOL_WORDS = {"0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"}
_MODEL_FREE = {"model.path", "teacher.path", "critic.path", "reward.model"}   # (checked on disk)


def _typed_options(cls: type) -> list[tuple[str, typing.Any]]:
    """(option, hint) of every int / float / bool / choice field: the ones with a type to get wrong."""
    out = []
    for name in option_names(cls):
        hint = hint_path(cls, name)
        args = typing.get_args(hint)
        inner = [a for a in args if a is not type(None)] or [hint]
        base = inner[0] if len(inner) == 1 else None
        if base in (int, float, bool) or typing.get_origin(base) is Literal:
            out.append((name, hint))
    return out


TRAIN_OPTIONS = _typed_options(TrainConfig)
STAGE_OPTIONS = _typed_options(StageConfig)
# (command, the arguments it needs besides the bad one, its options)
COMMANDS = [("train", [], TRAIN_OPTIONS),
            ("eval", ["--model.path", "smollm2-135m-instruct"], TRAIN_OPTIONS),
            ("generate", ["--model.path", "smollm2-135m-instruct", "--out", "o.jsonl"], TRAIN_OPTIONS),
            ("sft", ["--data.synthetic", "addition"], STAGE_OPTIONS),
            ("dpo", ["--data.synthetic", "addition"], STAGE_OPTIONS),
            ("reward-model", ["--data.synthetic", "addition"], STAGE_OPTIONS)]


def _parses_as(text: str, hint: typing.Any) -> bool:
    """Would `text` be a valid value of `hint` on the command line (YAML scalar, then the type)?"""
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        value = text
    args = typing.get_args(hint)
    optional = type(None) in args
    if value is None or text.lower() in ("none", "null"):
        return optional
    base = [a for a in args if a is not type(None)][0] if optional else hint
    if typing.get_origin(base) is Literal:
        return value in typing.get_args(base) or text in typing.get_args(base)
    if base is bool:
        return isinstance(value, bool) or text.lower() in _BOOL_WORDS
    if isinstance(value, bool):
        return False
    try:
        number = float(text)
    except ValueError:
        return False
    return base is float or number.is_integer()


def bad_values(hint) -> st.SearchStrategy[str]:
    # (a word starting with '-' is a flag to any command line, `-h` the help: not a value)
    words = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_-.,:%", min_size=1, max_size=12).filter(
        lambda v: not v.startswith("-"))
    fractions = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False).filter(
        lambda x: not float(x).is_integer()).map(repr)
    return st.one_of(words, fractions, st.sampled_from(["[1, 2]", "{a: 1}", "", " "])).filter(
        lambda v: not _parses_as(v, hint))


@pytest.fixture
def no_models(monkeypatch):
    """Loading any model or tokenizer fails the test."""
    import transformers

    def boom(*a, **kw):
        raise AssertionError("a model or tokenizer was loaded for a refused invocation")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(boom))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)


REFUSED = {"invocations": 0}   # printed at the end of the run (conftest.py)


def _refused(argv: list[str], capsys, folder) -> str:
    capsys.readouterr()   # (what making the bad input printed)
    code = main(argv)
    out = capsys.readouterr()
    err = out.err.strip()
    assert code == 2, (argv, code, err)
    assert len(err.splitlines()) == 1 and err.startswith("posttrain: error: "), (argv, err)
    assert "Traceback" not in out.err + out.out
    assert not (folder / "runs").exists(), argv   # nothing left behind
    REFUSED["invocations"] += 1
    return err


@settings(max_examples=25, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])
@given(data=st.data())
def test_a_wrongly_typed_value_of_any_option_of_any_command(data, capsys, tmp_path_factory,
                                                            no_models, monkeypatch):
    folder = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(folder)
    command, needed, options = data.draw(st.sampled_from(COMMANDS), label="command")
    name, hint = data.draw(st.sampled_from(options), label="option")
    value = data.draw(bad_values(hint), label="value")
    err = _refused([command, *needed, f"--{name}", value], capsys, folder)
    assert name in err, err
    assert any(w in err for w in ("must be", "is not valid", "accepted")), err


# ---- bad files and names, each named in the one line ---------------------------------------

def _write(folder, name: str, text: str | bytes) -> str:
    path = folder / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def _dataset_dict_without_train(folder) -> str:
    import datasets
    path = folder / "splits"
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}])}
                         ).save_to_disk(str(path))
    return str(path)


FILE_CASES = {
    # name: (argv builder given a folder, words the message must contain)
    "broken yaml": (lambda f: ["train", "--config", _write(f, "c.yaml", "optim: [1, 2\n")], ["c.yaml", "YAML"]),
    "yaml list": (lambda f: ["sft", "--config", _write(f, "c.yaml", "- 1\n- 2\n")], ["c.yaml", "mapping"]),
    "yaml unknown field": (lambda f: ["train", "--config", _write(f, "c.yaml", "optim:\n  lrr: 1\n")],
                           ["optim.lrr", "did you mean lr"]),
    "yaml wrong type": (lambda f: ["dpo", "--config", _write(f, "c.yaml", "beta: high\n")], ["beta", "number"]),
    "yaml unknown preset": (lambda f: ["train", "--config", _write(f, "c.yaml", "preset: ppo3\n")], ["preset", "accepted"]),
    "missing config": (lambda f: ["reward-model", "--config", str(f / "none.yaml")], ["none.yaml", "does not exist"]),
    "broken jsonl": (lambda f: ["train", "--data.task", "file", "--data.train_path",
                                _write(f, "d.jsonl", '{"prompt": "a", "answer": "1"}\n{"prompt": \n')],
                     ["d.jsonl"]),
    "empty jsonl": (lambda f: ["train", "--data.task", "file", "--data.train_path", _write(f, "d.jsonl", "")],
                    ["d.jsonl"]),
    "jsonl without answer": (lambda f: ["train", "--data.task", "file", "--data.train_path",
                                        _write(f, "d.jsonl", '{"prompt": "a"}\n')], ["d.jsonl", "answer"]),
    "jsonl empty prompt": (lambda f: ["train", "--data.task", "file", "--data.train_path",
                                      _write(f, "d.jsonl", '{"prompt": " ", "answer": "1"}\n')], ["prompt", "empty"]),
    "broken parquet": (lambda f: ["train", "--data.task", "file", "--data.train_path",
                                  _write(f, "d.parquet", b"PAR1 this is not parquet")], ["d.parquet"]),
    "unknown format": (lambda f: ["train", "--data.task", "file", "--data.train_path",
                                  _write(f, "d.xlsx", "x")], ["d.xlsx", "format"]),
    "missing data": (lambda f: ["train", "--data.task", "file", "--data.train_path", str(f / "no.jsonl")],
                     ["no.jsonl", "does not exist"]),
    "splits without train": (lambda f: ["train", "--data.task", "file", "--data.train_path",
                                        _dataset_dict_without_train(f)], ["splits", "train"]),
    "sft rows without response": (lambda f: ["sft", "--data.train_path", _write(f, "s.jsonl", '{"prompt": "a"}\n')],
                                  ["s.jsonl", "response"]),
    "dpo rows without rejected": (lambda f: ["dpo", "--data.train_path",
                                             _write(f, "p.jsonl", '{"prompt": "a", "chosen": "b"}\n')],
                                  ["p.jsonl", "rejected"]),
    "sft broken csv": (lambda f: ["sft", "--data.train_path", _write(f, "s.csv", 'prompt,response\n"a,b\n')],
                       ["s.csv"]),
    "unknown task": (lambda f: ["train", "--data.task", "sudoku"], ["data.task", "known"]),
    "unknown reward module": (lambda f: ["train", "--reward.functions", "no_such_mod_xyz:f"],
                              ["no_such_mod_xyz", "cannot import"]),
    "reward without colon": (lambda f: ["train", "--reward.functions", "justaname"], ["module:function"]),
    "reward missing function": (lambda f: ["train", "--reward.functions", "tests.toy_rewards:nope"],
                                ["nope"]),
    "missing model folder": (lambda f: ["train", "--model.path", str(f / "nomodel")], ["nomodel"]),
    "model folder without config": (lambda f: ["sft", "--data.synthetic", "addition", "--model.path",
                                               str((f / "empty").mkdir() or f / "empty")], ["empty"]),
    "missing teacher": (lambda f: ["train", "--preset", "opd", "--teacher.path", str(f / "t")],
                        ["teacher.path", "model folder"]),
    "missing domain teacher": (lambda f: ["train", "--preset", "opd", "--data.task", "addition+countdown",
                                          "--teacher.domains.addition", str(f / "a"),
                                          "--teacher.domains.countdown", "smollm2-135m-instruct"],
                               ["teacher.domains.addition", "model folder"]),
    "missing reward model": (lambda f: ["train", "--reward.model", str(f / "rm")], ["reward.model"]),
    "resume nothing": (lambda f: ["train", "--resume", str(f / "old")], ["old"]),
    "stage resume nothing": (lambda f: ["dpo", "--resume", str(f / "old")], ["old"]),
    "eval unknown task": (lambda f: ["eval", "--model.path", "smollm2-135m-instruct", "--data.task", "chess"],
                          ["chess"]),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_bad_files_and_names_are_refused_in_one_line(case, capsys, tmp_path, monkeypatch, no_models):
    monkeypatch.chdir(tmp_path)
    build, words = FILE_CASES[case]
    err = _refused(build(tmp_path), capsys, tmp_path)
    assert all(w in err for w in words), err
