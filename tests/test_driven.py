"""Episodes the environment drives (rollout/driven.py), the policy's OpenAI-compatible endpoint
(envs/endpoint.py) and an external agent harness (envs/agent.py)."""

import json
import urllib.request

import pytest
import torch

from posttrain.config.options import load_config
from posttrain.data.tasks import Problem
from posttrain.envs import GuessNumber
from posttrain.envs.endpoint import Endpoint
from posttrain.rl.loop import train
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import EpisodeSettings, run_episodes
from tests.agents import CALLS, DrivenGuess, guess_over_http
from tests.conftest import make_tiny_model

PROBLEMS = [Problem("Guess a number from 1 to 8.", "5"), Problem("Guess a number from 1 to 8.", "2")]
PARAMS = SamplingParams(4, 1.0, stop=("\n",))
SETTINGS = EpisodeSettings(None, True, None, 24, 16)
SEEDS = torch.arange(4, dtype=torch.long) + 100


class TurnByTurn:
    """The in-process engine without its one-loop multi-turn path: one call per turn (as vLLM)."""

    def __init__(self, engine):
        self.engine, self.model = engine, engine.model

    def generate(self, prompts, G, params, generator=None, seeds=None):
        return self.engine.generate(prompts, G, params, generator, seeds=seeds)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return make_engine("hf", make_tiny_model(tokenizer, seed=3), tokenizer)


def test_a_driven_episode_is_token_for_token_the_built_in_one(engine, tokenizer):
    """The environment's own loop asking for each turn gives the same tokens, mask, rewards
    (and log-probs) as the built-in environment run turn by turn from the same seeds."""
    driven = run_episodes(engine, tokenizer, DrivenGuess(3), PROBLEMS, 2, PARAMS,
                          settings=SETTINGS, seeds=SEEDS)
    native = run_episodes(TurnByTurn(engine), tokenizer, GuessNumber(3), PROBLEMS, 2, PARAMS,
                          settings=SETTINGS, seeds=SEEDS)
    a, b = driven.rollout, native.rollout
    assert torch.equal(a.response_ids_B_T, b.response_ids_B_T)
    assert torch.equal(a.policy_tokens_B_T, b.policy_tokens_B_T)
    # (log-probs to float rounding: the built-in's first turn runs each group's prompt once)
    assert torch.allclose(a.logp_B_T, b.logp_B_T, atol=1e-5) and torch.equal(a.truncated_B, b.truncated_B)
    assert driven.env_rewards_B.equal(native.env_rewards_B)
    assert driven.counts["turns"] == native.counts["turns"] > len(PROBLEMS) * 2   # several turns
    assert driven.counts["forks"] == 0
    assert 0 < a.policy_tokens_B_T.sum() < a.response_mask_B_T.sum()   # feedback is not the policy's


def test_a_rewritten_history_forks_the_row_and_is_counted(engine, tokenizer):
    out = run_episodes(engine, tokenizer, DrivenGuess(3, rewrite=True), PROBLEMS, 2, PARAMS,
                       settings=SETTINGS, seeds=SEEDS)
    second_turns = out.counts["turns"] - 4
    assert second_turns > 0 and out.counts["forks"] == second_turns
    edited = [r for r, text in enumerate(out.transcripts) if "(edited)" in text]
    assert len(edited) == sum(1 for t in out.transcripts if "(edited)" in t) > 0
    for r in edited:   # the row restarted from the rendered history: the edit is context
        first_policy = int(out.rollout.policy_tokens_B_T[r].nonzero()[0])
        assert "(edited)" in tokenizer.decode(out.rollout.response_ids_B_T[r, :first_policy])


def test_an_external_client_records_exactly_the_tokens_the_trainer_trains_on(engine, tokenizer):
    from posttrain.envs.agent import AgentEnvironment
    env = AgentEnvironment(guess_over_http, 3)
    CALLS.clear()
    out = run_episodes(engine, tokenizer, env, PROBLEMS, 2, PARAMS, settings=SETTINGS, seeds=SEEDS)
    env.close()
    ro = out.rollout
    assert len(CALLS) == 4 and out.counts["forks"] == 0
    rows = {}
    for r in range(4):
        prompt = ro.prompt_ids_B_L[r][ro.prompt_mask_B_L[r].bool()].tolist()
        ids = ro.response_ids_B_T[r, :int(ro.response_mask_B_T[r].sum())].tolist()
        rows[r] = (prompt, ids, ro.policy_tokens_B_T[r, :len(ids)].tolist())
    matched = set()
    for calls in CALLS.values():   # the whole episode, as the client saw it, is one row
        last = calls[-1]
        seen = last["prompt_token_ids"] + last["choices"][0]["token_ids"]
        r = next(r for r, (p, ids, _) in rows.items() if p + ids == seen and r not in matched)
        matched.add(r)
        prompt, ids, policy = rows[r]
        for call in calls:   # each reply's tokens sit in the row where the trainer reads them
            start = len(call["prompt_token_ids"]) - len(prompt)
            got = call["choices"][0]["token_ids"]
            assert ids[start:start + len(got)] == got and all(policy[start:start + len(got)])
            lps = [c["logprob"] for c in call["choices"][0]["logprobs"]["content"]]
            assert lps == ro.logp_B_T[r, start:start + len(got)].tolist()
        assert sum(policy) == sum(len(c["choices"][0]["token_ids"]) for c in calls)
    assert matched == set(range(4))
    # the same episodes as the in-process driver (same seeds, same replies)
    same = run_episodes(engine, tokenizer, DrivenGuess(3), PROBLEMS, 2, PARAMS,
                        settings=SETTINGS, seeds=SEEDS)
    assert torch.equal(same.rollout.response_ids_B_T, ro.response_ids_B_T)


def post(url, body, host=None):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    if host:
        req.add_header("Host", host)
    try:
        with urllib.request.urlopen(req) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Echo:
    """A backend that answers with the prompt's length (the endpoint's own behaviour only)."""

    def chat(self, messages, tools=None, max_tokens=None, **sampling):
        return self.complete([1, 2, 3], max_tokens)

    def complete(self, prompt, max_tokens=None, **sampling):
        from posttrain.rollout.driven import PolicyTurn
        return PolicyTurn("ok", list(prompt) if isinstance(prompt, list) else [9], [7, 8],
                          [-0.5, -0.25], "stop", ["o", "k"])


def test_the_endpoint_speaks_vllms_fields_and_refuses_foreign_hosts_and_bad_bodies():
    ep = Endpoint(default=Echo())
    url = ep.base_url
    status, reply = post(url + "/completions", {"model": "policy", "prompt": [5, 6]})
    assert status == 200 and reply["choices"][0]["prompt_token_ids"] == [5, 6]   # (vLLM's place)
    assert reply["choices"][0]["token_ids"] == [7, 8]
    assert reply["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.25]
    status, reply = post(url + "/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert status == 200 and reply["choices"][0]["logprobs"]["content"][1]["token"] == "k"
    assert post(url + "/chat/completions", {"messages": []})[0] == 400
    assert post(url + "/chat/completions", {"messages": [{"role": "user"}], "n": 2})[0] == 400
    assert post(url + "/chat/completions", {"messages": [{"role": "user"}]}, host="evil.example:80")[0] == 403
    assert post(url.replace("/v1", "/s/nosuch/v1") + "/completions", {"prompt": "x"})[0] == 404
    ep.close()


def test_an_agent_harness_trains_from_the_config(tmp_path, tokenizer):
    cfg = load_config(None, ["--data.task", "guess_number", "--data.difficulty", "8",
                             "--data.eval_size", "0", "--env.name", "agent", "--env.agent",
                             "tests.agents:guess_over_http", "--env.max_turns", "3",
                             "--env.max_tokens", "24", "--rollout.max_new_tokens", "4",
                             "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
                             "--steps", "2", "--data.system_prompt", "null", "--tensorboard",
                             "false", "--algorithm.kl_coef", "0", "--run_dir", str(tmp_path / "r")])
    train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    assert len(rows) == 2 and all(r["env/turns"] > 1 and r["env/forks"] == 0 for r in rows)


class Fixed:
    """An engine that samples 2 fixed tokens per row (or fails, `broken`)."""

    model = None

    def __init__(self, broken=False):
        self.broken, self.calls = broken, 0

    def generate(self, prompts, G, params, generator=None, seeds=None):
        from posttrain.rollout.episodes import padded_rollout
        from posttrain.rollout.sessions import EpisodeRows
        self.calls += 1
        if self.broken:
            raise RuntimeError("out of memory")
        ids = [[5, 6] for _ in prompts]
        rows = EpisodeRows(prompts, ids, [[-1.0, -1.0]] * len(prompts),
                           [[1.0, 1.0]] * len(prompts), [False] * len(prompts))
        return padded_rollout(rows, 1, 0, torch.device("cpu"))


def test_a_request_that_outlives_its_episode_is_refused_and_never_stalls_the_batch():
    import threading

    from posttrain.rollout.driven import EpisodeOver, TurnBatcher
    batcher = TurnBatcher(Fixed(), SamplingParams(2, 1.0), 2)
    got = {}

    def ask(row):
        try:
            got[row] = batcher.ask(row, [1, 2], 2)
        except EpisodeOver as e:
            got[row] = e
    watcher = threading.Thread(target=batcher.watch, daemon=True)   # (drive_batch's own thread)
    watcher.start()
    waiting = threading.Thread(target=ask, args=(0,))
    waiting.start()            # row 0 waits for row 1 to ask ...
    batcher.done(0)            # ... but its episode ends first (a harness that timed out)
    waiting.join(timeout=10)
    assert not waiting.is_alive() and isinstance(got[0], EpisodeOver)
    assert batcher.ask(1, [1, 2], 2) == ([5, 6], [-1.0, -1.0], False)   # row 1 alone is sampled
    with pytest.raises(EpisodeOver):   # a late request of the ended row
        batcher.ask(0, [1, 2], 2)
    batcher.done(1)
    watcher.join(timeout=10)
    assert not watcher.is_alive()


class ThreadOfEachCall(Fixed):
    def __init__(self):
        super().__init__()
        import threading
        self.threads, self.current = [], threading.current_thread

    def generate(self, prompts, G, params, generator=None, seeds=None):
        self.threads.append(self.current().name)
        return super().generate(prompts, G, params, generator, seeds)


def test_every_turn_is_sampled_by_the_thread_that_drives_the_batch(tokenizer):
    """The episodes' threads only ask: each turn's engine call runs in drive_batch's thread (a
    call from whichever episode asked last spread a step's tensors over a malloc arena per
    thread, each keeping its peak: 13 GB for one step of a two-seat game)."""
    import threading
    engine = ThreadOfEachCall()
    run_episodes(engine, tokenizer, DrivenGuess(3), PROBLEMS, 2, PARAMS,
                 settings=SETTINGS, seeds=SEEDS)
    assert len(engine.threads) > 1 and set(engine.threads) == {threading.current_thread().name}


def test_an_engine_failure_fails_the_step_instead_of_every_episode(tokenizer):
    with pytest.raises(RuntimeError, match="out of memory"):
        run_episodes(Fixed(broken=True), tokenizer, DrivenGuess(3), PROBLEMS, 2, PARAMS,
                     settings=SETTINGS, seeds=SEEDS)


class FirstOfGroupFails(DrivenGuess):
    def drive(self, policy, problem):
        if policy.row % 2 == 0:
            raise RuntimeError("the harness broke")
        return super().drive(policy, problem)


def test_an_episode_that_fails_before_asking_is_one_error_not_a_broken_group(engine, tokenizer):
    out = run_episodes(engine, tokenizer, FirstOfGroupFails(3), PROBLEMS, 2, PARAMS,
                       settings=SETTINGS, seeds=SEEDS)
    assert out.counts["env_errors"] == 2 and "the harness broke" in out.errors["environment"]
    assert out.rollout.policy_tokens_B_T[0::2].sum() == 0     # nothing of the failed ones trains
    assert out.rollout.policy_tokens_B_T[1::2].sum() > 0


def test_the_endpoint_refuses_bad_lengths_and_bodies():
    import http.client
    ep = Endpoint(default=Echo())
    host, port = ep.server.server_address[:2]
    for length, body in (("-5", b""), ("x", b""), ("4", b"[1,2")):
        conn = http.client.HTTPConnection(host, port, timeout=10)
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", length)
        conn.endheaders(body)
        assert conn.getresponse().status == 400, length
    assert post(ep.base_url + "/completions", [1, 2])[0] == 400   # not a JSON object
    ep.close()
