"""Built-in tasks (held-out split disjoint from training) and user files."""

import json

import pytest

from posttrain.data import load_problems, make_task
from posttrain.data.tasks import eval_arithmetic, has_carry


def test_addition_eval_is_fixed_and_disjoint_from_training():
    task = make_task("addition", 2)
    task.build_eval(200, 1234)
    again = make_task("addition", 2)
    again.build_eval(200, 1234)
    assert [p.prompt for p in task.eval_problems] == [p.prompt for p in again.eval_problems]
    assert len({p.prompt for p in task.eval_problems}) == 200
    held_out = {p.prompt for p in task.eval_problems}
    train = [task.train_problem(0, i) for i in range(3000)]
    assert not held_out & {p.prompt for p in train}
    for p in train[:50]:
        a, b = p.meta["a"], p.meta["b"]
        assert 10 <= a <= 99 and 10 <= b <= 99 and p.answer == str(a + b)
    assert task.train_problem(0, 17) == task.train_problem(0, 17)   # resumable by index


def test_carry_and_arithmetic_helpers():
    assert has_carry(45, 81) and not has_carry(23, 45) and has_carry(19, 1)
    assert eval_arithmetic("(2 + 3) * 4 - 6 / 3") == 18
    with pytest.raises(ValueError):
        eval_arithmetic("__import__('os').system('x')")
    task = make_task("arithmetic", 1)
    p = task.train_problem(0, 0)
    assert eval_arithmetic(p.prompt[len("What is "):-1]) == int(p.answer)


def test_unknown_task_lists_known_ones():
    with pytest.raises(KeyError, match="known: \\['addition', 'arithmetic', 'countdown', 'guess_number', 'multiplication', 'subtraction'\\]"):
        make_task("nope", 1)


def test_subtraction_problems_are_non_negative_and_flag_borrows():
    task = make_task("subtraction", 2)
    problems = [task.train_problem(0, i) for i in range(200)]
    for p in problems:
        a, b = p.meta["a"], p.meta["b"]
        assert p.prompt == f"What is {a} - {b}?" and int(p.answer) == a - b >= 0
        assert p.meta["borrow"] == (a % 10 < b % 10 or (a // 10) % 10 < (b // 10) % 10)
    assert {p.meta["borrow"] for p in problems} == {True, False}


def test_a_mixture_takes_a_difficulty_per_task():
    from posttrain.config.commands import ConfigError
    from posttrain.config.options import load_config
    from posttrain.data.source import build_task
    task = build_task(load_config(None, ["--data.task", "addition+arithmetic:1",
                                         "--data.eval_size", "10"]).data)
    by_domain = {d: [p for p in task.eval_problems if p.domain == d]
                 for d in ("addition", "arithmetic")}
    assert len(by_domain["addition"]) == 5 and len(by_domain["arithmetic"]) == 5
    assert all(len(p.prompt.split()[2]) == 2 for p in by_domain["addition"])       # 2 digits
    assert all(len(p.prompt.split()[2]) == 1 for p in by_domain["arithmetic"])     # 1 digit
    with pytest.raises(ConfigError, match="NAME:DIFFICULTY"):
        build_task(load_config(None, ["--data.task", "addition:two"]).data)


def test_jsonl_csv_parquet_files(tmp_path):
    rows = [{"question": f"q{i}", "solution": str(i), "domain": "math"} for i in range(5)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows))
    probs = load_problems(jl, "question", "solution")
    assert [p.answer for p in probs] == ["0", "1", "2", "3", "4"] and probs[0].domain == "math"
    import pandas as pd
    pd.DataFrame(rows).to_csv(tmp_path / "d.csv", index=False)
    pd.DataFrame(rows).to_parquet(tmp_path / "d.parquet")
    assert load_problems(tmp_path / "d.csv", "question", "solution")[2].prompt == "q2"
    assert load_problems(tmp_path / "d.parquet", "question", "solution")[4].answer == "4"


def test_bad_files_are_reported_with_row_and_field(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "", "answer": "2"}\n')
    with pytest.raises(ValueError, match="bad.jsonl: row 2: field 'prompt' is missing or empty"):
        load_problems(f, "prompt", "answer")
    with pytest.raises(ValueError, match="field 'solution'"):
        load_problems(f, "prompt", "solution")
    with pytest.raises(FileNotFoundError):
        load_problems(tmp_path / "missing.jsonl", "prompt", "answer")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(ValueError, match="unknown format"):
        load_problems(tmp_path / "x.txt", "prompt", "answer")


def test_datasets_folder(tmp_path):
    import datasets
    datasets.Dataset.from_list([{"prompt": "p", "answer": "1"}]).save_to_disk(str(tmp_path / "ds"))
    assert load_problems(tmp_path / "ds", "prompt", "answer")[0].answer == "1"


def test_file_task_splits_a_held_out_set_off_the_file(tmp_path):
    from posttrain.config.options import load_config
    from posttrain.data.source import build_task
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) for i in range(50)))
    cfg = load_config(None, ["--data.task", "file", "--data.train_path", str(f),
                             "--data.prompt_field", "q", "--data.answer_field", "a"])
    task = build_task(cfg.data)
    held = {p.prompt for p in task.eval_problems}
    train = {task.train_problem(0, i).prompt for i in range(200)}
    assert len(held) == 10 and len(train) == 40 and not held & train


def test_unsolved_prompts_are_asked_again_first_up_to_the_retry_limit():
    from posttrain.data.source import PromptStream
    task = make_task("addition", 2)
    s = PromptStream(task, 0, retries=2, max_waiting=4)
    stream = [task.train_problem(0, i) for i in range(12)]
    problems, keys = s.draw(4)
    assert problems == stream[:4] and keys == [0, 1, 2, 3]
    s.report([False, True, False, True])
    problems, keys = s.draw(4)                    # 1 and 3 again (first retry), then fresh 4, 5
    assert problems == [stream[1], stream[3], stream[4], stream[5]] and keys == [4, 5, 6, 7]
    assert s.last_retried == 2
    s.report([True, True, False, True])         # 1 and 3: a second retry; 5 its first
    problems, _ = s.draw(4)                       # at most half a draw is retries
    assert problems == [stream[1], stream[3], stream[6], stream[7]] and s.waiting == [(5, 0)]
    s.report([True, True, True, True])        # 1 and 3 have no retries left
    assert s.waiting == [(5, 0), (6, 0), (7, 0)]
    problems, _ = s.draw(4)
    assert problems == [stream[5], stream[6], stream[8], stream[9]]
    with pytest.raises(ValueError, match="2 verdicts for 4 prompts"):
        s.report([False, False])


def test_without_retries_a_draw_is_the_stream_and_its_state_round_trips():
    from posttrain.data.source import PromptStream
    task = make_task("addition", 2)
    plain, retrying = PromptStream(task, 3), PromptStream(task, 3, retries=1, max_waiting=2)
    for _ in range(3):
        first = plain.position
        problems, keys = plain.draw(4)
        assert problems == [task.train_problem(3, i) for i in range(first, first + 4)]
        assert keys == list(range(first, first + 4))   # the noise keys of before: same samples
        plain.report([True] * 4)
        assert plain.waiting == []
        retrying.draw(4)
        retrying.report([True, False, True, True])
    assert retrying.waiting == [(6, 0), (7, 0)]   # 3 unsolved a round, capped at 2: the newest kept
    copy = PromptStream(task, 3, retries=1, max_waiting=2)
    copy.load_state(retrying.state())
    assert copy.draw(4) == retrying.draw(4)
    old = PromptStream(task, 3)
    old.load_state({"position": 8})                    # a checkpoint from before retries existed
    assert old.draw(2)[1] == [8, 9]
