"""On-policy distillation through the one loop (ALGORITHMS.md §8), on tiny models."""

import copy
import json

import pytest
import torch

from posttrain.config import ConfigError, load_config
from posttrain.models import check_same_tokenizer, save_model
from posttrain.trainer import train
from tests.conftest import make_tiny_model

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


def test_exact_reverse_kl_loss_lowers_the_exact_kl(tmp_path, tokenizer):
    """distill_loss='exact': the full-vocabulary reverse KL at every position is the loss."""
    cfg = load_config(None, [*OPD, "--teacher.path", str(peaked_teacher(tokenizer, tmp_path / "t")),
                             "--algorithm.distill_loss", "exact", "--steps", "12",
                             "--optim.lr", "5e-4", "--optim.schedule", "cosine",
                             "--run_dir", str(tmp_path / "run")])
    train(cfg, model=sharpened(tokenizer, 40.0), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    kl = [r["distill/reverse_kl_exact"] for r in rows if "distill/reverse_kl_exact" in r]
    assert len(kl) == 12 and kl[-1] < 0.5 * kl[0], kl
