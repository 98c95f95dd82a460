"""The in-process sampler: shared-prefix prefill, row pruning, EOS and stop strings, top-p."""

import pytest
import torch

from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.hf import HFRolloutEngine, left_pad, sample_next
from posttrain.model.prompts import encode_prompts
from posttrain.data.tasks import Problem


def prompts(tokenizer, texts):
    return encode_prompts(tokenizer, [Problem(t, "") for t in texts], None)


def test_batched_greedy_equals_one_prompt_at_a_time(tokenizer, tiny_model):
    """Left padding, the shared prompt cache and dropping finished rows change no output."""
    model = tiny_model.double()
    engine = make_engine("hf", model, tokenizer)
    ps = prompts(tokenizer, ["What is 1 + 1?", "A much longer prompt, with many more tokens in it.", "Hi"])
    params = SamplingParams(8, greedy=True)
    together = engine.generate(ps, 2, params)
    for i, p in enumerate(ps):
        alone = engine.generate([p], 1, params)
        T = int(alone.lengths_B[0])
        for row in (2 * i, 2 * i + 1):       # both group members are greedy copies
            assert together.response_ids_B_T[row, :T].tolist() == alone.response_ids_B_T[0, :T].tolist()
            torch.testing.assert_close(together.logp_B_T[row, :T], alone.logp_B_T[0, :T])


def test_eos_ends_a_row_and_truncation_is_flagged(tokenizer, tiny_model):
    engine = make_engine("hf", tiny_model, tokenizer)
    eos = tokenizer.eos_token_id
    with torch.no_grad():   # make EOS the only likely token
        tiny_model.get_output_embeddings().weight[eos] *= 0
        tiny_model.get_output_embeddings().weight[eos] += 10 * tiny_model.model.norm.weight.sign()
    out = engine.generate(prompts(tokenizer, ["x", "yy"]), 2, SamplingParams(6),
                          torch.Generator().manual_seed(0))
    assert (out.lengths_B >= 1).all() and out.lengths_B.max() <= 6
    ended = out.response_ids_B_T[torch.arange(4), out.lengths_B.long() - 1] == eos
    assert torch.equal(~ended, out.truncated_B)
    assert ended.any()


def test_stop_strings_end_the_response(tokenizer, tiny_model):
    engine = make_engine("hf", tiny_model, tokenizer)
    p = prompts(tokenizer, ["Count: one two three"])
    free = engine.generate(p, 1, SamplingParams(8, greedy=True))
    third = tokenizer.decode(free.response_ids_B_T[0, 2:3])
    stopped = engine.generate(p, 1, SamplingParams(8, greedy=True, stop=(third,)))
    n = int(stopped.lengths_B[0])
    assert n <= 3 and third in tokenizer.decode(stopped.response_ids_B_T[0, :n])
    assert not stopped.truncated_B[0]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, SamplingParams(top_p=0.7), g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    tok, logp = sample_next(logits, SamplingParams(top_p=0.7), g)
    # the log-prob under the distribution drawn from: the nucleus renormalised (0.5, 0.3) / 0.8,
    # as vLLM records it
    torch.testing.assert_close(logp, torch.log(torch.tensor([0.625, 0.375]))[tok])


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_hashed_sampling_draws_from_the_distribution_independently():
    """Seeded draws (inverse CDF at a hashed uniform, one seed per response) follow softmax(z / T):
    token frequencies over 40 000 responses within 4 standard errors, and the draws of two
    responses of one group (consecutive seeds) and of one response at two steps independent."""
    from posttrain.rollout.hf import row_seeds
    n, G = 10_000, 4
    seeds = row_seeds(7, list(range(n)), G)
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]).repeat(n * G, 1)
    p = torch.softmax(logits[0] / 0.8, -1)
    draws = [sample_next(logits, SamplingParams(4, temperature=0.8), None, seeds, t)[0]
             for t in range(2)]
    freq = torch.bincount(draws[0], minlength=6).double() / (n * G)
    se = (p * (1 - p) / (n * G)).sqrt()
    assert ((freq - p).abs() <= 4 * se + 1e-12).all(), (freq, p)
    for a, b in ((draws[0][0::G], draws[0][1::G]), (draws[0], draws[1])):
        joint = torch.zeros(6, 6).index_put_((a, b), torch.ones(len(a)), accumulate=True) / len(a)
        expected = p[:, None] * p[None, :]
        se2 = (expected * (1 - expected) / len(a)).sqrt()
        assert ((joint.double() - expected).abs() <= 4 * se2 + 1e-3).all(), (joint, expected)


def test_bf16_sampling_records_the_logprobs_of_the_trainers_bf16_forward(tokenizer):
    """autocast='bfloat16': body in bf16, LM head in float32, as rollout/forward.py computes the policy;
    the recorded log-probs are that forward's (not the float32 model's)."""
    from posttrain.rollout.forward import frozen_logprobs
    from tests.conftest import make_tiny_model
    model = make_tiny_model(tokenizer, seed=2, init_range=0.2)
    prompts = [tokenizer("What is 12 + 34?")["input_ids"], tokenizer("Hi")["input_ids"]]
    rollout = HFRolloutEngine(model, tokenizer, "bfloat16").generate(
        prompts, 3, SamplingParams(6, 1.0), seeds=torch.arange(6))
    bf16 = frozen_logprobs(model, rollout, 1.0, micro=6, autocast="bfloat16")
    fp32 = frozen_logprobs(model, rollout, 1.0, micro=6)
    m = rollout.response_mask_B_T > 0
    err_bf16 = (rollout.logp_B_T - bf16)[m].abs().max()
    err_fp32 = (rollout.logp_B_T - fp32)[m].abs().max()
    assert err_bf16 < 0.05 and err_bf16 < err_fp32, (err_bf16, err_fp32)


def test_bf16_copy_samples_near_the_policy_and_follows_its_updates(tokenizer):
    """weights='bfloat16': a bf16 copy of the body (rotary frequencies kept in float32), the
    policy's own float32 head; its log-probs are close to the policy's, and `sync_weights` (not
    anything else) carries an update over."""
    from posttrain.rollout.forward import frozen_logprobs
    from tests.conftest import make_tiny_model
    model = make_tiny_model(tokenizer, seed=2, init_range=0.2)
    engine = HFRolloutEngine(model, tokenizer, weights="bfloat16")
    copy = engine.model
    assert copy is not model and all(p.dtype == torch.bfloat16 and not p.requires_grad
                                     for p in copy.parameters())
    assert all(b.dtype == torch.float32 for b in copy.buffers())
    assert all(p.dtype == torch.float32 for p in model.parameters())    # the policy untouched
    ps = [tokenizer("What is 12 + 34?")["input_ids"], tokenizer("Hi")["input_ids"]]

    def gap():
        rollout = engine.generate(ps, 3, SamplingParams(6, 1.0), seeds=torch.arange(6))
        m = rollout.response_mask_B_T > 0
        return (rollout.logp_B_T - frozen_logprobs(model, rollout, 1.0, micro=6))[m].abs().max()

    assert gap() < 0.1
    with torch.no_grad():                                  # an "update" of the policy
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p) * p.std())
    assert gap() > 0.2                                     # the copy still holds the old weights
    engine.sync_weights()
    assert gap() < 0.1
    for a, b in zip(copy.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))


def test_prefill_runs_the_shared_prefix_once(tokenizer, tiny_model):
    """The system turn every prompt shares enters the model once as one row; each prompt's own
    tail then runs once for its whole group (the tokens the embedding layer sees, call by call)."""
    engine = make_engine("hf", tiny_model, tokenizer)
    ps = prompts(tokenizer, ["What is 1 + 1?", "What is 12 + 34?", "Hi"])
    k = 0
    while all(p[k] == ps[0][k] for p in ps):
        k += 1
    seen = []
    hook = tiny_model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: seen.append(tuple(args[0].shape)))
    try:
        engine.generate(ps, 4, SamplingParams(3, greedy=True))
    finally:
        hook.remove()
    longest_tail = max(len(p) for p in ps) - k
    assert k > 10 and seen[0] == (1, k) and seen[1] == (3, longest_tail)
    assert all(shape[1] == 1 for shape in seen[2:]) and seen[2][0] == 12


def test_a_stop_string_longer_than_four_tokens_ends_the_response(tokenizer, tiny_model, monkeypatch):
    """The policy writes 'Answer: 42 END_OF_THE_ANSWER_HERE more': the stop string spans more
    than 4 tokens and must end the response right after its last token."""
    import posttrain.rollout.hf as hf
    text, stop = " Answer: 42 END_OF_THE_ANSWER_HERE more words follow", "END_OF_THE_ANSWER_HERE"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    end = len(tokenizer(" Answer: 42 END_OF_THE_ANSWER_HERE", add_special_tokens=False)["input_ids"])
    assert len(tokenizer(" " + stop, add_special_tokens=False)["input_ids"]) > 4

    def scripted(logits, params, generator, seeds=None, t=0):
        tok = torch.full((logits.shape[0],), ids[t])
        return tok, torch.zeros(logits.shape[0])
    monkeypatch.setattr(hf, "sample_next", scripted)
    out = make_engine("hf", tiny_model, tokenizer).generate(
        prompts(tokenizer, ["x"]), 1, SamplingParams(len(ids), stop=(stop,)))
    assert int(out.lengths_B[0]) == end and not out.truncated_B[0]


def test_overlong_shaping_looks_at_an_episodes_longest_turn():
    """DAPO's overlong penalty is about the turn max_new_tokens cuts: a 3-turn, 40-token episode
    whose turns are short gets none; one whose turn ran to the limit gets the full penalty."""
    from posttrain.rewards import overlong_penalty
    from posttrain.rollout import Rollout
    policy = torch.zeros(2, 40)
    policy[0, 0:6] = policy[0, 14:20] = policy[0, 30:36] = 1.0     # three 6-token turns
    policy[1, 0:16] = 1.0                                           # a turn cut at 16
    r = Rollout(torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1), torch.zeros(2, 40, dtype=torch.long),
                torch.ones(2, 40), torch.zeros(2, 40), torch.zeros(2, dtype=torch.bool), 2,
                policy_mask_B_T=policy)
    assert r.longest_turn_B.tolist() == [6.0, 16.0]
    assert overlong_penalty(r.longest_turn_B, 16, 8, 1.0).tolist() == [0.0, -1.0]
    assert overlong_penalty(r.lengths_B, 16, 8, 1.0).tolist() == [-1.0, -1.0]   # (the old reading)


def test_an_engine_is_one_registration_and_declares_what_callers_use(tokenizer):
    """rollout.backend names an ENGINES entry, built by make_engine (the one place an engine is
    built); the in-process engine declares that it runs episodes in one call and evaluates over
    the policy in its own precision; an unknown backend names the registered ones."""
    from posttrain.rollout import ENGINES, HFRolloutEngine, evaluation_engine, make_engine, runs_episodes
    from tests.conftest import make_tiny_model
    model = make_tiny_model(tokenizer)
    sampler = make_engine("hf", model, tokenizer, "none", "bfloat16")
    assert runs_episodes(sampler) and sampler.model is not model   # (a bf16 copy samples)
    evaluator = evaluation_engine(sampler)
    assert isinstance(evaluator, HFRolloutEngine) and evaluator.model is model
    with pytest.raises(ValueError, match=r"rollout.backend='sglang' is not available; accepted: \['hf', 'vllm'\]"):
        make_engine("sglang", model, tokenizer)
    built = []
    ENGINES.register("echo-test")(lambda m, tok, autocast, weights, **o: built.append(o) or "engine")
    try:
        assert make_engine("echo-test", model, tokenizer, port=1) == "engine" and built == [{"port": 1}]
    finally:
        ENGINES._fns.pop("echo-test"), ENGINES._meta.pop("echo-test")
