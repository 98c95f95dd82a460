"""`posttrain tinker-serve --sampler vllm`, driven by the real `tinker` SDK: the base model in
vLLM's CPU build, each sampler revision's adapter a vLLM LoRA. What a client samples carries the
log-probs its training client computes for the same weights, greedy samples are the in-process
sampler's, and a sampling session keeps sampling the revision it was made from.

The engine takes about 20 s to start here; the module starts one, in the full suite (README):
the quick one checks vLLM's engine in tests/test_vllm_cpu.py."""

from __future__ import annotations

import platform
import sys

import pytest
import torch

from tests.test_vllm_cpu import tiny  # noqa: F401  (the fixture: a tiny Llama vLLM takes, saved)

if not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")):
    pytest.skip("vLLM has no CPU build for this platform", allow_module_level=True)

import tinker  # noqa: E402
from tinker import types  # noqa: E402

RANK = 4


@pytest.fixture(scope="module")
def server(tiny, tokenizer, tmp_path_factory):   # noqa: F811  (the imported fixture)
    from posttrain.tinker.server import start_server
    model, folder = tiny
    with pytest.MonkeyPatch.context() as mp:
        srv = start_server(model, tokenizer, "tiny", tmp_path_factory.mktemp("tinker-vllm"),
                           sampler="vllm", folder=str(folder), max_lora_rank=8)
        mp.setenv("TINKER_BASE_URL", srv.base_url)
        mp.setenv("TINKER_API_KEY", "tml-local")
        mp.setenv("TINKER_TELEMETRY", "0")
        yield srv
        srv.shutdown()


def trained_client(tokenizer, lr: float = 5e-2):
    """A training client one step away from its start (its adapter no longer zero)."""
    tc = tinker.ServiceClient().create_lora_training_client(base_model="tiny", rank=RANK, seed=1).result()
    step(tc, tokenizer, lr)
    return tc


def step(tc, tokenizer, lr: float) -> None:
    ids = tokenizer("Count: one two three four")["input_ids"]
    d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    tc.forward_backward([d], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def trainer_logprobs(tc, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    full = prompt + tokens
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [0.0] * (len(full) - 1)})
    out = tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    return torch.tensor(out.tolist())[len(prompt) - 1:]


def draw(sampler, prompt: list[int], n: int = 3, **params):
    return sampler.sample(types.ModelInput.from_ints(prompt), num_samples=n,
                          sampling_params=types.SamplingParams(**params)).result().sequences


@pytest.mark.slow
def test_vllm_samples_carry_the_log_probs_the_trainer_computes(server, tokenizer):
    from posttrain.tinker.sampler_vllm import VllmSampler
    vllm_sampler = server.service.sampling
    assert isinstance(vllm_sampler, VllmSampler)     # (the in-process sampler would pass the rest)
    written = len(vllm_sampler.written)
    tc = trained_client(tokenizer)
    sampler = tc.save_weights_and_get_sampling_client().result()
    base = tinker.ServiceClient().create_sampling_client(base_model="tiny").result()
    prompt = tokenizer("Count: one")["input_ids"]
    seqs = draw(sampler, prompt, max_tokens=6, temperature=1.0, seed=7)
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) > 1
    for s in seqs:
        trained = trainer_logprobs(tc, prompt, s.tokens)
        torch.testing.assert_close(torch.tensor(s.logprobs), trained, atol=2e-3, rtol=0)
    # the adapter is in what vLLM computed: the base model gives these tokens other log-probs
    on_base = base.compute_logprobs(types.ModelInput.from_ints(prompt + seqs[0].tokens)).result()
    assert max(abs(a - b) for a, b in zip(on_base[len(prompt):], seqs[0].logprobs)) > 0.05
    again = draw(sampler, prompt, max_tokens=6, temperature=1.0, seed=7)
    assert [s.tokens for s in again] == [s.tokens for s in seqs]   # (each sample: its seed's)
    assert len(vllm_sampler.written) == written + 1   # one adapter written for the one revision


@pytest.mark.slow
def test_vllm_greedy_samples_are_the_in_process_samplers(server, tokenizer):
    from posttrain.tinker.sampler import sample
    tc = trained_client(tokenizer)
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompts = [tokenizer(t)["input_ids"] for t in ("Count: one", "The sky is", "2 + 2 =")]
    revision = server.service.revisions.get(sampler._sampling_session_id)
    for prompt in prompts:
        [got] = draw(sampler, prompt, n=1, max_tokens=8, temperature=0.0)
        request = {"prompt": {"chunks": [{"tokens": prompt}]}, "num_samples": 1,
                   "sampling_params": {"max_tokens": 8, "temperature": 0.0}}
        [([want], _)] = sample(server.service.models, revision, [request], torch.Generator())
        assert got.tokens == want.tokens and got.stop_reason == ("stop" if want.stopped else "length")


@pytest.mark.slow
def test_a_vllm_sampling_session_stays_on_its_revision(server, tokenizer):
    tc = trained_client(tokenizer)
    first = tc.save_weights_and_get_sampling_client().result()
    prompt = tokenizer("Count: one")["input_ids"]
    [before] = draw(first, prompt, n=1, max_tokens=6, temperature=0.0)
    step(tc, tokenizer, 0.2)                       # the training client moves on
    second = tc.save_weights_and_get_sampling_client().result()
    [after] = draw(first, prompt, n=1, max_tokens=6, temperature=0.0)
    assert after.tokens == before.tokens and after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    new = trainer_logprobs(tc, prompt, before.tokens)   # the trainer's weights now
    assert (new - torch.tensor(before.logprobs)).abs().max() > 0.05
    # and the new revision samples the new weights
    [moved] = draw(second, prompt, n=1, max_tokens=6, temperature=1.0, seed=0)
    torch.testing.assert_close(torch.tensor(moved.logprobs), trainer_logprobs(tc, prompt, moved.tokens),
                               atol=2e-3, rtol=0)


def test_a_rank_vllm_does_not_take_is_refused_in_one_line_before_any_model_loads(capsys):
    from posttrain.cli import main
    assert main(["tinker-serve", "--sampler", "vllm", "--vllm_max_lora_rank", "7"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--vllm_max_lora_rank 7: one of 1, 8, 16, 32" in err and len(err.splitlines()) == 1, err


def test_a_revision_saved_over_its_session_id_is_a_new_vllm_adapter_and_a_rank_over_the_limit_is_refused(tmp_path):
    """Without an engine: what names an adapter vLLM samples. A client that saves unnamed
    sampler weights without a sequence id gets the same session id each time, and a named
    sampler checkpoint can be saved over: neither may keep sampling the first weights."""
    import time
    from posttrain.tinker.revisions import Revision, Revisions, write_checkpoint
    from posttrain.tinker.sampler_vllm import VllmSampler
    from posttrain.tinker.wire import WireError
    from collections import OrderedDict
    sampler = object.__new__(VllmSampler)   # (the bookkeeping alone: no engine)
    sampler.models = type("M", (), {"name": "tiny"})()
    sampler.max_lora_rank, sampler.run_dir, sampler.next_id = 8, tmp_path, 1
    sampler.adapters, sampler.written = tmp_path / "adapters", OrderedDict()
    revisions, lora = Revisions(), {"rank": 4}
    state = {"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 8)}
    first = revisions.add(Revision("s:sample:0", "tiny", lora, state))
    again = sampler.lora_request(revisions.get("s:sample:0"))
    assert sampler.lora_request(first).lora_int_id == again.lora_int_id == 1   # (written once)
    revisions.add(Revision("s:sample:0", "tiny", lora, {k: v + 1 for k, v in state.items()}))
    assert sampler.lora_request(revisions.get("s:sample:0")).lora_int_id == 2
    path = "tinker://s:train:0/sampler_weights/w"
    write_checkpoint(tmp_path, path, state, {"lora": lora})
    saved = revisions.add(Revision("s:sample:1", "tiny", lora, None, path))
    read = Revision(saved.sampler_id, "tiny", lora, state, path, saved.serial)
    assert sampler.lora_request(read).lora_int_id == sampler.lora_request(read).lora_int_id == 3
    time.sleep(0.01)
    write_checkpoint(tmp_path, path, {k: v + 2 for k, v in state.items()}, {"lora": lora})   # saved over
    assert sampler.lora_request(read).lora_int_id == 4
    assert (sampler.adapters / "4" / "adapter_config.json").is_file()
    with pytest.raises(WireError, match="LoRA rank 16 is over the vLLM sampler's 8: start tinker-serve "
                                        "with a larger --vllm_max_lora_rank"):
        sampler.lora_request(Revision("s:sample:2", "tiny", {"rank": 16}, state))
