"""The update module's contracts: metrics read from the device once per update, and a scored batch
whose select / merge / to keep every field."""

import dataclasses
import os
import sys
from collections import Counter
from dataclasses import replace

import pytest
import torch

import posttrain
from tests.conftest import make_tiny_model, learner_for
from posttrain.sampling.batch import ScoredBatch, merge
from posttrain.config.options import load_config
from posttrain.data.source import PromptStream, build_task
from posttrain.data.tasks import Problem
from posttrain.rewards import Scorer
from posttrain.rollout import Rollout, make_engine
from posttrain.sampling.collect import generate_and_score
from posttrain.sampling.setup import SamplingSetup
from posttrain.rl.update import update_policy
from posttrain.rl.loss_terms import Metrics

PACKAGE = os.path.dirname(posttrain.__file__) + os.sep

TOY = ["--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:first_letter_a_to_e",
       "--data.eval_size", "0", "--rollout.max_new_tokens", "3", "--data.system_prompt", "null",
       "--tensorboard", "false", "--threads", "2"]


def test_metrics_sum_rows_average_steps_and_keep_maxima():
    m = Metrics()
    m.rows("a", torch.tensor(0.5), 4)      # two micro-batches of 4 and 2 rows
    m.rows("a", torch.tensor(2.0), 2)
    m.update("loss", torch.tensor(1.0))
    m.update("loss", torch.tensor(3.0))
    m.max("r", torch.tensor(1.5))
    m.max("r", torch.tensor(1.25))
    rows, updates, maxima = m.read()
    assert rows == {"a": 0.5 * 4 + 2.0 * 2} and updates == {"loss": 4.0} and maxima == {"r": 1.5}
    assert Metrics().read() == ({}, {}, {})


class _Syncs:
    """Counts every way posttrain's own code brings a floating tensor's value to Python (row
    indices on the host and torch's own internals, such as Adam's step counter, are not syncs)."""
    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.calls = Counter()
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _name=name, _original=original, **k):
                caller = sys._getframe(1).f_code.co_filename
                if t.dtype.is_floating_point and caller.startswith(PACKAGE):
                    self.calls[_name] += 1
                return _original(t, *a, **k)
            monkeypatch.setattr(torch.Tensor, name, counted)


@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_one_update_reads_its_metrics_from_the_device_once(tmp_path, tokenizer, monkeypatch, preset):
    """Two epochs x two minibatches (four optimizer steps, several micro-batches each; PPO with
    its value model too): every metric reaches the host in the one `tolist` at the end. (Each optimizer
    step also reads one bool, whether its gradient norm is finite, which a skip needs.)"""
    cfg = load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), "--preset", preset,
                             "--optim.epochs", "2", "--optim.minibatches", "2",
                             "--optim.micro_batch_size", "4", "--algorithm.kl_coef", "0.0"])
    model = make_tiny_model(tokenizer, seed=1)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", model, tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape) * batch.loss_mask_B_T
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    critic = None
    batch = replace(batch, adv_B_T=adv)
    if preset == "ppo":
        from posttrain.rl.critic import Critic
        critic = Critic(cfg.critic, model)
        batch = replace(batch, old_values_B_T=torch.zeros_like(adv), returns_B_T=adv.clone())
    syncs = _Syncs(monkeypatch)
    stats = update_policy(learner_for(cfg, model, opt, sched, critic=critic), batch)
    assert dict(syncs.calls) == {"tolist": 1}
    assert stats["optim/steps"] == 4 and stats["optim/nonfinite_steps"] == 0
    assert stats["policy/ratio_max"] > 1.0 and stats["policy/grad_norm"] > 0
    if critic is not None:
        assert stats["loss/value"] > 0 and stats["critic/grad_norm"] > 0


def _batch(T: int, with_optional: bool) -> ScoredBatch:
    B = 4
    r = Rollout(torch.ones(B, 3, dtype=torch.long), torch.ones(B, 3), torch.ones(B, T, dtype=torch.long),
                torch.ones(B, T), torch.full((B, T), -0.5), torch.zeros(B, dtype=torch.bool), 2)
    opt = (lambda v: torch.full((B, T), v)) if with_optional else (lambda v: None)
    return ScoredBatch(r, [Problem(f"p{i}", str(i)) for i in range(B)], [f"c{i}" for i in range(B)],
                       torch.arange(B, dtype=torch.float), torch.ones(B, dtype=torch.bool),
                       torch.ones(B, T), ref_logp_B_T=opt(-1.0), teacher_logp_B_T=opt(-2.0),
                       teacher_view=r if with_optional else None, trainer_old_logp_B_T=opt(-3.0),
                       transcripts=[f"t{i}" for i in range(B)] if with_optional else None,
                       adv_B_T=opt(0.5), old_values_B_T=opt(0.25), returns_B_T=opt(0.75),
                       token_rewards_B_T=opt(0.125),
                       version_B=torch.arange(B) if with_optional else None,
                       scored_B=torch.tensor([True, False, True, True]) if with_optional else None,
                       reward_parts=[{"verifier": float(i)} for i in range(B)] if with_optional else None)


def test_a_scored_batch_is_immutable_and_select_merge_keep_every_field():
    b = _batch(5, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.rewards_B = torch.zeros(4)
    s = b.select(torch.tensor([2, 3]))
    for f in dataclasses.fields(ScoredBatch):
        assert getattr(s, f.name) is not None, f.name
    assert s.completions == ["c2", "c3"] and s.rewards_B.tolist() == [2.0, 3.0]
    assert s.reward_parts == [{"verifier": 2.0}, {"verifier": 3.0}]
    assert s.version_B.tolist() == [2, 3]       # each response keeps the weights that sampled it
    assert s.scored_B.tolist() == [True, True] and b.select(torch.tensor([1])).scored_B.tolist() == [False]
    assert s.trainer_old_logp_B_T.shape == (2, 5) and s.teacher_view.response_ids_B_T.shape == (2, 5)
    m = merge([_batch(5, True), _batch(3, True)], pad_id=0)
    assert m.ref_logp_B_T.shape == (8, 5) and (m.ref_logp_B_T[4:, 3:] == 0).all()
    assert m.teacher_logp_B_T[4:, :3].eq(-2.0).all() and m.teacher_view.response_ids_B_T.shape == (8, 5)
    assert len(m.problems) == 8 and m.loss_mask_B_T[4:, 3:].sum() == 0
    assert m.version_B.tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    assert merge([_batch(5, False), _batch(3, False)], 0).ref_logp_B_T is None
    with pytest.raises(ValueError, match="ref_logp_B_T is set in some parts"):
        merge([_batch(5, True), _batch(3, False)], 0)


def test_padding_of_every_per_token_logprob_is_zero_whatever_the_engine_left_there():
    b = _batch(5, True)
    mask = b.rollout.response_mask_B_T.clone()
    mask[:, 3:] = 0
    nan = lambda: torch.full((4, 5), float("nan"))  # noqa: E731
    r = dataclasses.replace(b.rollout, response_mask_B_T=mask, logp_B_T=nan())
    s = ScoredBatch(r, b.problems, b.completions, b.rewards_B, b.correct_B, mask,
                    ref_logp_B_T=nan(), teacher_logp_B_T=nan(), trainer_old_logp_B_T=nan())
    for x in (s.rollout.logp_B_T, s.ref_logp_B_T, s.teacher_logp_B_T, s.trainer_old_logp_B_T):
        assert (x[:, 3:] == 0).all() and x[:, :3].isnan().all()   # inside a response: untouched


def test_a_step_with_a_non_finite_gradient_leaves_weights_and_adam_untouched():
    from posttrain.model.distributed import SINGLE
    from posttrain.run.learner import step_if_finite
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.AdamW([w], lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (i + 1))
    (w * torch.tensor([1.0, -1.0])).sum().backward()
    norm, stepped = step_if_finite([w], opt, sched, 1.0, SINGLE)
    assert stepped and norm == pytest.approx(2 ** 0.5)
    before = (w.detach().clone(), {k: v.clone() for k, v in opt.state[w].items()}, sched.last_epoch)
    opt.zero_grad()
    (w * torch.tensor([float("nan"), 1.0])).sum().backward()
    _, stepped = step_if_finite([w], opt, sched, 1.0, SINGLE)
    assert not stepped and w.grad is None
    assert torch.equal(w.detach(), before[0]) and sched.last_epoch == before[2]
    assert all(torch.equal(opt.state[w][k], v) for k, v in before[1].items())


def test_a_run_stops_after_k_non_finite_steps_in_a_row(tmp_path, tokenizer, monkeypatch, capsys):
    import posttrain.run.learner as update
    from posttrain.util.errors import NonFiniteError
    from posttrain.rl.loop import train
    real, calls = update.clip_grad_norm, [0]

    def nan_from_step_2(params, max_norm, world):
        calls[0] += 1
        norm = real(params, max_norm, world)
        return norm * float("nan") if calls[0] >= 2 else norm
    monkeypatch.setattr(update, "clip_grad_norm", nan_from_step_2)
    cfg = load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), "--steps", "10",
                             "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
                             "--optim.max_nonfinite_steps", "3"])
    with pytest.raises(NonFiniteError, match="3 optimizer steps in a row had a non-finite"):
        train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rows = [__import__("json").loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["optim/nonfinite_steps"] for r in rows] == [0, 1, 1, 1]


def test_dr_grpo_normaliser_is_an_episodes_budget_not_one_turns():
    """Dr. GRPO divides by the most tokens a response can hold: max_new_tokens for one turn; for
    an episode its policy tokens over all turns, within the episode's token budget."""
    from posttrain.rl.update import response_budget
    cfg = load_config(None, ["--rollout.max_new_tokens", "32", "--env.max_turns", "3",
                             "--env.max_tokens", "256"])
    one = Rollout(torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2), torch.zeros(1, 4, dtype=torch.long),
                  torch.ones(1, 4), torch.zeros(1, 4), torch.zeros(1, dtype=torch.bool), 1)
    episode = dataclasses.replace(one, policy_mask_B_T=torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    batch = lambda r: ScoredBatch(r, [Problem("p", "1")], ["a"], torch.zeros(1),   # noqa: E731
                                  torch.zeros(1, dtype=torch.bool), r.policy_tokens_B_T)
    assert response_budget(cfg, batch(one)) == 32.0
    assert response_budget(cfg, batch(episode)) == 96.0          # 3 turns x 32, under 256
    small = load_config(None, ["--rollout.max_new_tokens", "32", "--env.max_turns", "3",
                               "--env.max_tokens", "64"])
    assert response_budget(small, batch(episode)) == 64.0


def test_a_token_budget_cuts_micro_batches_to_whole_groups_and_leaves_the_update_as_it_was(
        tmp_path, tokenizer, monkeypatch):
    """optim.micro_batch_tokens: a micro-batch runs at most that many positions through the
    decoder (each group's prompt once, every response), in whole groups; the minibatch's loss
    weights do not depend on the cut, so the weights after the update equal those of the uncut
    update (to float rounding)."""
    import posttrain.rl.update as update
    from posttrain.config.sections import OptimConfig
    # (prompt, response, group): the default job's 40 + 8 x 24 a group fits 17 groups, capped at
    # 32 rows; a two-seat game's 224 + 4 x 83 fits 7 groups of 4; a group past the budget runs alone
    assert [OptimConfig(micro_batch_tokens=t).micro_rows(*shape) for t, shape in
            ((0, (40, 300, 8)), (4096, (40, 24, 8)), (4096, (224, 83, 4)), (4096, (100, 5000, 8)))
            ] == [32, 32, 28, 8]
    cfg = load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), "--algorithm.kl_coef", "0.0",
                             "--rollout.prompts_per_step", "4", "--rollout.group_size", "4"])
    model = make_tiny_model(tokenizer, seed=1)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", model, tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    batch = replace(batch, adv_B_T=torch.randn(batch.loss_mask_B_T.shape) * batch.loss_mask_B_T)
    per_group = batch.rollout.prompt_ids_B_L.shape[1] + 4 * batch.rollout.response_ids_B_T.shape[1]
    sizes, original = [], update.micro_batch_loss
    monkeypatch.setattr(update, "micro_batch_loss",
                        lambda m, b, micro, *a, **k: sizes.append(len(micro.rows)) or original(m, b, micro, *a, **k))
    after = {}
    for tokens in (0, per_group + 3, 1):    # no budget; one group of 4 a micro-batch; below a group
        cut = replace(cfg, optim=replace(cfg.optim, micro_batch_tokens=tokens))
        trained = make_tiny_model(tokenizer, seed=1)
        opt = torch.optim.AdamW(trained.parameters(), lr=1e-3)
        update_policy(learner_for(cut, trained, opt), batch)
        after[tokens] = torch.cat([p.detach().flatten() for p in trained.parameters()])
    assert sizes == [16, 4, 4, 4, 4, 4, 4, 4, 4]
    assert torch.allclose(after[0], after[per_group + 3], atol=1e-6)
    assert torch.allclose(after[0], after[1], atol=1e-6)
    before = torch.cat([p.detach().flatten() for p in make_tiny_model(tokenizer, seed=1).parameters()])
    assert (after[0] - before).abs().max() > 1e-4   # (the update moved the weights)
