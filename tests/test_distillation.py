"""On-policy distillation through the one loop (docs/algorithms.md §8), on tiny models."""

import copy
import json
from dataclasses import replace

import pytest
import torch

from posttrain.sampling.setup import SamplingSetup

from posttrain.config.commands import ConfigError
from posttrain.config.options import load_config
from posttrain.model.loading import check_same_tokenizer, save_model
from posttrain.rl.loop import train
from tests.conftest import make_tiny_model, learner_for

OPD = ["--preset", "opd", "--reward.verifier", "none", "--data.eval_size", "0",
       "--rollout.max_new_tokens", "4", "--tensorboard", "false", "--threads", "2"]


def sharpened(tokenizer, scale: float):
    """A tiny model whose next-token distributions are sharper by `scale` (final norm weight)."""
    model = make_tiny_model(tokenizer, seed=1)
    with torch.no_grad():
        model.model.norm.weight.mul_(scale)
    return model


def peaked_teacher(tokenizer, folder, tok=None):
    """The student's own weights, half as sharp. (The student is kept peaked, as a pretrained LM
    is: a near-uniform random model over 49k tokens makes the sampled estimate pure noise.)"""
    teacher = sharpened(tokenizer, 20.0)
    save_model(teacher, tok or tokenizer, folder)
    return folder


@pytest.mark.slow   # (25 steps; the exact-KL losses learn in the quick suite)
def test_distillation_lowers_the_reverse_kl_to_the_teacher(tmp_path, tokenizer):
    cfg = load_config(None, [*OPD, "--teacher.path", str(peaked_teacher(tokenizer, tmp_path / "t")),
                             "--steps", "25", "--optim.lr", "5e-4", "--optim.schedule", "cosine", "--rollout.group_size", "8", "--run_dir", str(tmp_path / "run")])
    train(cfg, model=sharpened(tokenizer, 40.0), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    kl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    assert len(kl) == 25
    # kl[0] is measured on samples of the untouched student
    assert sum(kl[-5:]) / 5 < 0.5 * kl[0], kl


def test_distillation_needs_a_teacher():
    with pytest.raises(ConfigError, match="teacher.path"):
        load_config(None, OPD)


def test_mismatched_tokenizer_is_refused_before_training(tmp_path, tokenizer):
    other = copy.deepcopy(tokenizer)
    other.add_tokens(["<posttrain-extra>"])
    with pytest.raises(ConfigError, match="vocabulary sizes differ \\(49152 vs 49153\\)"):
        check_same_tokenizer(tokenizer, other)
    check_same_tokenizer(tokenizer, copy.deepcopy(tokenizer))
    folder = peaked_teacher(tokenizer, tmp_path / "t", tok=other)
    cfg = load_config(None, [*OPD, "--teacher.path", str(folder), "--steps", "1",
                             "--run_dir", str(tmp_path / "run")])
    with pytest.raises(ConfigError, match="tokenizers differ"):
        train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("loss", ["exact", pytest.param("forward", marks=pytest.mark.slow)])
def test_exact_kl_losses_lower_the_exact_reverse_kl(tmp_path, tokenizer, loss):
    """distill_loss='exact' ('forward'): the full-vocabulary reverse (forward) KL at every position
    is the loss; either brings the logged reverse KL down."""
    cfg = load_config(None, [*OPD, "--teacher.path", str(peaked_teacher(tokenizer, tmp_path / "t")),
                             "--algorithm.distill_loss", loss, "--steps", "12",
                             "--optim.lr", "5e-4", "--optim.schedule", "cosine",
                             "--run_dir", str(tmp_path / "run")])
    train(cfg, model=sharpened(tokenizer, 40.0), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    kl = [r["distill/reverse_kl_exact"] for r in rows if "distill/reverse_kl_exact" in r]
    assert len(kl) == 12 and kl[-1] < 0.5 * kl[0], kl


def test_opsd_teacher_logprobs_line_up_under_a_longer_privileged_context(tmp_path, tokenizer):
    """§8 OPSD: the teacher's prompt holds the answer and is longer; its log-probs of the student's
    response tokens equal a plain forward of (teacher prompt + response), token for token."""
    from collections import Counter
    from posttrain.rewards import Scorer
    from posttrain.rollout import make_engine
    from posttrain.sampling.collect import generate_and_score
    from posttrain.rl.frozen import teacher_view
    from posttrain.data.source import PromptStream, build_task
    from posttrain.model.prompts import encode_prompts
    from posttrain.rollout.forward import frozen_logprobs
    cfg = load_config(None, [*OPD, "--teacher.path", "self", "--teacher.context_template",
                             "{prompt} (The reference answer is {answer}.)",
                             "--rollout.prompts_per_step", "3", "--rollout.group_size", "2"])
    model = make_tiny_model(tokenizer, seed=2).double()
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", model, tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    view = teacher_view(batch, cfg, tokenizer)
    assert view.prompt_ids_B_L.shape[1] > batch.rollout.prompt_ids_B_L.shape[1]
    assert torch.equal(view.response_ids_B_T, batch.rollout.response_ids_B_T)
    teacher_logp = frozen_logprobs(model, view, 1.0, micro=4)
    for i, problem in enumerate(batch.problems):
        assert str(problem.answer) in tokenizer.decode(view.prompt_ids_B_L[i])
        prompt = encode_prompts(tokenizer, [problem], None)[0]
        shown = encode_prompts(tokenizer, [problem.__class__(
            f"{problem.prompt} (The reference answer is {problem.answer}.)", problem.answer)], None)[0]
        assert len(shown) > len(prompt)
        n = int(batch.rollout.lengths_B[i])
        ids = torch.tensor([shown + batch.rollout.response_ids_B_T[i, :n].tolist()])
        logits = model(input_ids=ids).logits[0, len(shown) - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, ids[0, len(shown):, None]).squeeze(-1)
        torch.testing.assert_close(teacher_logp[i, :n], expected, rtol=1e-6, atol=1e-6)


def test_opsd_trains_the_student_against_itself_with_privileged_context(tmp_path, tokenizer):
    cfg = load_config(None, [*OPD, "--teacher.path", "self", "--teacher.context_template",
                             "{prompt} Answer: {answer}", "--steps", "3",
                             "--run_dir", str(tmp_path / "run")])
    model = make_tiny_model(tokenizer, seed=3)
    before = [p.detach().clone() for p in model.parameters()]
    train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    assert all(p.requires_grad for p in model.parameters())          # the student is not frozen
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(r["distill/reverse_kl"] != 0.0 for r in rows if "distill/reverse_kl" in r)


@pytest.mark.parametrize("overrides,msg", [
    (["--teacher.path", "self"], "needs teacher.context_template"),
    (["--teacher.path", "self", "--teacher.context_template", "{question}"], "cannot be filled"),
    (["--teacher.path", "self", "--teacher.context_template", "{answer} only"], "must contain"),
])
def test_opsd_config_errors(overrides, msg):
    with pytest.raises(ConfigError, match=msg):
        load_config(None, [*OPD, *overrides])


def test_mopd_routes_each_domain_to_its_teacher_loaded_lazily_and_shared(tmp_path, tokenizer):
    from collections import Counter
    from posttrain.config.sections import TeacherConfig
    from posttrain.rewards import Scorer
    from posttrain.rollout import make_engine
    from posttrain.rl.teachers import Teachers
    from posttrain.sampling.collect import generate_and_score
    from posttrain.data.source import PromptStream, build_task
    from posttrain.rollout.forward import frozen_logprobs
    a = make_tiny_model(tokenizer, seed=11)
    b = make_tiny_model(tokenizer, seed=12)
    save_model(a, tokenizer, tmp_path / "a")
    save_model(b, tokenizer, tmp_path / "b")
    teachers = Teachers(TeacherConfig(domains={"addition": str(tmp_path / "a"),
                                               "arithmetic": str(tmp_path / "a"),
                                               "countdown": str(tmp_path / "b")}), tokenizer)
    assert teachers.loaded == 0                                   # nothing loaded before use
    assert teachers.model_for("addition") is teachers.model_for("arithmetic")   # shared
    assert teachers.loaded == 1

    cfg = load_config(None, [*OPD, "--teacher.domains.addition", str(tmp_path / "a"),
                             "--teacher.domains.countdown", str(tmp_path / "b"),
                             "--data.task", "addition+countdown", "--rollout.group_size", "2"])
    student = make_tiny_model(tokenizer, seed=13)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", student, tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    domains = [p.domain for p in batch.problems]
    assert set(domains) == {"addition", "countdown"}
    score = lambda m, view: frozen_logprobs(m, view, 1.0, 8)  # noqa: E731
    routed = teachers.logprobs(batch.rollout, domains, score)
    by_a, by_b = score(a, batch.rollout), score(b, batch.rollout)
    for i, d in enumerate(domains):
        torch.testing.assert_close(routed[i], (by_a if d == "addition" else by_b)[i])
    assert not torch.allclose(by_a, by_b)
    # exact distillation: full teacher logits, routed the same way, for any subset of groups
    from posttrain.rollout.forward import response_logits
    rows = torch.arange(len(domains))[2:]
    logits = teachers.response_logits(batch.rollout, rows, domains, "none")
    r = batch.rollout
    for k, i in enumerate(rows.tolist()):
        m = a if domains[i] == "addition" else b
        want = response_logits(m, replace(r, group_size=1), slice(i, i + 1))[0]
        n = int(r.lengths_B[i])
        torch.testing.assert_close(logits[k, :n], want[:n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("loss", ["sampled", pytest.param("exact", marks=pytest.mark.slow)])
def test_mopd_run_logs_per_domain_metrics(tmp_path, tokenizer, loss):
    save_model(make_tiny_model(tokenizer, seed=11), tokenizer, tmp_path / "a")
    save_model(make_tiny_model(tokenizer, seed=12), tokenizer, tmp_path / "b")
    cfg = load_config(None, [*OPD, "--teacher.domains.addition", str(tmp_path / "a"),
                             "--teacher.domains.countdown", str(tmp_path / "b"),
                             "--data.task", "addition+countdown", "--steps", "2",
                             "--algorithm.distill_loss", loss,
                             "--data.eval_size", "4", "--run_dir", str(tmp_path / "run")])
    summary = train(cfg, model=make_tiny_model(tokenizer, seed=13), tokenizer=tokenizer,
                    show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    kl = "distill/reverse_kl" if loss == "sampled" else "distill/reverse_kl_exact"
    steps = [r for r in rows if kl in r]
    assert len(steps) == 2
    for r in steps:
        # the whole batch's KL is a token-weighted mean of the two domains' KLs, so between them
        lo, hi = sorted((r[f"{kl}@addition"], r[f"{kl}@countdown"]))
        assert lo - 1e-5 <= r[kl] <= hi + 1e-5, r
        assert lo != hi and 0.0 <= r["reward/accuracy@countdown"] <= 1.0
        if loss != "sampled":
            assert lo > 0.0   # an exact KL between two different random models
    assert "eval/accuracy@countdown" in summary["eval_after"]


@pytest.mark.parametrize("teacher_temperature", [None, 0.5])
def test_exact_loss_targets_the_teacher_at_its_own_temperature(tmp_path, tokenizer,
                                                               teacher_temperature):
    """teacher.temperature: the exact loss is KL(softmax(z_S / T) || softmax(z_T / T_teacher))."""
    from collections import Counter
    from posttrain.rollout.forward import response_logits
    from posttrain.losses.kl import exact_kl_from_logits
    from posttrain.rewards import Scorer
    from posttrain.rollout import make_engine
    from posttrain.rl.teachers import Teachers
    from posttrain.sampling.collect import generate_and_score
    from posttrain.rl.update import update_policy
    from posttrain.data.source import PromptStream, build_task
    extra = ["--teacher.temperature", str(teacher_temperature)] if teacher_temperature else []
    cfg = load_config(None, [*OPD, "--teacher.path", "t", "--algorithm.distill_loss", "exact",
                             "--rollout.temperature", "0.8", *extra])
    student, teacher = sharpened(tokenizer, 20.0), sharpened(tokenizer, 10.0)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", student, tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
    r, m = batch.rollout, batch.loss_mask_B_T
    with torch.no_grad():
        one = replace(r, group_size=1)   # (every row its own prompt pass)
        zs, zt = response_logits(student, one), response_logits(teacher, one)
        t_teacher = teacher_temperature or 0.8
        kl = exact_kl_from_logits(zs, zt * (0.8 / t_teacher), 0.8)
    expected = ((kl * m).sum() / m.sum()).item()
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    stats = update_policy(learner_for(cfg, student, opt,
                                      teachers=Teachers(cfg.teacher, tokenizer, preloaded=teacher)),
                          replace(batch, adv_B_T=torch.zeros_like(m)))
    assert stats["distill/reverse_kl_exact"] == pytest.approx(expected, rel=1e-4)
    if teacher_temperature:   # a sharper target is further from this student than the plain one
        plain = exact_kl_from_logits(zs, zt, 0.8)
        assert expected != pytest.approx(((plain * m).sum() / m.sum()).item(), rel=1e-2)
