"""What the vLLM backend needs from the trainer, tested on CPU without vLLM: engine output packed
into a Rollout, and the truncated importance-sampling correction for another engine's log-probs.
(The engine itself runs in benchmarks/gpu_check.py --backend vllm.)"""

import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from posttrain.config.commands import ConfigError
from posttrain.config.options import load_config
from posttrain.losses.correction import truncated_is_weights
from posttrain.rewards import Scorer
from posttrain.rollout import HFRolloutEngine, make_engine
from posttrain.rollout.vllm import (Completion, completion_from_openai, completion_from_vllm,
                                    request_seed, to_rollout)
from posttrain.sampling.collect import generate_and_score
from posttrain.sampling.setup import SamplingSetup
from posttrain.rl.update import update_policy
from posttrain.data.source import PromptStream, build_task
from tests.conftest import make_tiny_model, learner_for
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
    stats = update_policy(learner_for(cfg, model, opt, sched), replace(batch, adv_B_T=adv))
    after = torch.cat([p.detach().flatten() for p in model.parameters()])
    return after - before, stats


def test_another_engines_logprobs_reweight_the_update_by_the_capped_ratio(tmp_path, tokenizer):
    """Engine log-probs lower than the trainer's by log 1.5 on every token: each token's gradient
    is weighted by 1.5, or by the cap when it is lower; the mismatch is logged."""
    cfg = toy_config(tmp_path, "--steps", "1", "--optim.max_grad_norm", "1e9")
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", make_tiny_model(tokenizer, seed=11), tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
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
        return [[Completion([p[0], 10 + g], [-0.5, -0.1], False) for g in range(G)] for p in prompts]

    def close(self):
        pass


class FakePush:
    def __init__(self, fingerprint, version=0):
        self.fingerprint, self.version, self.sent = fingerprint, version, 0

    def send(self, model, engines, owner):
        from posttrain.rollout.vllm import Pushed
        self.sent += 1
        return Pushed(self.version, self.fingerprint)

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
    behind = FakeEngine("c", holds=[1.0, 2.0])      # the right weights under an older version
    with pytest.raises(RuntimeError, match="engine c holds weight version 0 after the push of version 1"):
        VLLMRolloutEngine(make_tiny_model(tokenizer), tokenizer, [behind], FakePush([1.0, 2.0], 1))
    engine.close()


def test_the_weight_fingerprint_sees_every_matrix_and_not_vllms_fusing():
    """The trainer's tensors and the engine's (q, k, v fused into one, gate and up fused, the
    vocabulary padded with zero rows, another order) give the same fingerprint; one matrix that
    kept its old values, changed by 1e-4 in each entry, gives another."""
    from posttrain.rollout.vllm_worker import fingerprint, same_fingerprint
    g = torch.Generator().manual_seed(0)
    w = {n: torch.randn(*shape, generator=g) * 0.02 for n, shape in (
        ("q", (64, 32)), ("k", (16, 32)), ("v", (16, 32)), ("gate", (48, 32)), ("up", (48, 32)),
        ("down", (32, 48)), ("embed", (100, 32)))}
    w["norm"] = torch.ones(32) + torch.randn(32, generator=g) * 0.01
    engine = {"embed": torch.cat([w["embed"], torch.zeros(28, 32)]), "down": w["down"],
              "gate_up": torch.cat([w["gate"], w["up"]]), "norm": w["norm"],
              "qkv": torch.cat([w["q"], w["k"], w["v"]])}
    trainer = fingerprint(w.items())
    assert same_fingerprint(trainer, fingerprint(engine.items()))
    for name in ("down", "gate_up", "embed"):    # one matrix stale: the load missed it
        stale = {**engine, name: engine[name] + 1e-4 * torch.randn(*engine[name].shape, generator=g)}
        assert not same_fingerprint(trainer, fingerprint(stale.items())), name
    assert not same_fingerprint(trainer, fingerprint({**engine, "norm": w["norm"] + 1e-6}.items()))
    cheap = fingerprint(w.items(), whole=False)     # (between full checks: no whole-matrix sums)
    assert cheap[4:] == [None, None] and same_fingerprint(cheap, fingerprint(engine.items()))
    for name in ("down", "gate_up", "embed"):
        stale = {**engine, name: engine[name] + 1e-4 * torch.randn(*engine[name].shape, generator=g)}
        assert not same_fingerprint(cheap, fingerprint(stale.items(), whole=False)), name


def test_pushes_are_checked_fully_first_and_every_tenth():
    from posttrain.rollout.vllm_push import SharedMemoryPush
    assert [v for v in range(25) if SharedMemoryPush.full(v)] == [0, 10, 20]


def test_requests_are_shared_out_and_a_failing_server_is_dropped_by_name(tokenizer, caplog):
    from posttrain.rollout.base import SamplingParams
    from posttrain.rollout.vllm import VLLMRolloutEngine
    a, b = FakeEngine("http://a", holds=[1.0, 1.0]), FakeEngine("http://b", holds=[1.0, 1.0])
    engine = VLLMRolloutEngine(make_tiny_model(tokenizer), tokenizer, [a, b], FakePush([1.0, 1.0]))
    in_order = [[1, 10], [1, 11], [3, 10], [3, 11], [4, 10], [4, 11]]   # each prompt's answers
    out = engine.generate([[1, 2], [3], [4, 5, 6]], 2, SamplingParams(max_new_tokens=2))
    assert out.response_ids_B_T.tolist() == in_order
    assert a.calls.count("complete") == 1 == b.calls.count("complete")
    b.fails = True
    with caplog.at_level("WARNING", logger="posttrain"):
        out = engine.generate([[1, 2], [3], [4, 5, 6]], 2, SamplingParams(max_new_tokens=2))
    assert out.response_ids_B_T.tolist() == in_order and "vLLM server http://b dropped" in caplog.text
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
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg,
                                                engine=make_engine("hf", make_tiny_model(tokenizer, seed=11), tokenizer),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(build_task(cfg.data), 0),
                                                generator=torch.Generator().manual_seed(0)), Counter())
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
    from posttrain.rl.frozen import frozen_passes
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


def test_weight_folders_go_however_the_run_ends_and_avoid_a_small_dev_shm(tmp_path, monkeypatch,
                                                                           caplog):
    import gc
    import shutil
    from collections import namedtuple
    from posttrain.rollout import vllm_weights
    state = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
    folders = vllm_weights.WeightFolders(torch.float32, root=tmp_path)
    first, version, _ = folders.write(state)
    second, _, _ = folders.write(state)
    third, _, _ = folders.write(state)           # (written while the engines sampled)
    folders.loaded(second)
    assert version == 0 and not first.exists() and second.exists() and third.exists()
    del folders                      # dropped without close(), as when a step raises
    gc.collect()
    assert list(tmp_path.iterdir()) == []
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(64e6, 0, 64e6 - 1))
    with caplog.at_level("WARNING", logger="posttrain"):
        assert vllm_weights.shared_memory_root(32_000_000) != Path("/dev/shm")
    assert "/dev/shm has 0.06 GB free" in caplog.text
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1e12, 0, 1e12))
    assert vllm_weights.shared_memory_root(32_000_000) == Path("/dev/shm")
    # asynchronous training holds three versions: room for two is not enough
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1e9, 0, 80e6))
    assert vllm_weights.shared_memory_root(32_000_000, copies=2) == Path("/dev/shm")
    assert vllm_weights.shared_memory_root(32_000_000, copies=3) != Path("/dev/shm")


def test_the_engines_context_holds_the_answer_or_episode_within_the_models_positions():
    from posttrain.rollout import engine_context
    cfg = load_config(None, [])
    assert engine_context(cfg, 8192) == 4096                      # 2048 + 24 new tokens: the floor
    long = load_config(None, ["--rollout.max_new_tokens", "8192"])
    assert engine_context(long, 131072) == 2048 + 8192
    assert engine_context(long, 8192) == 8192                    # never past the model's positions
    episode = load_config(None, ["--env.max_tokens", "6000"])
    assert engine_context(episode, None) == 2048 + 6000


def test_weight_push_choices_are_checked_against_the_engines_before_anything_starts():
    for args, message in ((["--rollout.vllm_weight_push", "ipc", "--rollout.vllm_launch", "1"],
                           "'ipc' reaches an engine in this process only"),
                          (["--rollout.vllm_weight_push", "nccl"], "exactly one server"),
                          (["--rollout.vllm_weight_push", "nccl", "--rollout.vllm_launch", "2"],
                           r"name 2\)")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, args)


def test_the_bf16_copys_sync_builds_no_graph(tokenizer):
    """The copy takes the policy's weights as plain values: no gradient reaches it, and no
    autograd graph grows with every step."""
    policy = make_tiny_model(tokenizer)
    engine = HFRolloutEngine(policy, tokenizer, weights="bfloat16")
    with torch.enable_grad():
        engine.sync_weights()
    assert all(not p.requires_grad and p.grad_fn is None for p in engine.model.parameters())
    assert torch.equal(next(engine.model.parameters()).float(),
                       next(policy.parameters()).detach().bfloat16().float())


def test_a_closed_kept_alive_connection_is_retried_once_and_a_dead_server_is_gone(monkeypatch):
    """'Remote end closed connection without response' between two steps of a run was a server
    closing an idle kept-alive connection, not a dead server: one more try on a new connection."""
    import requests
    from posttrain.rollout.vllm import EngineGone
    from posttrain.rollout.vllm_engines import ServerEngine
    server = ServerEngine("http://127.0.0.1:9", timeout_s=5.0)
    answers = [requests.ConnectionError("Remote end closed connection without response"),
               SimpleNamespace(status_code=200, content=b"{}", json=lambda: {"ok": 1})]

    def post(url, json, timeout):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer
    monkeypatch.setattr(server.http, "post", post)
    assert server._post("/v1/completions", {}) == {"ok": 1} and answers == []
    answers[:] = [requests.ConnectionError("refused"), requests.ConnectionError("refused")]
    with pytest.raises(EngineGone, match="refused"):
        server._post("/v1/completions", {})
