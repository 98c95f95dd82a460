"""verifiers environments (envs/verifiers_env.py): a single-turn taskset and a multi-turn one
with an MCP tool, driven by verifiers' rollout loop against posttrain's sampler, offline."""

import json
import os
from pathlib import Path

import pytest
import torch
import verifiers.v1  # noqa: F401  (installed by scripts/install-cpu.sh: a broken install fails)

from posttrain.config.options import load_config
from posttrain.data.source import build_task
from posttrain.envs import for_tokenizer, make_env
from posttrain.rl.loop import train
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import EpisodeSettings, padded_rollout, run_episodes
from posttrain.rollout.sessions import EpisodeRows
from tests.conftest import make_tiny_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def importable_tasksets(monkeypatch):
    """verifiers starts a task's toolset as `python -m tests.vf_calc`: it must import."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))


def env_for(task_id, tokenizer):
    cfg = load_config(None, ["--data.task", f"verifiers:{task_id}", "--data.eval_size", "1"])
    task = build_task(cfg.data)
    return task, for_tokenizer(make_env(cfg.env, task), tokenizer)


class Scripted:
    """An engine that calls the multiply tool on a question and answers with a tool's result."""

    model = None

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def reply(self, prompt_ids):
        text = self.tok.decode(prompt_ids)
        last = text.rsplit("<|im_start|>", 2)[-2]
        if last.startswith("tool"):
            return f"The answer is {last.split(chr(10), 1)[1].split('<|im_end|>')[0].strip()}."
        a, b = text.rsplit("What is ", 1)[1].split("?")[0].split(" * ")
        return f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call>'

    def generate(self, prompts, G, params, generator=None, seeds=None):
        ids = [self.tok(self.reply(p), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
               for p in prompts]
        rows = EpisodeRows(prompts, ids, [[-0.5] * len(x) for x in ids],
                           [[1.0] * len(x) for x in ids], [False] * len(ids))
        return padded_rollout(rows, G, self.tok.pad_token_id, torch.device("cpu"))


@pytest.mark.slow   # (~14 s; quick: tests/test_verifiers_envs.py runs verifiers tool episodes)
def test_a_tool_episode_is_recorded_with_the_tool_result_out_of_the_loss(tokenizer):
    task, env = env_for("tests.vf_calc", tokenizer)
    problems = [p for p in task.train_pool if "12 * 34" in p.prompt or "23 * 45" in p.prompt]
    out = run_episodes(Scripted(tokenizer), tokenizer, env, problems, 2, SamplingParams(64, 1.0),
                       settings=EpisodeSettings(None, True, None, 400, 64), seeds=torch.arange(4))
    env.close()
    # the rubric by hand: the right product (1) and the tool used (0.5), every episode
    assert out.env_rewards_B.tolist() == [1.5] * 4
    assert out.parts == [{"correct": 1.0, "used_tool": 0.5}] * 4
    assert out.counts["turns"] == 8 and out.counts["forks"] == 0
    ro = out.rollout
    for r, p in enumerate([problems[0]] * 2 + [problems[1]] * 2):
        n = int(ro.response_mask_B_T[r].sum())
        ids, policy = ro.response_ids_B_T[r, :n].tolist(), ro.policy_tokens_B_T[r, :n].tolist()
        mine = tokenizer.decode([t for t, m in zip(ids, policy) if m])
        theirs = tokenizer.decode([t for t, m in zip(ids, policy) if not m])
        a, b = p.prompt.split("What is ")[1].split("?")[0].split(" * ")
        assert mine == (f'<tool_call>{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}'
                        f"</tool_call><|im_end|>The answer is {p.answer}.<|im_end|>")
        assert theirs == f"\n<|im_start|>tool\n{p.answer}<|im_end|>\n<|im_start|>assistant\n"
        assert ro.logp_B_T[r, :n].tolist() == [-0.5 if m else 0.0 for m in policy]
    # the tools were offered in a system message (SmolLM2's template renders none)
    prompt = tokenizer.decode(ro.prompt_ids_B_L[0][ro.prompt_mask_B_L[0].bool()])
    assert '"name": "multiply"' in prompt and "<tool_call>" in prompt


# (the tool taskset slow: 19 s; its tool episode is checked in the quick suite below)
@pytest.mark.parametrize("taskset", ["tests.vf_sum", pytest.param("tests.vf_calc", marks=pytest.mark.slow)])
def test_a_verifiers_taskset_trains_two_steps(tmp_path, tokenizer, taskset):
    """(The tool taskset starts a toolset process per episode: held out only for the other.)"""
    held_out = "1" if taskset == "tests.vf_sum" else "0"
    cfg = load_config(None, ["--data.task", f"verifiers:{taskset}", "--data.eval_size", held_out,
                             "--rollout.max_new_tokens", "8", "--rollout.prompts_per_step", "2",
                             "--rollout.group_size", "2", "--steps", "2", "--env.max_tokens", "64",
                             "--data.system_prompt", "null", "--tensorboard", "false",
                             "--algorithm.kl_coef", "0", "--run_dir", str(tmp_path / "r")])
    train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    if held_out == "1":   # held out, before and after
        assert "eval/env_reward" in rows[0] and "eval/env_reward" in rows[-1]
    rows = [r for r in rows if "env/turns" in r]
    parts = {"tests.vf_sum": ("correct", "short"), "tests.vf_calc": ("correct", "used_tool")}[taskset]
    assert len(rows) == 2 and all(f"env/reward_{k}" in r for r in rows for k in parts)
    assert all(r["env/turns"] >= 1 and r.get("env/env_errors", 0) == 0 for r in rows)
    first = [json.loads(line) for line in open(tmp_path / "r" / "samples.jsonl")]
    assert first   # the episodes' answers were logged


def test_a_taskset_module_without_one_taskset_is_refused_before_any_model(tmp_path):
    from posttrain.util.errors import ConfigError
    with pytest.raises(ConfigError, match=r"verifiers:tests.conftest: .*exactly one Taskset"):
        build_task(load_config(None, ["--data.task", "verifiers:tests.conftest"]).data)


def test_a_failing_rubric_is_counted_with_its_error(tokenizer):
    """Every rollout's scoring fails: each episode is an environment error with verifiers' own
    message (FailureWatch stops a run where most episodes fail, step after step)."""
    task, env = env_for("tests.vf_broken", tokenizer)
    engine = make_engine("hf", make_tiny_model(tokenizer, seed=3), tokenizer)
    out = run_episodes(engine, tokenizer, env, task.train_pool[:2], 2, SamplingParams(4, 1.0),
                       settings=EpisodeSettings(None, True, None, 32, 16), seeds=torch.arange(4))
    env.close()
    assert out.counts["env_errors"] == 4 and out.env_rewards_B.tolist() == [0.0] * 4
    assert "the rubric is broken" in out.errors["environment"]
    assert out.tallies()["environment"].failures == 4
