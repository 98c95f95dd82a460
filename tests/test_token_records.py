"""Per-token records (posttrain/rl/token_records.py): the numbers stored are the ones the update used,
recomputed here independently on tiny runs (GRPO, PPO, OPD)."""

import copy
import json

import pyarrow.parquet as pq
import pytest
import torch

from posttrain.losses.advantages import grpo_advantage
from posttrain.rollout.forward import frozen_logprobs
from posttrain.losses.policy import clip_sides
from posttrain.config.options import load_config
from posttrain.rollout import Rollout
from posttrain.rl.token_records import TokenTrace, td_residuals, traced_rows
from posttrain.rl.loop import train
from tests.conftest import make_tiny_model
from tests.test_distillation import OPD, peaked_teacher, sharpened
from tests.test_trainer import toy_config


def records(run_dir, step):
    return pq.read_table(run_dir / "tokens" / f"step_{step:06d}.parquet").to_pylist()


def response_rollout(recs, tokenizer, cfg):
    """The stored responses after their prompts, encoded as the run encoded them: what an
    independent recomputation reads."""
    from posttrain.data.tasks import Problem
    from posttrain.model.prompts import encode_prompts, left_pad
    prompts, prompt_mask = left_pad(encode_prompts(
        tokenizer, [Problem(r["prompt"], r["answer"]) for r in recs], cfg.data.system_prompt,
        cfg.data.chat_template), tokenizer.pad_token_id)
    T = max(r["length"] for r in recs)
    ids = torch.full((len(recs), T), tokenizer.pad_token_id)
    mask = torch.zeros(len(recs), T)
    for i, r in enumerate(recs):
        ids[i, :r["length"]] = torch.tensor(r["token_ids"])
        mask[i, :r["length"]] = 1.0
    return Rollout(prompts, prompt_mask, ids, mask, torch.zeros(len(recs), T),
                   torch.zeros(len(recs), dtype=torch.bool), group_size=1)


def test_traced_rows_are_whole_groups():
    assert traced_rows(64, 4, 8) == list(range(8))
    assert traced_rows(64, 4, 5) == list(range(8))     # rounded up to whole groups
    assert traced_rows(6, 4, 100) == list(range(6))    # at most the batch
    assert traced_rows(64, 4, 0) == []


def test_trace_keeps_the_last_pass_of_traced_rows_only():
    trace = TokenTrace([1, 2])
    trace.record(torch.tensor([0, 1]), ratio=torch.tensor([[9.0, 9.0], [1.0, 2.0]]))
    trace.record(torch.tensor([1, 2]), ratio=torch.tensor([[3.0, 4.0], [5.0, 6.0]]), clip=None)
    assert set(trace.values["ratio"]) == {1, 2} and "clip" not in trace.values
    assert trace.row("ratio", 1, 2) == [3.0, 4.0] and trace.row("ratio", 2, 1) == [5.0]


def test_td_residuals_by_hand():
    r = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    v = torch.tensor([[0.5, 0.25, 0.75, 9.0]])
    m = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # delta_t = r_t + gamma V_{t+1} - V_t, V after the last token 0, gamma 0.5
    assert td_residuals(r, v, m, 0.5).tolist() == [[0.5 * 0.25 - 0.5, 0.5 * 0.75 - 0.25, 1.0 - 0.75, 0.0]]


def test_grpo_records_hold_the_updates_numbers(tmp_path, tokenizer):
    """Two steps of GRPO with four minibatches (the later ones off-policy, at a high lr): the stored advantages
    are GRPO's of the stored rewards, the ratios exp(logp - logp_old), the clip flags exactly the
    clipped surrogate's, and step 1's pi_old is the untouched model's log-prob of the tokens."""
    cfg = toy_config(tmp_path, "--preset", "grpo", "--steps", "2", "--optim.minibatches", "4",
                     "--optim.lr", "0.1", "--log_tokens", "8", "--algorithm.kl_coef", "0.05")
    model = make_tiny_model(tokenizer, seed=3)
    before = copy.deepcopy(model)
    train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "tokens").iterdir()) == ["step_000001.parquet",
                                                                   "step_000002.parquet"]
    recs = records(run, 1)
    assert [r["row"] for r in recs] == list(range(8)) and [r["group"] for r in recs] == [0] * 4 + [1] * 4
    for g in (0, 1):
        group = recs[4 * g:4 * g + 4]
        adv = grpo_advantage(torch.tensor([[r["reward"] for r in group]]))[0]
        for r, a in zip(group, adv.tolist()):
            assert r["adv"] == pytest.approx([a * m for m in r["in_loss"]], abs=1e-6)
            assert json.loads(r["reward_parts"]) == {"tests.toy_rewards:first_letter_a_to_e": r["reward"]}
    updated = [r for r in recs if r["updated"]]
    assert updated, "no traced group had a signal"
    both = updated + [r for r in records(run, 2) if r["updated"]]
    low, high = 1 - cfg.algo.clip_low, 1 + cfg.algo.clip_high
    for r in both:
        logp, old, ratio = (torch.tensor(r[k]) for k in ("logp", "logp_old", "ratio"))
        assert torch.equal(ratio, torch.exp(logp - old))
        assert torch.equal(torch.tensor(r["clip"], dtype=torch.int8),
                           clip_sides(ratio, torch.tensor(r["adv"]), low, high))
        assert len(r["tokens"]) == len(r["token_ids"]) == r["length"] == len(r["kl_ref"])
    # the second minibatch ran after an optimizer step: ratios moved off 1, some were clipped
    assert any(abs(x - 1) > 1e-4 for r in both for x in r["ratio"])
    assert any(c != 0 for r in both for c in r["clip"])
    # pi_old of step 1 is the untouched model's log-prob of the stored tokens
    rollout = response_rollout(recs, tokenizer, cfg)
    old = frozen_logprobs(before, rollout, cfg.rollout.temperature, 8)
    for r in updated:
        i = recs.index(r)
        assert r["logp_old"] == pytest.approx(old[i, :r["length"]].tolist(), abs=1e-4)


def test_opd_records_hold_the_teachers_logprobs(tmp_path, tokenizer):
    """OPD: the stored teacher log-probs are the teacher's on the stored tokens (recomputed with
    the saved teacher), the stored teacher KL is log pi_old - log pi_teacher, and the advantage is
    the reward-to-go of its negative (reverse-KL advantage, §8)."""
    teacher_dir = peaked_teacher(tokenizer, tmp_path / "t")
    cfg = load_config(None, [*OPD, "--teacher.path", str(teacher_dir), "--steps", "1",
                             "--log_tokens", "4", "--run_dir", str(tmp_path / "run")])
    train(cfg, model=sharpened(tokenizer, 40.0), tokenizer=tokenizer, show_progress=False)
    recs = records(tmp_path / "run", 1)
    teacher = frozen_logprobs(sharpened(tokenizer, 20.0), response_rollout(recs, tokenizer, cfg),
                              cfg.rollout.temperature, 8)
    for i, r in enumerate(recs):
        assert r["logp_teacher"] == pytest.approx(teacher[i, :r["length"]].tolist(), abs=1e-4)
        # (the advantage stage reads pi_old as sampled: this engine's numbers are the trainer's)
        kl = torch.tensor(r["logp_sampler"]) - torch.tensor(r["logp_teacher"])
        assert r["kl_teacher"] == pytest.approx(kl.tolist(), abs=1e-6)
        # the advantage is the reward-to-go of r_t = -kl_t (gamma 1, §8)
        to_go = (-kl).flip(0).cumsum(0).flip(0)
        assert r["adv"] == pytest.approx(to_go.tolist(), abs=1e-5)


def test_ppo_records_hold_values_returns_and_td_residuals(tmp_path, tokenizer):
    """PPO: value, return and the TD residuals are stored, and the residuals discounted by
    gamma * lambda sum to the GAE advantage, return - value (§5)."""
    cfg = toy_config(tmp_path, "--preset", "ppo", "--steps", "1", "--log_tokens", "4")
    train(cfg, model=make_tiny_model(tokenizer, seed=2), tokenizer=tokenizer, show_progress=False)
    algo = cfg.algo
    for r in records(tmp_path / "run", 1):
        delta, value, ret = (torch.tensor(r[k]) for k in ("gae_delta", "value", "return"))
        gl, acc, adv = algo.gamma * algo.lam, 0.0, []
        for d in reversed(delta.tolist()):
            acc = d + gl * acc
            adv.append(acc)
        assert list(reversed(adv)) == pytest.approx((ret - value).tolist(), abs=1e-5)


def test_a_new_run_in_a_used_folder_drops_old_records(tmp_path, tokenizer):
    cfg = toy_config(tmp_path, "--steps", "2", "--log_tokens", "4")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    cfg = toy_config(tmp_path, "--steps", "1", "--log_tokens", "4")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert [p.name for p in (tmp_path / "run" / "tokens").iterdir()] == ["step_000001.parquet"]
    cfg = toy_config(tmp_path, "--steps", "1", "--log_tokens", "0")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert not (tmp_path / "run" / "tokens").exists()
