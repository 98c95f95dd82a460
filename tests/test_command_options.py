"""The options every command takes, each one doing what it says, command by command: `--threads 1`
runs with one thread (read inside the command, as its run folder opens), `--run_dir D` writes
there, `--max_minutes` stops it after its first step (batch), `--seed` changes what it samples,
`--no-progress` prints no bar (and without it a bar is printed), and `--resume D` of a command
that trains continues the run stopped by its time budget to the end."""

import json
import re

import pytest
import torch

import posttrain.run.lifecycle as lifecycle
from posttrain.cli import main

SAMPLING = ["--rollout.max_new_tokens", "4", "--data.eval_size", "4", "--eval_batch_size", "2",
            "--reward.workers", "0"]
STAGE = ["--data.synthetic", "addition", "--data.n_pairs", "12", "--data.eval_size", "2",
         "--batch_size", "4"]
# each command: its arguments, then what its run leaves: (file, how many steps it took, samples)
COMMANDS = {
    "train": ["train", *SAMPLING, "--steps", "3", "--rollout.prompts_per_step", "2",
              "--rollout.group_size", "2", "--tensorboard", "false", "--eval_every", "0"],
    "sft": ["sft", *STAGE],
    "dpo": ["dpo", *STAGE],
    "reward-model": ["reward-model", *STAGE],
    "eval": ["eval", *SAMPLING, "--k", "2", "--samples", "2"],
    "generate": ["generate", *SAMPLING, "--n", "4", "--samples", "2", "--keep-wrong"],
    "experiment": ["experiment", "kl-estimators", "--repeats", "3", *SAMPLING,
                   "--rollout.prompts_per_step", "2", "--rollout.group_size", "2"],
}
TRAINS = ("train", "sft", "dpo", "reward-model")
BAR = {name: name for name in COMMANDS} | {"experiment": "kl-estimators: batch"}


def bar_shown(name: str, err: str) -> bool:
    """The command's own progress bar ('train:  33%|###  | 1/3 ...') is in `err`."""
    return re.search(rf"{re.escape(BAR[name])}: +\d+%\|", err) is not None


@pytest.fixture
def threads_seen(monkeypatch):
    """torch's thread count as each command opens its run folder (2 before it starts)."""
    seen, real = [], lifecycle.open_folder

    def spy(job, *a, **kw):
        seen.append(torch.get_num_threads())
        return real(job, *a, **kw)
    monkeypatch.setattr(lifecycle, "open_folder", spy)
    for module in ("posttrain.rl.job", "posttrain.stages.common", "posttrain.stages.evaluate",
                   "posttrain.stages.generate"):
        monkeypatch.setattr(f"{module}.open_folder", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield seen
    torch.set_num_threads(before)


def run(name: str, tiny_dir, folder, *extra: str) -> int:
    return main([*COMMANDS[name], "--model.path", str(tiny_dir), "--run_dir", str(folder), *extra])


def steps_and_samples(name: str, folder) -> tuple[int, object]:
    """How far the command got, and what it sampled (or the order it trained in)."""
    if name == "experiment":
        record = json.loads((folder / "kl-estimators.json").read_text())
        return record["numbers"]["batches"], record["numbers"]
    summary = json.loads((folder / "summary.json").read_text())
    if name == "eval":
        rows = [json.loads(x) for x in (folder / "eval_samples.jsonl").read_text().splitlines()]
        return summary["problems"], rows[-1]["samples"]
    if name == "generate":
        rows = (folder / "sft.jsonl").read_text().splitlines()
        return summary["generated"], [json.loads(r)["response_ids"] for r in rows]
    if name == "train":
        return summary["steps"], (folder / "samples.jsonl").read_text()
    metrics = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return summary["steps"], [{k: v for k, v in m.items() if k.startswith("loss/")}
                              for m in metrics if "optim/lr" in m]


# (train and eval in the quick suite; every command in the full one, README)
@pytest.mark.parametrize("name", [n if n in ("train", "eval") else
                                  pytest.param(n, marks=pytest.mark.slow) for n in COMMANDS])
def test_every_common_option_does_what_it_says(name, tiny_dir, tmp_path, threads_seen, capsys):
    one, other = tmp_path / "seed0", tmp_path / "seed1"
    # --threads 1, --run_dir, --max_minutes (stops after the first step), --seed, --no-progress
    assert run(name, tiny_dir, one, "--threads", "1", "--seed", "0", "--max_minutes", "1e-6",
               "--no-progress") == 0
    assert threads_seen and set(threads_seen) == {1}
    assert not bar_shown(name, capsys.readouterr().err)
    stopped_at, samples = steps_and_samples(name, one)
    assert (one / "config.json").is_file() or (one / "kl-estimators.json").is_file()
    # the same run without a budget, another seed, with its progress bar
    assert run(name, tiny_dir, other, "--seed", "1") == 0
    assert bar_shown(name, capsys.readouterr().err)
    whole, other_samples = steps_and_samples(name, other)
    assert stopped_at < whole, (stopped_at, whole)
    if name in TRAINS:   # the budget's checkpoint continues to the end
        assert main([name, "--resume", str(one), "--max_minutes", "100"]) == 0
        stopped_at, samples = steps_and_samples(name, one)
        assert stopped_at == whole
    assert samples != other_samples   # (the stages: their losses, the batches' order)


@pytest.mark.parametrize("name", ["train", "sft", "eval"])
def test_without_run_dir_a_command_gets_a_folder_of_its_own(name, tiny_dir, tmp_path, monkeypatch):
    """No --run_dir: runs/<name>-<time> under the working folder (train: the preset's name)."""
    monkeypatch.chdir(tmp_path)
    assert main([*COMMANDS[name], "--model.path", str(tiny_dir), "--no-progress"]) == 0
    folders = list((tmp_path / "runs").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("grpo-" if name == "train" else name)
    assert (folders[0] / "config.json").is_file() and (folders[0] / "summary.json").is_file()


def test_run_dir_none_writes_nothing_where_allowed_and_is_refused_elsewhere(tiny_dir, tmp_path,
                                                                            monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main([*COMMANDS["eval"], "--model.path", str(tiny_dir), "--run_dir", "none",
                 "--no-progress"]) == 0
    assert '"eval/accuracy"' in capsys.readouterr().out and not list(tmp_path.iterdir())
    for name in ("train", "sft", "experiment"):
        assert main([*COMMANDS[name], "--model.path", str(tiny_dir), "--run_dir", "none"]) == 2
        assert "--run_dir none" in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_eval_and_generate_take_no_time_budget_unless_given():
    """The recipe's max_minutes (10) is for training: sampling commands run to the end."""
    from posttrain.cli import load_sampling_config
    assert load_sampling_config(None, []).max_minutes is None
    assert load_sampling_config(None, ["--max_minutes", "2"]).max_minutes == 2


def test_the_users_threads_win_over_the_async_core_split(tmp_path):
    from posttrain.config.options import load_config
    from posttrain.run.lifecycle import start_job
    before = torch.get_num_threads()
    try:
        start_job("train", load_config(None, ["--threads", "1"]), threads=2)
        assert torch.get_num_threads() == 1
        start_job("train", load_config(None, []), threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_runs_config_never_opens_that_run_for_eval_or_generate(tmp_path):
    """`posttrain eval --config RUN/config.json`: the run's folder and budget are a training
    run's; eval gets a folder of its own (a run's metrics are never truncated) and no budget."""
    from posttrain.cli import load_sampling_config
    config = tmp_path / "my_task.yaml"
    config.write_text("run_dir: runs/my-task\nmax_minutes: 10\n")
    cfg = load_sampling_config(config, [])
    assert cfg.run_dir is None and cfg.max_minutes is None
    given = load_sampling_config(config, ["--run_dir", "D", "--max_minutes", "3"])
    assert (given.run_dir, given.max_minutes) == ("D", 3)


@pytest.mark.parametrize("installed", [True, False])
def test_trackers_without_a_folder_are_refused(tmp_path, capsys, monkeypatch, installed):
    """The same refusal whether or not the tracker's package is installed (a user's first run
    has no trackers: it must not meet a different error than CI's)."""
    from posttrain.config import sections
    monkeypatch.setattr(sections, "missing_package", lambda name: None if installed else name)
    assert main(["eval", "--run_dir", "none", "--report_to", "trackio"]) == 2
    assert "--report_to trackio with --run_dir none" in capsys.readouterr().err
