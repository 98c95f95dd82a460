"""`posttrain tinker-serve` driven by the real `tinker` SDK (0.38, as its authors publish it on
PyPI) on a tiny random model with the real tokenizer: the numbers a Tinker client gets back are
those posttrain's formulas give, computed here independently with peft and torch."""

from __future__ import annotations

import http.client
import json
import math
import threading
import time
import typing
import urllib.error
import urllib.request

import pytest
import torch

import tinker
from tinker import types

from tests.conftest import make_tiny_model
from posttrain.losses.common import token_logprobs

RANK, SEED = 4, 3


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory, monkeypatch_module):
    from posttrain.tinker.server import start_server
    srv = start_server(make_tiny_model(tokenizer), tokenizer, "tiny", tmp_path_factory.mktemp("tinker"),
                       batch_clients=True)
    monkeypatch_module.setenv("TINKER_BASE_URL", srv.base_url)
    monkeypatch_module.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch_module.setenv("TINKER_TELEMETRY", "0")
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def service(server):
    return tinker.ServiceClient()


def datum(tokenizer, text: str, **inputs) -> types.Datum:
    ids = tokenizer(text)["input_ids"]
    n = len(ids) - 1
    fields = {"target_tokens": ids[1:], **{k: (v * n if isinstance(v, list) else v) for k, v in inputs.items()}}
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=fields)


def local_lora(tokenizer):
    """The client's model as peft builds it from the same seed: what the server must match."""
    from peft import LoraConfig, get_peft_model
    base = make_tiny_model(tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        model = get_peft_model(base, LoraConfig(
            r=RANK, lora_alpha=RANK, lora_dropout=0.0, target_modules=[
                "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]))
    return model.eval()


def local_logp(model, d: types.Datum) -> torch.Tensor:
    ids = torch.tensor([d.model_input.to_ints()])
    logits = model(input_ids=ids).logits[0].float()
    return token_logprobs(logits, torch.tensor(d.loss_fn_inputs["target_tokens"].tolist()))


def logprobs(out) -> list[torch.Tensor]:
    return [torch.tensor(o["logprobs"].tolist()) for o in out.loss_fn_outputs]


def test_forward_backward_and_optim_step_give_posttrains_numbers(service, tokenizer):
    """cross_entropy's loss:sum is -sum w logp; one AdamW step moves the adapter exactly as the
    same step taken here with torch on a peft model built from the same seed."""
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    data = [datum(tokenizer, "What is 2 + 3? 5", weights=[0.5]),
            datum(tokenizer, "Say hi. Hi there!", weights=[1.0])]
    out = tc.forward_backward(data, "cross_entropy").result()
    model = local_lora(tokenizer)
    logp = [local_logp(model, d) for d in data]
    loss = sum(-(torch.tensor(d.loss_fn_inputs["weights"].tolist()) * lp).sum() for d, lp in zip(data, logp))
    assert out.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-5)
    for got, want in zip(logprobs(out), logp):
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)
    tc.optim_step(types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95, eps=1e-8)).result()
    loss.backward()
    torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, betas=(0.9, 0.95),
                      eps=1e-8, weight_decay=0.0).step()
    after = tc.forward(data, "cross_entropy").result()
    for got, before, want in zip(logprobs(after), logp, [local_logp(model, d) for d in data]):
        assert not torch.allclose(got, before.detach(), atol=1e-4)         # it moved
        torch.testing.assert_close(got, want.detach(), atol=1e-5, rtol=0)  # as it moves here


def test_samples_carry_the_log_probs_the_trainer_computes(service, tokenizer):
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    d = datum(tokenizer, "Count: one two three", weights=[1.0])
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer("Count: one")["input_ids"]
    res = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    assert len(res.sequences) == 3 and all(s.stop_reason == "length" for s in res.sequences)
    for s in res.sequences:
        full = prompt + s.tokens
        check = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})
        trained = logprobs(tc.forward([check], "cross_entropy").result())[0][len(prompt) - 1:]
        torch.testing.assert_close(torch.tensor(s.logprobs), trained, atol=1e-4, rtol=0)
    again = sampler.sample(types.ModelInput.from_ints(prompt), num_samples=3,
                           sampling_params=types.SamplingParams(max_tokens=5, temperature=1.0, seed=7)).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences]   # (the seed)


def test_save_state_then_load_resumes_bit_identically(service, tokenizer):
    a = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    data = [datum(tokenizer, "The sky is blue.", weights=[1.0])]
    adam = types.AdamParams(learning_rate=1e-2)
    for _ in range(2):
        a.forward_backward(data, "cross_entropy").result()
        a.optim_step(adam).result()
    path = a.save_state("two").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/two")
    b = service.create_training_client_from_state_with_optimizer(path).result()
    for client in (a, b):     # the same third step: Adam's moments and step count came back
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
    la, lb = (logprobs(c.forward(data, "cross_entropy").result())[0] for c in (a, b))
    assert torch.equal(la, lb)
    fresh = service.create_training_client_from_state(path).result()   # (weights only: Adam starts over)
    fresh.forward_backward(data, "cross_entropy").result()
    fresh.optim_step(adam).result()
    assert not torch.equal(logprobs(fresh.forward(data, "cross_entropy").result())[0], la)


def test_two_clients_on_one_base_see_neither_weights_nor_gradients_of_the_other(service, tokenizer):
    a = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    b = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    data = [datum(tokenizer, "Apples are red.", weights=[1.0])]
    base = logprobs(b.forward(data, "cross_entropy").result())[0]
    a.forward_backward(data, "cross_entropy").result()        # a's gradient waits for a's step
    b.forward_backward(data, "cross_entropy").result()
    b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    b_after = logprobs(b.forward(data, "cross_entropy").result())[0]
    assert torch.equal(logprobs(a.forward(data, "cross_entropy").result())[0], base)   # a untouched
    a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert torch.equal(logprobs(a.forward(data, "cross_entropy").result())[0], b_after)  # same step
    assert torch.equal(logprobs(b.forward(data, "cross_entropy").result())[0], b_after)  # b untouched


def test_every_builtin_loss_is_served_with_its_formula_or_refused_in_one_line(service, tokenizer):
    from posttrain.tinker.losses import REFUSED, TINKER_LOSSES
    names = set(typing.get_args(types.LossFnType))
    assert names == set(TINKER_LOSSES.names()) | set(REFUSED)
    lp, s, adv = torch.tensor([math.log(1.5), math.log(0.5)]), torch.zeros(2), torch.tensor([1.0, -1.0])
    x = {"logprobs": s, "advantages": adv}
    # ppo: r = (1.5, 0.5) clipped to (1.2, 0.8): -min(1.5, 1.2) - min(-0.5, -0.8) = -1.2 + 0.8
    assert float(TINKER_LOSSES["ppo"](lp, x, {}).sum()) == pytest.approx(-0.4)
    assert float(TINKER_LOSSES["importance_sampling"](lp, x, {}).sum()) == pytest.approx(-1.0)
    # cispo: -sg[clip r] A logp = -1.2 log 1.5 + 0.8 log 0.5
    assert float(TINKER_LOSSES["cispo"](lp, x, {}).sum()) == pytest.approx(-1.2 * math.log(1.5) + 0.8 * math.log(0.5))
    # dro: -(A logp - beta/2 (logp - s)^2)
    want = -(math.log(1.5) - 0.05 * math.log(1.5) ** 2) - (-math.log(0.5) - 0.05 * math.log(0.5) ** 2)
    assert float(TINKER_LOSSES["dro"](lp, x, {"beta": 0.1}).sum()) == pytest.approx(want)
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    d = datum(tokenizer, "One more.", logprobs=[0.0], advantages=[1.0])
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce.*not served"):
        tc.forward_backward([d], "stable_reinforce").result()
    out = tc.forward_backward([d], "ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}).result()
    assert math.isfinite(out.metrics["loss:sum"])


def test_a_wrong_request_is_one_line_naming_what_to_fix(service, tokenizer):
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    bad = datum(tokenizer, "Too few weights.", weights=[1.0])
    bad.loss_fn_inputs["weights"] = types.TensorData(data=[1.0], dtype="float32", shape=[1])
    with pytest.raises(tinker.RequestFailedError, match="'weights' has 1 values for \\d+ input tokens"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(Exception, match="base_model 'Qwen/Qwen3-8B' is not served here"):
        service.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=RANK).result()


def _post(url: str, headers: dict[str, str]) -> int:
    req = urllib.request.Request(url, data=b"{}", headers={"Content-Type": "application/json", **headers})
    try:
        return urllib.request.urlopen(req, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_foreign_host_or_wrong_key_is_refused(server, tokenizer, tmp_path):
    url = f"{server.base_url}/api/v1/create_session"
    assert _post(url, {}) == 200
    assert _post(url, {"Host": "evil.example:80"}) == 403
    from posttrain.tinker.server import start_server
    with pytest.raises(ValueError, match="not loopback.*needs --api_key"):
        start_server(make_tiny_model(tokenizer), tokenizer, "tiny", tmp_path, host="0.0.0.0")
    keyed = start_server(make_tiny_model(tokenizer), tokenizer, "tiny", tmp_path, api_key="tml-secret")
    try:
        assert _post(f"{keyed.base_url}/api/v1/create_session", {"X-API-Key": "tml-other"}) == 401
        assert _post(f"{keyed.base_url}/api/v1/create_session", {"X-API-Key": "tml-secret"}) == 200
    finally:
        keyed.shutdown()


def test_the_wire_messages_read_back_through_the_sdks_own_decoders():
    from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
    from posttrain.tinker.wire import Sequence, forward_backward_output, sample_response
    out = deserialize_forward_backward_output(forward_backward_output(
        [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])], {"loss:sum": 3.5}))
    assert [o["logprobs"].tolist() for o in out.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    assert out.metrics == {"loss:sum": 3.5}
    res = deserialize_sample_response(sample_response(
        [Sequence([5, 6], [-0.25, -0.5], True), Sequence([7], [-1.0], False)], [math.nan, -2.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences] == [
        ([5, 6], [-0.25, -0.5], "stop"), ([7], [-1.0], "length")]
    assert res.prompt_logprobs == [None, -2.0]
    assert json.loads(json.dumps(out.metrics)) == {"loss:sum": 3.5}


def test_concurrent_sample_requests_share_a_batch_and_get_what_each_gets_alone(service, tokenizer, server):
    """The cookbook's RL loop sends one sample request per rollout; waiting requests with the same
    sampler and settings run as one batch, and each sample is a function of its own seed."""
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [tokenizer(t)["input_ids"] for t in ("Hi", "What is 12 + 30?", "Name a colour.")]
    params = [types.SamplingParams(max_tokens=4, temperature=1.0, seed=s) for s in (1, 2, 3)]
    alone = [sampler.sample(types.ModelInput.from_ints(p), 2, sp).result() for p, sp in zip(prompts, params)]
    calls = []
    original = server.service.asample
    server.service.asample = lambda bodies: calls.append([b["sampling_params"]["seed"] for b in bodies]) or original(bodies)
    from posttrain.tinker.futures import _Batched
    gate = threading.Event()
    server.worker.submit(gate.wait)            # (the worker busy until all three are queued)
    try:
        futures = [sampler.sample(types.ModelInput.from_ints(p), 2, sp) for p, sp in zip(prompts, params)]
        deadline = time.monotonic() + 30
        while sum(isinstance(e.task, _Batched) for e in server.worker.ready) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        gate.set()
        together = [f.result() for f in futures]
    finally:
        gate.set()
        server.service.asample = original
    assert [sorted(c) for c in calls] == [[1, 2, 3]]   # (one batch, each request run once)
    for a, b in zip(alone, together):
        assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
        for x, y in zip(a.sequences, b.sequences):
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_saved_sampler_weights_sample_on_a_restarted_server_with_no_training_client(service, server, tokenizer):
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    tc.forward_backward([datum(tokenizer, "Red, green, blue.", weights=[1.0])], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler("named").result().path
    with pytest.raises(tinker.RequestFailedError, match="exists"):
        tc.save_state("dup").result()
        tc.save_state("dup").result()
    prompt = types.ModelInput.from_ints(tokenizer("Red,")["input_ids"])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=11)
    here = service.create_sampling_client(model_path=path).sample(prompt, 2, params).result()
    from posttrain.tinker.server import start_server
    again = start_server(make_tiny_model(tokenizer), tokenizer, "tiny", server.service.run_dir)
    try:
        other = tinker.ServiceClient(base_url=again.base_url)
        there = other.create_sampling_client(model_path=path).sample(prompt, 2, params).result()
    finally:
        again.shutdown()
    assert [s.tokens for s in there.sequences] == [s.tokens for s in here.sequences]
    for x, y in zip(here.sequences, there.sequences):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-5, rtol=0)


def test_a_batch_too_long_for_one_forward_is_split_and_gives_the_same_numbers(service, tokenizer, monkeypatch):
    import posttrain.tinker.models as models
    data = [datum(tokenizer, t, weights=[1.0]) for t in ("One two three four.", "Five six.", "Seven.")]
    outs = []
    for budget in (models.MICRO_BATCH_TOKENS, 8):        # (8 tokens: one datum a forward)
        monkeypatch.setattr(models, "MICRO_BATCH_TOKENS", budget)
        tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
        out = tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        outs.append((out, logprobs(tc.forward(data, "cross_entropy").result())))
    assert outs[0][0].metrics["loss:sum"] == pytest.approx(outs[1][0].metrics["loss:sum"], rel=1e-6)
    for a, b in zip(outs[0][1], outs[1][1]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_sample_options_not_computed_here_are_refused_before_sampling(service, tokenizer):
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(Exception, match="topk_sample_logprobs not served"):
        sampler.sample(types.ModelInput.from_ints(tokenizer("Hi")["input_ids"]), 1,
                       types.SamplingParams(max_tokens=2), topk_sample_logprobs=3).result()


def test_each_training_client_has_its_tensorboard_run(service, server, tokenizer):
    """RUN_DIR/clients/ID/tensorboard: every forward_backward's and optim_step's metrics of that
    client, at the optimizer step its gradients go into (what metrics.jsonl holds for every client)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from posttrain.tinker.revisions import safe
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    data = [datum(tokenizer, "What is 2 + 3? 5", weights=[1.0])]
    first = tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
    second = tc.forward_backward(data, "cross_entropy").result()
    server.service.clients.trackers[tc.model_id].writer.flush()
    events = EventAccumulator(str(server.service.run_dir / "clients" / safe(tc.model_id) / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("forward_backward/loss:sum")]
    assert loss == [(1, pytest.approx(first.metrics["loss:sum"], rel=1e-6)),
                    (2, pytest.approx(second.metrics["loss:sum"], rel=1e-6))]
    assert [(e.step, e.value) for e in events.Scalars("optim_step/lr")] == [(1, pytest.approx(3e-3))]


def test_a_client_that_went_away_is_not_a_server_error(server, monkeypatch, caplog):
    """A client that closed its connection (killed while it long-polled a future) gets nothing
    and logs nothing: a server fault is logged and answered 500, a closed connection is not."""
    import posttrain.tinker.server as srv
    def gone(s, b):
        raise BrokenPipeError(32, "Broken pipe")
    def broken(s, b):
        raise RuntimeError("a real fault")
    url = f"{server.base_url}/api/v1/healthz"
    for route, answered in ((gone, False), (broken, True)):
        monkeypatch.setattr(srv, "GET_ROUTES", [(srv.GET_ROUTES[0][0], route), *srv.GET_ROUTES[1:]])
        caplog.clear()
        try:
            status = urllib.request.urlopen(url, timeout=10).status
        except urllib.error.HTTPError as e:
            status = e.code
        except (ConnectionError, http.client.RemoteDisconnected):
            status = None
        assert (status == 500) == answered and ("failed" in caplog.text) == answered


def _queued(server, n: int, owners: tuple[str, ...] = ()) -> None:
    """Wait until n batched requests, among them one of each of `owners` (training clients),
    wait in the worker's queue (the SDK sends from its threads, in any order)."""
    from posttrain.tinker.futures import _Batched
    deadline = time.monotonic() + 120
    while True:
        waiting = [e for e in list(server.worker.ready) if isinstance(e.task, _Batched)]
        if len(waiting) >= n and set(owners) <= {e.owner for e in waiting}:
            return
        assert time.monotonic() < deadline, f"{n} requests of {owners} were not queued in 120 s"
        time.sleep(0.05)


def _two_trained_clients(service, tokenizer):
    """Two clients whose adapters differ (one step each on its own text), as the batch must keep them."""
    a = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    b = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED + 1).result()
    for tc, text in ((a, "Apples are red."), (b, "Seven eight nine.")):
        tc.forward_backward([datum(tokenizer, text, weights=[1.0])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return a, b


def wire_request(tc, data: list, loss_fn: str):
    """The request the server decodes from `tc.forward_backward(data, loss_fn)`."""
    from posttrain.tinker.wire import Datum, ForwardBackward
    return ForwardBackward(tc.model_id, 0, loss_fn, False, {}, [
        Datum(d.model_input.to_ints(), {k: torch.tensor(v.tolist()) for k, v in d.loss_fn_inputs.items()})
        for d in data])


def test_two_clients_forward_backwards_run_as_one_batch_with_what_each_gets_alone(service, tokenizer, server):
    """Two clients' forward_backwards in one forward (each row through its own adapter) and one
    backward: each client's log-probs, loss and next step are those its request alone gives
    through the SDK. (The batch is run here, with the worker idle; the worker's joining of
    waiting requests is the next test's.)"""
    data = {0: [datum(tokenizer, "What is 2 + 3? 5", weights=[1.0]), datum(tokenizer, "Hi!", weights=[0.5])],
            1: [datum(tokenizer, "Name a colour: blue", weights=[1.0])]}
    results = []
    for together in (False, True):
        clients = _two_trained_clients(service, tokenizer)
        same = [datum(tokenizer, "Hi!", weights=[1.0])]   # (a row through the other's adapter differs)
        assert not torch.allclose(*(logprobs(tc.forward(same, "cross_entropy").result())[0]
                                    for tc in clients), atol=1e-4)
        if together:
            reqs = [wire_request(tc, data[k], "cross_entropy") for k, tc in enumerate(clients)]
            outs = [(lp, m["loss:sum"]) for lp, m in server.service.models.forward_backward(reqs)]
        else:
            outs = [(logprobs(o), o.metrics["loss:sum"]) for o in
                    (tc.forward_backward(data[k], "cross_entropy").result() for k, tc in enumerate(clients))]
        for tc in clients:
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        after = [logprobs(tc.forward(data[k], "cross_entropy").result()) for k, tc in enumerate(clients)]
        results.append((outs, after))
    (alone, alone_after), (batched, batched_after) = results
    for k in (0, 1):
        assert batched[k][1] == pytest.approx(alone[k][1], rel=1e-5)
        for x, y in zip(list(batched[k][0]) + batched_after[k], alone[k][0] + alone_after[k]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)


def test_a_batch_keeps_each_clients_order_and_fails_a_wrong_request_alone(service, tokenizer, server):
    """A client's forward_backward after its optim_step never joins a batch before that step; a
    wrong request in a batch fails alone, the other client's request in it is answered."""
    a, b = _two_trained_clients(service, tokenizer)
    good = [datum(tokenizer, "Apples are red.", weights=[1.0])]
    bad = datum(tokenizer, "Too few weights.", weights=[1.0])
    bad.loss_fn_inputs["weights"] = types.TensorData(data=[1.0], dtype="float32", shape=[1])
    calls = []
    original = server.service.forward_backward
    server.service.forward_backward = lambda reqs: calls.append([(r.model_id, r.seq_id) for r in reqs]) or original(reqs)
    gate = threading.Event()
    server.worker.submit(gate.wait)
    try:
        first = a.forward_backward(good, "cross_entropy")
        step = a.optim_step(types.AdamParams(learning_rate=5e-2))
        second = a.forward_backward(good, "cross_entropy")
        wrong = b.forward_backward([bad], "cross_entropy")
        no_beta = b.forward_backward([datum(tokenizer, "Hi!", logprobs=[-1.0], advantages=[1.0])], "dro")
        _queued(server, 4, (a.model_id, b.model_id))
        gate.set()
        first.result(), step.result(), second.result()
        with pytest.raises(tinker.RequestFailedError, match="'weights' has 1 values"):
            wrong.result()
        with pytest.raises(tinker.RequestFailedError, match="'dro' needs loss_fn_config"):
            no_beta.result()
    finally:
        gate.set()
        server.service.forward_backward = original
    seqs = {mid: sorted(s for c in calls for m, s in c if m == mid) for mid in (a.model_id, b.model_id)}
    a_first, a_second = seqs[a.model_id]
    batch_of = {(m, s): i for i, c in enumerate(calls) for m, s in c}
    assert batch_of[(a.model_id, a_first)] != batch_of[(a.model_id, a_second)]   # the step between
    assert batch_of[(b.model_id, seqs[b.model_id][0])] == batch_of[(a.model_id, a_first)]


def test_a_training_clients_folder_is_a_run_the_viewer_shows_token_by_token(service, server, tokenizer):
    """RUN_DIR/clients/ID holds metrics.jsonl and tokens/step_N.parquet: each recorded datum's
    target tokens with the log-probs the client got back, its sampler's, their ratio and the
    advantages, as `posttrain view` reads a training run's."""
    from posttrain.tinker.revisions import safe
    from posttrain.view.server import Viewer, check_runs
    tc = service.create_lora_training_client(base_model="tiny", rank=RANK, seed=SEED).result()
    d = datum(tokenizer, "What is 2 + 3? 5", logprobs=[-1.5], advantages=[0.0])
    d.loss_fn_inputs["advantages"] = types.TensorData(data=[0.0] * 8 + [0.5] * (len(d.model_input.to_ints()) - 8),
                                                      dtype="float32", shape=[len(d.model_input.to_ints())])
    out = tc.forward_backward([d], "importance_sampling").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.forward_backward([datum(tokenizer, "Hi!", weights=[1.0])], "cross_entropy").result()
    viewer = Viewer(check_runs([server.service.run_dir / "clients" / safe(tc.model_id)]))
    assert viewer.answer("steps", {}) == [1, 2]
    (rec,) = viewer.answer("rollouts", {"step": "1"})
    targets = d.loss_fn_inputs["target_tokens"].tolist()
    assert rec["token_ids"] == targets and rec["tokens"] == [tokenizer.decode([t]) for t in targets]
    logp = logprobs(out)[0]
    torch.testing.assert_close(torch.tensor(rec["logp"]), logp, atol=1e-6, rtol=0)
    assert rec["logp_sampler"] == [-1.5] * len(targets)
    torch.testing.assert_close(torch.tensor(rec["ratio"]), torch.exp(logp + 1.5), rtol=1e-5, atol=0)
    assert rec["in_loss"] == [0] * 8 + [1] * (len(targets) - 8) and rec["adv"][-1] == 0.5
    metrics = viewer.answer("metrics", {})
    assert [(m["step"], sorted(k for k in m if "/" in k)[0]) for m in metrics] == [
        (1, "forward_backward/batched_with"), (1, "optim_step/grad_norm:mean"), (2, "forward_backward/batched_with")]
    assert metrics[0]["forward_backward/loss:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-6)


def test_a_batch_that_fails_partway_takes_back_its_gradients_and_runs_each_request_alone(
        service, tokenizer, server, monkeypatch):
    """One datum a forward: a's rows go backward before b's loss fails. a's gradient is then
    exactly what a's request alone gives (not twice it), and only b's request fails."""
    import posttrain.tinker.models as models
    monkeypatch.setattr(models, "MICRO_BATCH_TOKENS", 8)
    real = models.check_loss
    def broken(logp, x, config):
        raise RuntimeError("a loss that fails")
    monkeypatch.setattr(models, "check_loss", lambda name: broken if name == "cispo" else real(name))
    data = [datum(tokenizer, "What is 2 + 3? 5", weights=[1.0]), datum(tokenizer, "Hi!", weights=[1.0])]
    ref, _ = _two_trained_clients(service, tokenizer)
    ref.forward_backward(data, "cross_entropy").result()
    want = [p.grad.clone() for p in server.service.models.run(ref.model_id).params]
    a, b = _two_trained_clients(service, tokenizer)
    calls = []
    original = server.service.models.forward_backward
    def spy(reqs):
        calls.append([r.model_id for r in reqs])
        return original(reqs)
    monkeypatch.setattr(server.service.models, "forward_backward", spy)
    reqs = [wire_request(a, data, "cross_entropy"),
            wire_request(b, [datum(tokenizer, "Hi!", logprobs=[-1.0], advantages=[1.0])], "cispo")]
    answers = server.service.forward_backward(reqs)        # (the worker idle: run here)
    assert isinstance(answers[0], bytes) and "a loss that fails" in str(answers[1])
    assert calls == [[a.model_id, b.model_id], [a.model_id], [b.model_id]]   # together, then each alone
    got = [p.grad for p in server.service.models.run(a.model_id).params]
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
