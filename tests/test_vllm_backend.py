"""What the vLLM backend needs from the trainer, tested on CPU without vLLM: engine output packed
into a Rollout, and the truncated importance-sampling correction for another engine's log-probs.
(The engine itself runs in benchmarks/gpu_check.py --backend vllm.)"""

import math
import sys
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.options import load_config
from posttrain.losses.correction import truncated_is_weights
from posttrain.rewards import Scorer
from posttrain.rollout import make_engine
from posttrain.rollout.vllm import (Completion, completion_from_openai, completion_from_vllm,
                                    request_seed, to_rollout)
from posttrain.collect import generate_and_score
from posttrain.update import update_policy
from posttrain.data.source import Sampler, build_task
from tests.conftest import make_tiny_model
from tests.test_trainer import toy_config


def test_truncated_is_weights_by_hand():
    trainer = torch.tensor([[-1.0, -2.0, -0.1]])
    engine = torch.tensor([[-1.5, -1.0, -3.1]])
    w = truncated_is_weights(trainer, engine, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5), math.exp(-1.0), 2.0]]))
    assert not w.requires_grad


def test_vllm_and_openai_outputs_pack_into_a_rollout():
    def step(tok, lp):   # vLLM: one {token_id: Logprob} dict per generated token
        return {tok: SimpleNamespace(logprob=lp)}
    outs = [SimpleNamespace(token_ids=[5, 6, 2], logprobs=[step(5, -0.5), step(6, -1.0), step(2, -0.1)],
                            finish_reason="stop"),
            SimpleNamespace(token_ids=[7], logprobs=[step(7, -2.0)], finish_reason="length")]
    completions = [completion_from_vllm(o) for o in outs]
    completions += [completion_from_openai({"index": 0, "token_ids": [9, 9],
                                            "logprobs": {"token_logprobs": [-0.3, -0.4]},
                                            "finish_reason": "length"}),
                    Completion([], [], False)]
    r = to_rollout([[1, 2, 3], [4]], 2, completions, pad_id=0)
    assert r.prompt_ids_B_L.tolist() == [[1, 2, 3], [1, 2, 3], [0, 0, 4], [0, 0, 4]]
    assert r.response_ids_B_T.tolist() == [[5, 6, 2], [7, 0, 0], [9, 9, 0], [0, 0, 0]]
    assert r.response_mask_B_T.tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0], [0, 0, 0]]
    torch.testing.assert_close(r.logp_B_T, torch.tensor([[-0.5, -1.0, -0.1], [-2.0, 0, 0],
                                                         [-0.3, -0.4, 0], [0, 0, 0]]))
    assert r.truncated_B.tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="3 completions for 2 prompts x 2"):
        to_rollout([[1], [2]], 2, completions[:3], 0)
    # a prompt's request seed is its first response's seed; vLLM gives child g the seed + g
    seeds = torch.tensor([40, 41, 90, 91])
    assert [request_seed(seeds, i, 2) for i in range(2)] == [40, 90]
    assert request_seed(None, 0, 2) is None


def _update(tokenizer, batch, cfg, adv):
    model = make_tiny_model(tokenizer, seed=11)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
    stats = update_policy(model, opt, sched, replace(batch, adv_B_T=adv), cfg, cfg.algo,
                          torch.Generator().manual_seed(0))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return after - before, stats


def test_another_engines_logprobs_reweight_the_update_by_the_capped_ratio(tmp_path, tokenizer):
    """Engine log-probs lower than the trainer's by log 1.5 on every token: each token's gradient
    is weighted by 1.5, or by the cap when it is lower; the mismatch is logged."""
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.max_grad_norm", "1e9")
    batch, _ = generate_and_score(make_engine("hf", make_tiny_model(tokenizer, seed=11), tokenizer),
                                  tokenizer, Sampler(build_task(cfg.data), 0), Scorer(cfg.reward), cfg,
                                  cfg.algo, torch.Generator().manual_seed(0), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape, generator=torch.Generator().manual_seed(1))
    adv = adv * batch.loss_mask_B_T
    plain, stats = _update(tokenizer, batch, cfg, adv)
    assert stats["rollout/logp_mismatch"] < 1e-4 and "rollout/tis_weight_mean" not in stats

    mask = batch.rollout.response_mask_B_T
    foreign = replace(batch, rollout=replace(batch.rollout,
                                             logp_B_T=(batch.rollout.logp_B_T - math.log(1.5)) * mask))
    for cap, factor in ((2.0, 1.5), (1.2, 1.2)):
        vcfg = replace(cfg, rollout=replace(cfg.rollout, backend="vllm", tis_cap=cap))
        delta, stats = _update(tokenizer, foreign, vcfg, adv)
        torch.testing.assert_close(delta, factor * plain, atol=1e-6, rtol=1e-4)
        assert stats["rollout/logp_mismatch"] == pytest.approx(math.log(1.5), abs=1e-4)
        assert stats["rollout/is_ratio_max"] == pytest.approx(1.5, rel=1e-3)
        assert stats["rollout/tis_weight_mean"] == pytest.approx(factor, rel=1e-4)
    # without the correction, a single update ignores the engine's numbers entirely
    vcfg = replace(cfg, rollout=replace(cfg.rollout, backend="vllm", tis_cap=None))
    delta, _ = _update(tokenizer, foreign, vcfg, adv)
    torch.testing.assert_close(delta, plain, atol=1e-6, rtol=1e-4)


def test_vllm_options_are_checked_before_anything_loads():
    for args, message in ((["--rollout.tis_cap", "0.5"], "rollout.tis_cap=0.5 must be >= 1"),
                          (["--rollout.vllm_servers", "localhost:8000"], "must be a URL"),
                          (["--rollout.vllm_cpu_kv_cache_gb", "0"], "must be >= 1"),
                          (["--rollout.backend", "vllm", "--lora.rank", "8"], "LoRA"),
                          (["--rollout.vllm_gpu_memory_utilization", "1.5"], "must be <= 1")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, args)


def test_without_vllm_the_backend_says_how_to_install_it(tokenizer, monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)     # as on a machine without vLLM
    with pytest.raises(RuntimeError, match=r"scripts/install-cpu.sh .*pip install \"posttrain\[vllm\]\""):
        make_engine("vllm", make_tiny_model(tokenizer), tokenizer, model_path="x",
                    rollout_cfg=load_config(None, []).rollout, dtype="float32", seed=0,
                    max_model_len=64)


class FakeEngine:
    """An engine that records what is asked of it and holds what the push gives it."""

    def __init__(self, name, holds=None, fails=False):
        self.name, self.holds, self.fails, self.calls, self.reported = name, holds, fails, [], None

    def rpc(self, method, kwargs):
        self.calls.append(method)
        if self.fails:
            from posttrain.rollout.vllm import EngineGone
            raise EngineGone("connection refused")
        return [{"version": 0, "fingerprint": self.holds}]

    def reset_prefix_cache(self):
        self.calls.append("reset")

    def complete(self, prompts, G, kwargs, seeds):
        self.calls.append("complete")
        if self.fails:
            from posttrain.rollout.vllm import EngineGone
            raise EngineGone("connection refused")
        return [[Completion([7, 2], [-0.5, -0.1], False)] * G for _ in prompts]

    def close(self):
        pass


class FakePush:
    def __init__(self, fingerprint):
        self.fingerprint, self.sent = fingerprint, 0

    def send(self, model, engines, owner):
        self.sent += 1
        return self.fingerprint

    def loaded(self):
        pass

    def close(self):
        pass


def test_a_weight_sync_checks_each_engine_and_empties_its_prefix_cache(tokenizer):
    """vLLM keeps prefix-cache keys and values across weight loads; after a push they belong to
    the old weights, so each engine's cache is reset, once it reported the trainer's weights."""
    from posttrain.rollout.vllm import VLLMRolloutEngine
    good = FakeEngine("a", holds=[1.0, 2.0])
    engine = VLLMRolloutEngine(make_tiny_model(tokenizer), tokenizer, [good], FakePush([1.0, 2.0]))
    assert good.calls == ["posttrain_state", "reset"]
    stale = FakeEngine("b", holds=[9.0, 2.0])
    with pytest.raises(RuntimeError, match="engine b holds weights other than the trainer's"):
        VLLMRolloutEngine(make_tiny_model(tokenizer), tokenizer, [stale], FakePush([1.0, 2.0]))
    engine.close()


def test_requests_are_shared_out_and_a_failing_server_is_dropped_by_name(tokenizer, caplog):
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.vllm import VLLMRolloutEngine
    a, b = FakeEngine("http://a", holds=[1.0]), FakeEngine("http://b", holds=[1.0])
    engine = VLLMRolloutEngine(make_tiny_model(tokenizer), tokenizer, [a, b], FakePush([1.0]))
    out = engine.generate([[1, 2], [3], [4, 5, 6]], 2, SamplingParams(max_new_tokens=2))
    assert out.response_ids_B_T.shape == (6, 2) and a.calls.count("complete") == 1 == b.calls.count("complete")
    b.fails = True
    with caplog.at_level("WARNING", logger="posttrain"):
        out = engine.generate([[1, 2], [3]], 2, SamplingParams(max_new_tokens=2))
    assert out.response_ids_B_T.shape == (4, 2) and "vLLM server http://b dropped" in caplog.text
    a.fails = True
    with pytest.raises(RuntimeError, match="every vLLM engine failed: http://b: connection refused; "
                                           "http://a: connection refused"):
        engine.generate([[1]], 1, SamplingParams(max_new_tokens=2))


def test_the_bf16_copy_is_corrected_like_another_engine(tmp_path, tokenizer):
    """rollout.weights='bfloat16' samples from a copy: the same truncated IS weights as vLLM,
    and a single update takes pi_old from its own forward (no extra pass over the batch)."""
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.max_grad_norm", "1e9",
                     "--rollout.weights", "bfloat16")
    assert cfg.rollout.off_trainer
    batch, _ = generate_and_score(make_engine("hf", make_tiny_model(tokenizer, seed=11), tokenizer),
                                  tokenizer, Sampler(build_task(cfg.data), 0), Scorer(cfg.reward), cfg,
                                  cfg.algo, torch.Generator().manual_seed(0), Counter())
    adv = torch.randn(batch.loss_mask_B_T.shape, generator=torch.Generator().manual_seed(1))
    adv = adv * batch.loss_mask_B_T
    shared = replace(cfg, rollout=replace(cfg.rollout, weights="shared"))
    plain, _ = _update(tokenizer, batch, shared, adv)
    mask = batch.rollout.response_mask_B_T
    off = replace(batch, rollout=replace(batch.rollout,
                                         logp_B_T=(batch.rollout.logp_B_T - math.log(1.5)) * mask))
    delta, stats = _update(tokenizer, off, cfg, adv)
    torch.testing.assert_close(delta, 1.5 * plain, atol=1e-6, rtol=1e-4)
    assert stats["rollout/tis_weight_mean"] == pytest.approx(1.5, rel=1e-4)
    # the trainer's own pi_old pass runs only when a later update needs it
    from posttrain.trainer import frozen_passes
    model = make_tiny_model(tokenizer, seed=11)
    for extra, passes in (([], 0), (["--optim.minibatches", "2"], 1)):
        c = toy_config(tmp_path, "--rollout.weights", "bfloat16", "--algorithm.kl_coef", "0", *extra)
        run = SimpleNamespace(cfg=c, algo=c.algo, model=model, teachers=None, lora=False,
                              tokenizer=tokenizer)
        timings = Counter()
        out, _ = frozen_passes(run, off, timings)
        assert ("old_logprobs" in timings) == bool(passes)
        assert (out.trainer_old_logp_B_T is not None) == bool(passes)
        if passes:
            torch.testing.assert_close(out.old_logp_B_T * mask, batch.rollout.logp_B_T, atol=1e-5, rtol=0)
    for args, message in ((["--rollout.weights", "bfloat16", "--rollout.autocast", "bfloat16"],
                           "rollout.autocast=none"),
                          (["--rollout.weights", "bfloat16", "--rollout.backend", "vllm"],
                           "rollout.backend=hf")):
        with pytest.raises(ConfigError, match=message):
            toy_config(tmp_path, *args)
