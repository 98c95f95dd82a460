"""LoRA through peft: the reference is the base model (adapters off), only adapters train, and
the saved model is the base with the adapters merged in."""

import json

import pytest

import torch
from transformers import AutoModelForCausalLM

from posttrain.config.sections import LoraConfig
from posttrain.config.options import load_config
from posttrain.model.loading import add_lora
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rl.loop import train
from posttrain.data.source import build_task
from posttrain.model.prompts import encode_prompts
from posttrain.rollout.forward import frozen_logprobs
from tests.conftest import make_tiny_model
from tests.test_trainer import reward_curve, toy_config


def test_reference_logprobs_are_the_base_models(tokenizer):
    base = make_tiny_model(tokenizer, seed=5)
    copy = make_tiny_model(tokenizer, seed=5)
    model = add_lora(base, LoraConfig(rank=4))
    for n, p in model.named_parameters():   # make the adapters matter (lora_B starts at 0)
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    task = build_task(load_config(None, ["--data.eval_size", "3"]).data)
    rollout = make_engine("hf", model, tokenizer).generate(
        encode_prompts(tokenizer, task.eval_problems, None), 2, SamplingParams(5),
        torch.Generator().manual_seed(0))
    with model.disable_adapter():
        ref = frozen_logprobs(model, rollout, 1.0, micro=4)
    torch.testing.assert_close(ref, frozen_logprobs(copy, rollout, 1.0, micro=4))
    assert not torch.allclose(frozen_logprobs(model, rollout, 1.0, micro=4), ref, atol=1e-3)


def test_lora_trains_only_adapters_and_saves_merged(tmp_path, tokenizer):
    # (learning itself is shown on the real model, see docs/scaling.md: a random tiny model's
    # near-uniform head gives a body-only adapter almost nothing to steer)
    cfg = toy_config(tmp_path, "--steps", "4", "--optim.lr", "3e-2", "--lora.rank", "8",
                     "--algorithm.kl_coef", "0.02", "--checkpoint.every_steps", "2")
    model = make_tiny_model(tokenizer, seed=0)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    assert len(reward_curve(tmp_path / "run")) == 4
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "adapter" / "adapter_config.json").is_file()
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    kls = [r["policy/kl_ref"] for r in rows if "reward/mean" in r]
    assert kls[0] == pytest.approx(0.0, abs=1e-6) and max(kls) > 0   # ref = start, then it moves
    # training touched only adapters: merging is the only way the base weights changed, and the
    # merged model differs from the start exactly in the adapted projection matrices
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final_model").state_dict()
    assert set(merged) <= set(start)     # a plain model again (lm_head may be tied, not saved)
    changed = {k for k in merged if not torch.equal(merged[k], start[k])}
    assert changed and all(k.endswith("proj.weight") for k in changed), changed
    assert not any("lora" in k for k in merged)
