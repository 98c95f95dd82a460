"""The update module's contracts: metrics read from the device once per update, and a scored batch
whose select / merge / to keep every field."""

import dataclasses
import os
import sys
from collections import Counter

import pytest
import torch

import posttrain
from tests.conftest import make_tiny_model
from posttrain.batch import ScoredBatch, merge
from posttrain.config import load_config
from posttrain.data.source import Sampler, build_task
from posttrain.data.tasks import Problem
from posttrain.rewards import Scorer
from posttrain.rollout import Rollout, make_engine
from posttrain.trainer import generate_and_score
from posttrain.update import Metrics, update_policy

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
    its value model too): every metric reaches the host in the one `tolist` at the end."""
    cfg = load_config(None, [*TOY, "--run_dir", str(tmp_path / "run"), "--preset", preset,
                             "--optim.epochs", "2", "--optim.minibatches", "2",
                             "--optim.micro_batch_size", "4", "--algorithm.kl_coef", "0.0"])
    model = make_tiny_model(tokenizer, seed=1)
    batch, _ = generate_and_score(make_engine("hf", model, tokenizer), tokenizer,
                                  Sampler(build_task(cfg.data), 0), Scorer(cfg.reward), cfg, cfg.algo,
                                  torch.Generator().manual_seed(0), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape) * batch.loss_mask_B_T
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    critic = targets = None
    if preset == "ppo":
        from posttrain.critic import Critic
        from posttrain.update import ValueTargets
        critic = Critic(cfg.critic, model)
        targets = ValueTargets(torch.zeros_like(adv), adv.clone())
    syncs = _Syncs(monkeypatch)
    stats = update_policy(model, opt, sched, batch, adv, cfg, cfg.algo, torch.Generator().manual_seed(0),
                          critic=critic, targets=targets)
    assert dict(syncs.calls) == {"tolist": 1}
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
                       teacher_view=r if with_optional else None, trainer_old_logp_B_T=opt(-3.0))


def test_a_scored_batch_is_immutable_and_select_merge_keep_every_field():
    b = _batch(5, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.rewards_B = torch.zeros(4)
    s = b.select(torch.tensor([2, 3]))
    for f in dataclasses.fields(ScoredBatch):
        assert getattr(s, f.name) is not None, f.name
    assert s.completions == ["c2", "c3"] and s.rewards_B.tolist() == [2.0, 3.0]
    assert s.trainer_old_logp_B_T.shape == (2, 5) and s.teacher_view.response_ids_B_T.shape == (2, 5)
    m = merge([_batch(5, True), _batch(3, True)], pad_id=0)
    assert m.ref_logp_B_T.shape == (8, 5) and (m.ref_logp_B_T[4:, 3:] == 0).all()
    assert m.teacher_logp_B_T[4:, :3].eq(-2.0).all() and m.teacher_view.response_ids_B_T.shape == (8, 5)
    assert len(m.problems) == 8 and m.loss_mask_B_T[4:, 3:].sum() == 0
    assert merge([_batch(5, False), _batch(3, False)], 0).ref_logp_B_T is None
    with pytest.raises(ValueError, match="ref_logp_B_T is set in some parts"):
        merge([_batch(5, True), _batch(3, False)], 0)
