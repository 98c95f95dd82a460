"""When runs save themselves and stop: checkpoints by steps and by minutes, SIGINT / SIGTERM
(finish the step, save, exit with the resume command), the end of max_minutes, the newest K kept,
`--resume auto`, and the rows a killed run wrote after its checkpoint dropped on resume."""

import json
import os
import signal

import pytest
import torch
from safetensors.torch import load_file

import posttrain.run.lifecycle as lifecycle_mod
from posttrain.stages.common import OfflineJob
from posttrain.stages.sft import sft
import posttrain.rl.loop as trainer
from posttrain.cli import main
from posttrain.config.options import load_config
from posttrain.run.lifecycle import Lifecycle, find_run_to_resume
from posttrain.rl.loop import train
from tests.conftest import make_tiny_model, stage_config
from tests.test_trainer import reward_curve, toy_config

COMMON = ["--steps", "4", "--optim.lr", "1e-2", "--rollout.prompts_per_step", "2",
          "--rollout.group_size", "2"]


def _weights(run_dir):
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def test_the_policy_saves_by_steps_by_minutes_and_on_a_signal(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(lifecycle_mod.time, "monotonic", lambda: clock[0])
    life = Lifecycle(every_steps=3, every_minutes=2.0)
    assert [life.after_step(s) for s in (1, 2, 3)] == [(False, False), (False, False), (True, False)]
    clock[0] += 119
    assert life.after_step(4) == (False, False)
    clock[0] += 1                                   # 2 minutes since the start
    assert life.after_step(5) == (True, False)
    life.saved()
    clock[0] += 60
    assert life.after_step(7) == (False, False)     # the minutes count from the last save
    previous = signal.getsignal(signal.SIGTERM)
    with life:
        os.kill(os.getpid(), signal.SIGTERM)        # the handler only raises a flag
        assert life.stop_signal == "SIGTERM"
        assert life.after_step(8) == (True, True)
    assert signal.getsignal(signal.SIGTERM) is previous   # handlers restored afterwards


def test_a_second_ctrl_c_aborts_at_once():
    with Lifecycle() as life:
        os.kill(os.getpid(), signal.SIGINT)
        assert life.stop_signal == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_step_that_outlives_the_grace_is_abandoned_but_a_checkpoint_write_is_not():
    """A wait that never ends (a hung episode) is interrupted stop_grace_s after the signal,
    in the main thread; a checkpoint being written then is let finish; a second SIGTERM
    abandons at once. Each abandonment arms the hard exit (on_abandon) with its signal."""
    import threading
    import time

    from posttrain.run.lifecycle import StepAbandoned
    armed = []
    with Lifecycle(grace_s=0.5, on_abandon=armed.append) as life:
        os.kill(os.getpid(), signal.SIGTERM)
        t0 = time.monotonic()
        with pytest.raises(StepAbandoned, match="stop_grace_s=0.5"):
            threading.Event().wait()            # (blocked in the kernel: a real signal wakes it)
        assert 0.5 <= time.monotonic() - t0 < 10 and armed == [signal.SIGTERM]
    with Lifecycle(grace_s=0.3, on_abandon=armed.append) as life:
        os.kill(os.getpid(), signal.SIGTERM)
        with life.saving():
            time.sleep(1.0)                     # (the grace ends during the write: not interrupted)
        assert life.after_step(1) == (True, True)
    with Lifecycle(grace_s=600, on_abandon=armed.append):
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(StepAbandoned, match="a second SIGTERM"):
            os.kill(os.getpid(), signal.SIGTERM)
    assert armed == [signal.SIGTERM] * 3


def _job(tmp_path, grace, max_minutes=None):
    """A bare Job for a Steps loop; its hard exit stubbed (the real one ends the process)."""
    from types import SimpleNamespace
    ckpt = SimpleNamespace(every_steps=0, every_minutes=None, stop_grace_s=grace)
    job = lifecycle_mod.Job(command="train", cfg=SimpleNamespace(checkpoint=ckpt,
                                                                 max_minutes=max_minutes),
                            run_dir=tmp_path, show_progress=False)
    job.hard_exit = SimpleNamespace(cancel=lambda: None)
    return job


def loop(job, total, step_fn, save, evaluate=None, every=1):
    """A command's loop as the commands write it (rl/loop.py, stages/common.py): returns the
    signal that stopped it."""
    with lifecycle_mod.Steps(job, total, "t") as steps:
        for step in steps:
            with steps.timed(step):
                step_fn(step)
            if evaluate is not None and steps.evaluation_due(step, every):
                evaluate(step)
            if steps.checkpoint_due(step):
                with steps.saving(step):
                    save(step)
    return steps.stop_signal


def _kill_self():
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_stopped_step_is_saved_before_its_evaluation(tmp_path):
    """A signal during step 2: step 2 is saved at once and its evaluation skipped (an
    evaluation longer than the grace lost the finished step); a signal during an evaluation
    saves that step."""
    import time
    saved, evaluated = [], []

    def evaluate(step):
        evaluated.append(step)
        time.sleep(1.5)                        # (longer than the grace)
    job = _job(tmp_path, 0.5)
    steps = lambda step: step == 2 and _kill_self()   # noqa: E731
    assert loop(job, 4, steps, saved.append, evaluate) == "SIGTERM"
    assert saved == [2] and evaluated == [1] and job.abandoned_step is None
    assert 0 <= job.cleanup_wait_s() <= 0.25   # (the cleanup gets what is left of the grace)
    saved, job = [], _job(tmp_path, 0.5)
    assert loop(job, 4, lambda step: None, saved.append, lambda step: _kill_self()) == "SIGTERM"
    assert saved == [1] and job.steps_done == 1


def test_a_max_minutes_checkpoint_outlives_the_grace(tmp_path):
    """The checkpoint max_minutes writes is let finish, as any other, when the grace of a
    signal that came during it runs out (it was interrupted: no checkpoint)."""
    import time
    saved = []

    def slow_save(step):
        _kill_self()
        time.sleep(1.0)                        # (the grace, 0.3 s, ends during the write)
        saved.append(step)
    job = _job(tmp_path, 0.3, max_minutes=0.001)
    assert loop(job, 4, lambda step: time.sleep(0.1), slow_save) == "SIGTERM"
    assert saved == [1] and job.abandoned_step is None


def test_an_infinite_grace_is_no_limit(tmp_path, monkeypatch):
    """checkpoint.stop_grace_s inf: no grace timer (Timer(inf) died with OverflowError)."""
    import threading
    import time
    failures = []
    monkeypatch.setattr(threading, "excepthook", failures.append)
    saved, job = [], _job(tmp_path, float("inf"))

    def save(step):
        time.sleep(0.2)
        saved.append(step)
    assert loop(job, 3, lambda step: _kill_self(), save) == "SIGTERM"
    time.sleep(0.2)
    assert saved == [1] and failures == [] and job.cleanup_wait_s() == 60.0


def test_the_hard_exit_closes_the_logs_and_writes_the_summary(tmp_path, monkeypatch):
    """The last resort flushes TensorBoard and the trackers (the logger closed, bounded)
    before the process ends."""
    import threading
    from posttrain.logs.metrics import NullLogger
    exited, closed = threading.Event(), []

    class Logger(NullLogger):
        def close(self):
            closed.append(True)
    monkeypatch.setattr(lifecycle_mod.os, "_exit", lambda code: exited.set())
    job = lifecycle_mod.Job(command="train", cfg=None, run_dir=tmp_path, logger=Logger(),
                            steps_done=3)
    lifecycle_mod.arm_hard_exit(job, signal.SIGTERM, 0.1)
    assert exited.wait(10) and closed == [True]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["hard_exit"] and summary["abandoned_step"] == 4


def test_a_stopped_runs_engine_waits_no_longer_than_the_grace_left():
    """close_sources hands the engine's close what is left of the grace (Ahead.close waited
    60 s, twice, whatever the grace)."""
    import time
    from types import SimpleNamespace

    from posttrain.rl.job import close_sources
    waits = []
    run = lifecycle_mod.Job(command="train", cfg=None, stop_by=time.monotonic() + 8.0)
    from posttrain.sampling.service import Sampling
    run.sampling = Sampling(cfg=None, engine=None, tokenizer=None,
                            source=SimpleNamespace(close=lambda wait_s=60.0: waits.append(wait_s)))
    close_sources(run)
    assert len(waits) == 1 and 3.0 < waits[0] <= 4.0


def _signal_after(monkeypatch, step_to_signal, sig=signal.SIGTERM):
    real = trainer.log_step

    def log_then_signal(run, step, *a, **kw):
        real(run, step, *a, **kw)
        if step == step_to_signal:
            os.kill(os.getpid(), sig)
    monkeypatch.setattr(trainer, "log_step", log_then_signal)


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_saves_the_step_and_the_run_resumes_to_the_same_weights(tmp_path, tokenizer,
                                                                         monkeypatch, sig):
    whole = toy_config(tmp_path / "whole", *COMMON)
    train(whole, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)

    _signal_after(monkeypatch, 2, sig)
    cfg = toy_config(tmp_path / "cut", *COMMON)
    out = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    run = tmp_path / "cut" / "run"
    assert out["stopped_by"] == signal.Signals(sig).name and out["steps"] == 2
    assert out["resume"] == f"posttrain train --resume {run}"
    assert (run / "checkpoints" / "step_000002").is_dir() and not (run / "final_model").exists()
    assert json.loads((run / "summary.json").read_text())["stopped_by"] == signal.Signals(sig).name

    monkeypatch.undo()
    resumed = load_config(None, base=json.loads((run / "config.json").read_text()))
    train(resumed, resume=run, model=make_tiny_model(tokenizer, seed=5), tokenizer=tokenizer,
          show_progress=False)
    assert reward_curve(run) == reward_curve(tmp_path / "whole" / "run")
    a, b = _weights(tmp_path / "whole" / "run"), _weights(run)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_drops_the_rows_written_after_the_checkpoint(tmp_path, tokenizer):
    """A run killed (SIGKILL) after its step-2 checkpoint had logged step 3, and half a line."""
    args = [*COMMON, "--checkpoint.every_steps", "2"]
    whole = toy_config(tmp_path / "whole", *args)
    train(whole, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    cut = toy_config(tmp_path / "cut", *args[:1], "3", *args[2:])
    train(cut, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    run = tmp_path / "cut" / "run"
    for name in ("metrics.jsonl", "samples.jsonl"):
        with open(run / name, "a") as f:
            f.write('{"step": 4, "reward/mean": 0.123')   # killed mid-write
    resumed = load_config(None, base=json.loads((run / "config.json").read_text()),
                          overrides=["--steps", "4"])
    train(resumed, resume=run, model=make_tiny_model(tokenizer), tokenizer=tokenizer,
          show_progress=False)

    def rows(path):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith("perf/")}
                for line in open(path)]
    assert rows(run / "metrics.jsonl") == rows(tmp_path / "whole" / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows(run / "samples.jsonl")] == [1, 2, 3, 4]


@pytest.mark.plots
def test_max_minutes_ends_with_a_checkpoint_and_only_the_newest_k_are_kept(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, *COMMON, "--max_minutes", "0.00001", "--checkpoint.keep", "1")
    out = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    run = tmp_path / "run"
    assert out["steps"] == 1 and (run / "final_model").is_dir()
    assert out["plot"] == str(run / "training_curves.png") and (run / "training_curves.png").stat().st_size > 10_000
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    cfg = toy_config(tmp_path / "k", *COMMON, "--checkpoint.every_steps", "1", "--checkpoint.keep", "2")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert sorted(p.name for p in (tmp_path / "k" / "run" / "checkpoints").iterdir()) == [
        "step_000003", "step_000004"]


def _fake_run(folder, config, with_checkpoint=True):
    from posttrain.run.checkpoint import seal
    (folder / "checkpoints" / "step_000001").mkdir(parents=True)
    (folder / "checkpoints" / "step_000001" / "trainer_state.pt").write_bytes(b"x")
    if with_checkpoint:   # (one without its COMPLETE marker was never finished)
        seal(folder / "checkpoints" / "step_000001", 1)
    (folder / "config.json").write_text(json.dumps(config))


def test_resume_auto_finds_the_newest_run_of_the_same_config(tmp_path):
    cfg = load_config(None, ["--optim.lr", "3e-5"]).to_dict()
    other = load_config(None, ["--optim.lr", "1e-5"]).to_dict()
    _fake_run(tmp_path / "a", {**cfg, "run_dir": None})
    _fake_run(tmp_path / "b", other)
    _fake_run(tmp_path / "c", cfg, with_checkpoint=False)   # never got to a checkpoint
    os.utime(tmp_path / "a", (1, 1))
    assert find_run_to_resume(cfg, None, tmp_path) == tmp_path / "a"
    _fake_run(tmp_path / "d", cfg)
    assert find_run_to_resume(cfg, None, tmp_path) == tmp_path / "d"      # the newest
    assert find_run_to_resume(other, str(tmp_path / "b"), tmp_path) == tmp_path / "b"
    assert find_run_to_resume(other, str(tmp_path / "a"), tmp_path) is None   # another config
    assert find_run_to_resume(load_config(None, ["--optim.lr", "7e-5"]).to_dict(), None, tmp_path) is None


def test_train_resume_auto_picks_the_run_folder_of_the_same_config(tmp_path, tokenizer, monkeypatch):
    """The command line: with no run of this config, --resume auto starts a new one; once a run
    folder of the same config holds a checkpoint, the same command resumes that folder."""
    monkeypatch.chdir(tmp_path)
    seen = []
    monkeypatch.setattr(trainer, "train", lambda cfg, resume=None, show_progress=True:
                        seen.append(resume) or {"run_dir": "x", "steps": 0, "train_minutes": 0,
                                                "final_model": "x"})
    args = ["train", "--resume", "auto", "--optim.lr", "3e-5", "--no-progress"]
    assert main(args) == 0 and seen == [None]           # nothing to resume yet: a new run
    cfg = load_config(trainer_recipe(), ["--optim.lr", "3e-5"]).to_dict()
    _fake_run(tmp_path / "runs" / "grpo-1", cfg)
    assert main(args) == 0 and str(seen[-1]) == os.path.join("runs", "grpo-1")


def trainer_recipe():
    from posttrain.cli import DEFAULT_RECIPE, recipe_path
    return recipe_path(DEFAULT_RECIPE)


@pytest.mark.slow   # (a stage killed outright resumes in the quick suite: test_stage_resume.py)
def test_a_stage_stopped_by_a_signal_resumes_to_the_same_weights(tmp_path, tokenizer, monkeypatch):
    fields = dict(synthetic="addition", n_pairs=24, eval_size=2, lr=3e-3, batch_size=8, epochs=2,
                  system_prompt="Be brief.")
    sft(stage_config(run_dir=str(tmp_path / "whole"), **fields), model=make_tiny_model(tokenizer),
               tokenizer=tokenizer, show_progress=False)
    calls, real = [0], OfflineJob.optimizer_step

    def step_then_signal(st, loss):
        calls[0] += 1
        lr = real(st, loss)
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return lr
    monkeypatch.setattr(OfflineJob, "optimizer_step", step_then_signal)
    cut = tmp_path / "cut"
    out = sft(stage_config(run_dir=str(cut), **fields), model=make_tiny_model(tokenizer),
                     tokenizer=tokenizer, show_progress=False)
    assert out["stopped_by"] == "SIGTERM" and out["resume"] == f"posttrain sft --resume {cut}"
    assert (cut / "checkpoints" / "step_000003").is_dir()
    monkeypatch.undo()
    sft(stage_config(run_dir=str(cut), **fields), model=make_tiny_model(tokenizer),
               tokenizer=tokenizer, show_progress=False, resume=cut)
    a, b = _weights(tmp_path / "whole"), _weights(cut)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_write_that_dies_halfway_leaves_the_previous_one_intact(tmp_path, tokenizer,
                                                                            monkeypatch):
    """A full disk (or a kill) while the trainer state is written: the half-written folder is
    never taken for a checkpoint, the previous one stays the latest, and the next save works."""
    import posttrain.run.checkpoint as ckpt
    from posttrain.run.optim import make_scheduler
    model = make_tiny_model(tokenizer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = make_scheduler(opt, 10)
    save = lambda step: ckpt.save_checkpoint(  # noqa: E731
        tmp_path, step, model, tokenizer, ckpt.trainer_state(model, opt, sched, torch.Generator(), {}),
        {"x": 1})
    save(1)
    real = torch.save

    def disk_full(*a, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt.torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        save(2)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000001"
    assert (tmp_path / "checkpoints" / ".step_000002.tmp").is_dir()   # (the half-written one)
    monkeypatch.setattr(ckpt.torch, "save", real)
    save(2)
    assert ckpt.latest_checkpoint(tmp_path).name == "step_000002"
    assert not (tmp_path / "checkpoints" / ".step_000002.tmp").exists()


def test_the_budget_ends_the_loop_with_its_last_step_saved_and_a_second_signal_abandons(
        tmp_path, monkeypatch):
    """Steps' frame: with a 1-minute budget and 25 s steps the loop runs 3 steps (75 s), saves
    step 3 (not on the cadence) and ends; a budget ending at the last step saves nothing more
    (save_last False); a second signal abandons the step in flight, caught by the frame."""
    ticks = []

    def _tick():                       # (each read 25 s later: a step takes 25 s)
        ticks.append(len(ticks) * 25.0)
        return ticks[-1]
    monkeypatch.setattr(lifecycle_mod, "_clock", _tick)
    for total, saved_expected, done in ((6, [3], 3), (3, [], 3)):
        ticks.clear()
        job, saved = _job(tmp_path, None, max_minutes=1.0), []
        with lifecycle_mod.Steps(job, total, "t", save_last=False) as steps:
            for step in steps:
                with steps.timed(step):
                    pass
                if steps.checkpoint_due(step):
                    with steps.saving(step):
                        saved.append(step)
        assert (saved, job.steps_done, steps.stop_signal) == (saved_expected, done, None)
    job = _job(tmp_path, None)
    with lifecycle_mod.Steps(job, 5, "t") as steps:
        for step in steps:
            with steps.timed(step):
                if step == 2:
                    _kill_self()
                    _kill_self()       # (the second signal: the step is abandoned at once)
    assert (job.abandoned_step, job.steps_done, steps.stop_signal) == (2, 1, "SIGTERM")


def test_a_run_whose_model_fails_to_load_stops_what_its_inputs_started(tmp_path, monkeypatch):
    """The inputs are checked (the reward sandbox started) before any model loads; a model that
    then fails to load stops the sampling service (sandbox, environment) and leaves no folder."""
    import posttrain.rl.job as job_mod
    closed = []

    def no_model(*args, **kwargs):
        raise RuntimeError("no model here")
    monkeypatch.setattr(job_mod, "load_models", no_model)
    monkeypatch.setattr(job_mod.Sampling, "close",
                        lambda self, wait_s=60.0: closed.append(self.scorer is not None))
    cfg = toy_config(tmp_path, *COMMON)
    with pytest.raises(RuntimeError, match="no model here"):
        job_mod.start_training(cfg, None, None, None, None, show_progress=False)
    assert closed == [True] and not (tmp_path / "run").exists()
