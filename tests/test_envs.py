"""Environments: tools, multi-turn episodes on one KV cache, loss masks with holes, rows in full."""

import json
import math
from dataclasses import dataclass, replace

import pytest
import torch

from posttrain.sampling.batch import ScoredBatch
from posttrain.util.errors import ConfigError
from posttrain.config.env import EnvConfig
from posttrain.config.options import load_config
from posttrain.data.source import build_task
from posttrain.data.tasks import Problem, make_task
from posttrain.envs import GuessNumber, Reply, SingleTurn, ToolEnv, for_tokenizer, make_env
from posttrain.envs.tools import calculate, make_tools, parse_calls, run_call, run_python
from posttrain.rollout.forward import sequence_logprobs
from posttrain.losses.aggregation import AGGREGATIONS
from posttrain.losses.kl import kl_k3
from posttrain.model.prompts import ReplyEncoder, encode_prompts
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import EpisodeSettings, run_episodes
from posttrain.rl.loop import train
from posttrain.rl.loss_terms import Metrics, MicroBatch, policy_terms, update_terms
from tests.conftest import make_tiny_model


# ---------------------------------------------------------------------------------------------
# tools
# ---------------------------------------------------------------------------------------------

def test_calculator_values_and_refusals():
    assert calculate("37*48") == "1776"
    assert calculate(" (12 + 3) * -2 = ") == "-30"
    assert calculate("7/2") == "3.5" and calculate("2**10") == "1024" and calculate("17 % 5") == "2"
    assert calculate("1/3") == "0.3333333333"
    for bad in ("__import__('os')", "9**9**9", "x + 1", "1/0", "(", "a" * 300):
        with pytest.raises((ValueError, ZeroDivisionError)):
            calculate(bad)


def test_tool_calls_are_parsed_in_both_formats():
    tools = {t.name: t for t in make_tools(("calculator",))}
    calls, errors = parse_calls("I will use <calculator>3*4</calculator> now", tools, "tag")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "3*4"})] and not errors
    calls, errors = parse_calls("<calculator>3*4", tools, "tag")        # never closed
    assert not calls and len(errors) == 1
    text = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    calls, errors = parse_calls(text, tools, "json")
    assert [(c.name, c.arguments) for c in calls] == [("calculator", {"expression": "2+2"})]
    for bad in ("<tool_call>{not json}</tool_call>", '<tool_call>{"name": "nope"}</tool_call>',
                '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'):
        calls, errors = parse_calls(bad, tools, "json")
        assert not calls and len(errors) == 1, bad
    assert parse_calls("The answer is 12.", tools, "tag") == ([], [])


def test_tools_that_raise_hang_or_return_garbage_become_error_messages():
    names = ("tests.toy_rewards:tool_raises", "tests.toy_rewards:tool_hangs",
             "tests.toy_rewards:tool_garbage", "calculator")
    env = ToolEnv(tuple(make_tools(names)), format="tag", timeout_s=0.3, calls_per_turn=5)
    text = ("<tool_raises>a</tool_raises> <tool_hangs>b</tool_hangs> <tool_garbage>c</tool_garbage>"
            " <calculator>1/0</calculator> <calculator>2+3</calculator>")
    reply = env.step(None, text, 1)
    lines = reply.message["content"].splitlines()
    assert reply.message["role"] == "tool" and len(lines) == 5
    assert all(line.startswith("error:") for line in lines[:4]) and lines[4] == "5"
    assert "timed out" in lines[1] and "RuntimeError" in lines[0] and "ZeroDivisionError" in lines[3]
    assert reply.counts == {"tool_calls": 5, "malformed_calls": 0, "tool_failures": 4,
                            "tools_broken": 3, "capped_calls": 0}   # (1/0: the model's arguments)
    final = env.step(None, "It is 5.", 2)               # no call: the final answer
    assert final.message is None and final.reward == 0 and sum(final.counts.values()) == 0


def test_python_tool_runs_with_time_and_memory_limits():
    assert run_python("print(6 * 7)").strip() == "42"
    assert "timed out" in run_python("while True: pass", timeout_s=1.0)
    assert "MemoryError" in run_python("x = bytearray(2_000_000_000)", memory_mb=200)
    assert "ZeroDivisionError" in run_python("1/0")


def test_make_env_picks_the_tasks_environment_and_refuses_bad_names(tokenizer):
    assert isinstance(make_env(EnvConfig(), make_task("addition", 2)), SingleTurn)
    assert isinstance(make_env(EnvConfig(), make_task("guess_number", 10)), GuessNumber)
    env = make_env(EnvConfig(tools=("calculator",)), make_task("multiplication", 2))
    assert isinstance(env, ToolEnv) and env.format == "auto"
    bound = for_tokenizer(env, tokenizer)      # SmolLM2's template takes no tools: the tag format
    assert bound.format == "tag" and bound.stop == ("</calculator>",) and bound.tool_schemas is None
    assert "<calculator>37*48</calculator>" in bound.system_prompt(None)
    with pytest.raises(ConfigError, match="env.tools: 'abacus'"):
        make_env(EnvConfig(tools=("abacus",)), make_task("addition", 2))
    with pytest.raises(ConfigError, match="env.name='nope'"):
        make_env(EnvConfig(name="nope"), make_task("addition", 2))
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_config(None, ["--env.max_turns", "0"])


def test_guess_number_answers_higher_lower_and_rewards_the_find():
    env = GuessNumber(max_turns=4)
    secret = env.reset(Problem("", "7"))
    higher = env.step(secret, "5", 1)
    assert higher.message["content"] == "Higher." and higher.counts == {"invalid_guesses": 0}
    assert env.step(secret, "I guess 9", 2).message["content"] == "Lower."
    assert env.step(secret, "no idea", 3).counts == {"invalid_guesses": 1}
    found = env.step(secret, "7", 4)
    assert found.message is None and found.reward == 1.0 and found.correct is True
    assert found.counts == {"invalid_guesses": 0}   # a step without an invalid guess logs 0, not nothing


# ---------------------------------------------------------------------------------------------
# episodes
# ---------------------------------------------------------------------------------------------

def test_reply_tokens_are_the_chat_templates_own(tokenizer):
    """The environment's tokens after a turn are exactly what the template renders between the
    assistant's answer and the next generation prompt."""
    enc = ReplyEncoder(tokenizer)
    base = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    full = tokenizer.apply_chat_template(base + [{"role": "tool", "content": "42"}], tokenize=False,
                                         add_generation_prompt=True)
    head = tokenizer.apply_chat_template(base, tokenize=False)
    head = head[:head.rindex("A") + 1]
    wrote_eos = tokenizer.decode(enc.encode({"role": "tool", "content": "42"}, True))
    assert head + tokenizer.eos_token + wrote_eos == full
    assert head + tokenizer.decode(enc.encode({"role": "tool", "content": "42"}, False)) == full


@dataclass(frozen=True)
class Echo:
    """A scripted environment: answers every turn with 'turn N done' until `max_turns`."""
    max_turns: int = 3
    name: str = "echo"
    stop: tuple = ()
    tool_schemas: None = None

    def system_prompt(self, base):
        return base

    def reset(self, problem):
        return None

    def step(self, state, text, turn):
        return Reply({"role": "user", "content": f"turn {turn} done"}, reward=0.5, counts={"echo": 1})


def _episodes(tokenizer, model, env, engine=None, G=2, turn_tokens=4):
    engine = engine or make_engine("hf", model, tokenizer)
    task = make_task("addition", 2)
    task.build_eval(3, 0)
    params = SamplingParams(turn_tokens, 1.0)
    return run_episodes(engine, tokenizer, env, task.eval_problems, G, params,
                        settings=EpisodeSettings(max_tokens=96), seeds=torch.arange(3 * G))


def test_multi_turn_kv_cache_logprobs_equal_a_full_forward(tokenizer):
    """All turns run through one KV cache, the environment's tokens fed beside the sampled ones:
    the recorded log-probs of the policy's tokens are those of one forward pass over the whole
    conversation, and every environment token is the template's and carries policy mask 0."""
    model = make_tiny_model(tokenizer).double()
    ep = _episodes(tokenizer, model, Echo())
    r = ep.rollout
    assert r.policy_mask_B_T is not None and ep.counts["turns"] == 6 * 3
    full = sequence_logprobs(model, r, torch.arange(6), 1.0).logp.detach()
    pol = r.policy_tokens_B_T.bool()
    torch.testing.assert_close(r.logp_B_T[pol], full[pol].float(), atol=1e-6, rtol=1e-6)
    enc = ReplyEncoder(tokenizer)
    for i in range(6):
        ids = r.response_ids_B_T[i, :int(r.lengths_B[i])].tolist()
        env_part = [t for t, m in zip(ids, r.policy_tokens_B_T[i].tolist()) if m == 0]
        expected = sum((enc.encode({"role": "user", "content": f"turn {k} done"}, False)
                        for k in (1, 2)), [])
        assert env_part == expected   # the policy's 4-token turns end by length, never with EOS
        assert int(r.policy_tokens_B_T[i].sum()) == 3 * 4
    assert ep.env_rewards_B.tolist() == [1.5] * 6 and ep.metrics()["env/echo"] == 3.0
    assert "turn 2 done" in ep.transcripts[0]


class TurnByTurn:
    """The in-process engine without its `respond=` path: what a vLLM engine offers."""
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompts, group_size, params, generator=None, seeds=None):
        return self.engine.generate(prompts, group_size, params, generator, seeds=seeds)


def test_turn_by_turn_engines_build_the_same_kind_of_episode(tokenizer):
    model = make_tiny_model(tokenizer).double()
    ep = _episodes(tokenizer, model, Echo(), engine=TurnByTurn(make_engine("hf", model, tokenizer)))
    r = ep.rollout
    full = sequence_logprobs(model, r, torch.arange(6), 1.0).logp.detach()
    pol = r.policy_tokens_B_T.bool()
    torch.testing.assert_close(r.logp_B_T[pol], full[pol].float(), atol=1e-6, rtol=1e-6)
    assert [int(x) for x in r.policy_tokens_B_T.sum(-1)] == [12] * 6
    assert ep.counts["turns"] == 18


def test_an_episode_cut_by_its_budget_is_graded_on_the_cut_turn_by_both_engines(tokenizer):
    """The budget ends two tokens into the second turn: the in-process engine and a turn-by-turn
    engine (vLLM's path) both hand that cut turn to the environment, and grade it."""
    model = make_tiny_model(tokenizer).double()
    task = make_task("addition", 2)
    task.build_eval(2, 0)
    reply = ReplyEncoder(tokenizer).encode({"role": "user", "content": "turn 1 done"}, False)
    settings = EpisodeSettings(max_tokens=4 + len(reply) + 2)
    params = SamplingParams(4, greedy=True)
    last = {}
    for name, engine in (("hf", make_engine("hf", model, tokenizer)),
                         ("turns", TurnByTurn(make_engine("hf", model, tokenizer)))):
        ep = run_episodes(engine, tokenizer, Echo(), task.eval_problems, 1, params,
                          settings=settings)
        r = ep.rollout
        assert [int(x) for x in r.policy_tokens_B_T.sum(-1)] == [6, 6] and r.truncated_B.all()
        second = [tokenizer.decode(row[4 + len(reply):4 + len(reply) + 2], skip_special_tokens=True)
                  for row in r.response_ids_B_T.tolist()]
        assert ep.completions == second, name
        last[name] = ep.completions
    assert last["hf"] == last["turns"]


def test_single_turn_episodes_are_exactly_one_generate_call(tokenizer, tiny_model):
    engine = make_engine("hf", tiny_model, tokenizer)
    task = make_task("addition", 2)
    task.build_eval(4, 0)
    params = SamplingParams(6, 1.0)
    ep = run_episodes(engine, tokenizer, SingleTurn(), task.eval_problems, 2, params,
                      settings=EpisodeSettings(), seeds=torch.arange(8))
    direct = engine.generate(encode_prompts(tokenizer, task.eval_problems, None), 2, params,
                             seeds=torch.arange(8))
    assert ep.rollout.policy_mask_B_T is None
    assert torch.equal(ep.rollout.response_ids_B_T, direct.response_ids_B_T)
    assert torch.equal(ep.rollout.logp_B_T, direct.logp_B_T)


def test_environment_tokens_get_zero_gradient_and_zero_kl(tokenizer):
    """The policy loss with a KL term in it: d loss / d logp is exactly 0 on every environment
    token, and the loss equals the hand-computed token mean over the policy's tokens only
    (whatever advantages and reference log-probs the environment positions hold)."""
    model = make_tiny_model(tokenizer).double()
    ep = _episodes(tokenizer, model, Echo())
    r = ep.rollout
    cfg = load_config(None, ["--algorithm.kl_coef", "0.1", "--algorithm.kl_in", "loss",
                             "--algorithm.aggregation", "token_mean", "--rollout.group_size", "2"])
    algo = cfg.algo
    m = r.policy_tokens_B_T
    g = torch.Generator().manual_seed(0)
    garbage = torch.randn(r.logp_B_T.shape, generator=g, dtype=torch.float64) * 100
    adv = torch.randn(r.logp_B_T.shape, generator=g, dtype=torch.float64)
    ref = r.logp_B_T - 0.3
    problems = [Problem("p", "1")] * 6

    def loss_and_grad(adv_B_T, ref_B_T):
        batch = ScoredBatch(r, problems, ep.completions, torch.zeros(6), torch.zeros(6, dtype=torch.bool),
                            m.clone(), ref_logp_B_T=ref_B_T, adv_B_T=adv_B_T)
        rows = torch.arange(6)
        fwd = sequence_logprobs(model, r, rows, 1.0, with_entropy=True)
        logp = fwd.logp
        w = AGGREGATIONS["token_mean"](batch.loss_mask_B_T, 24.0)
        loss = policy_terms(batch, MicroBatch(rows, w, None, Metrics()), fwd,
                            update_terms(batch, cfg, algo, None), cfg, None)
        return loss, torch.autograd.grad(loss, logp)[0], logp.detach(), batch.ref_logp_B_T

    loss, grad, logp, ref_clean = loss_and_grad(adv * m, ref)
    env_pos = (m == 0) & (r.response_mask_B_T == 1)
    assert env_pos.any() and torch.all(grad[env_pos] == 0) and torch.all(grad[m == 1] != 0)
    hand = ((-adv + 0.1 * kl_k3(logp, ref_clean)) * m).sum() / m.sum()
    torch.testing.assert_close(loss, hand.to(loss.dtype), atol=1e-8, rtol=1e-6)   # (float32 weights)
    loss2, grad2, _, _ = loss_and_grad(torch.where(m == 1, adv, garbage), torch.where(m == 1, ref, garbage))
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------

TINY = ["--data.eval_size", "4", "--data.system_prompt", "null", "--tensorboard", "false",
        "--threads", "2", "--rollout.prompts_per_step", "2", "--rollout.group_size", "2",
        "--checkpoint.every_minutes", "null", "--optim.lr", "1e-3"]


class Scripted:
    """An engine that 'writes' a fixed text per turn (a policy that calls the tools, then answers);
    turn-by-turn, so the episode path for engines without `respond=` runs in the trainer."""
    def __init__(self, model, tokenizer, turns):
        self.model, self.tokenizer, self.turns = model, tokenizer, turns
        self.inner = make_engine("hf", model, tokenizer)

    def sync_weights(self):
        pass

    def generate(self, prompts, group_size, params, generator=None, seeds=None):
        out = self.inner.generate(prompts, group_size, replace(params, max_new_tokens=1), generator, seeds)
        turn = int(self.turns[0] in self.tokenizer.decode(prompts[0]))   # (its first turn written)
        ids = self.tokenizer(self.turns[turn], add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        B = len(out.truncated_B)
        resp = torch.tensor([ids] * B)
        return replace(out, response_ids_B_T=resp, response_mask_B_T=torch.ones(B, len(ids)),
                       logp_B_T=torch.zeros(B, len(ids)), truncated_B=torch.zeros(B, dtype=torch.bool))


def test_broken_tools_never_stop_a_run_and_are_counted(tmp_path, tokenizer, monkeypatch):
    import posttrain.sampling.service as sampling
    model = make_tiny_model(tokenizer)
    turns = ["<tool_raises>a</tool_raises><tool_hangs>b</tool_hangs><tool_garbage>c</tool_garbage>"
             "<calculator>2+</calculator>", "12 + 10 = 22"]
    monkeypatch.setattr(sampling, "make_engine", lambda *a, **k: Scripted(model, tokenizer, turns))
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "2",
                             "--data.eval_size", "0", "--env.tool_timeout_s", "0.3", "--env.tools",
                             "tests.toy_rewards:tool_raises,tests.toy_rewards:tool_hangs,"
                             "tests.toy_rewards:tool_garbage,calculator"])
    summary = train(cfg, model=model, tokenizer=tokenizer, show_progress=False)
    assert summary["steps"] == 2
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["env/tool_calls"] for r in rows] == [4.0, 4.0]
    assert [r["env/tool_failures"] for r in rows] == [4.0, 4.0]
    assert [r["env/turns"] for r in rows] == [2.0, 2.0]
    sample = json.loads(open(tmp_path / "run" / "samples.jsonl").readline())["samples"][0]
    assert "timed out" in sample["completion"] and "broken tool" in sample["completion"]


def test_guess_number_trains_end_to_end(tmp_path, tokenizer):
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "2",
                             "--data.task", "guess_number", "--data.difficulty", "4",
                             "--env.max_turns", "3", "--rollout.max_new_tokens", "3"])
    summary = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in rows if "env/turns" in r]
    assert len(steps) == 2 and all(1.0 <= r["env/turns"] <= 3.0 for r in steps)
    assert "eval/turns" in summary["eval_after"]
    held_out = json.loads(open(tmp_path / "run" / "eval_samples.jsonl").readlines()[-1])["samples"]
    assert all(any(m in s["completion"] for m in ("Higher.", "Lower.", "Answer with one number."))
               or s["correct"] for s in held_out)   # evaluation runs the episodes, feedback included
    # the per-token records tell the environment's tokens from the policy's (posttrain view)
    import pyarrow.parquet as pq
    recs = pq.read_table(tmp_path / "run" / "tokens" / "step_000002.parquet").to_pylist()
    longer = [r for r in recs if 0 in r["policy"]]
    assert longer, "no recorded episode had a second turn"
    for r in longer:
        env_text = "".join(t for t, p in zip(r["tokens"], r["policy"]) if not p)
        assert any(m in env_text for m in ("Higher.", "Lower.", "Answer with one number."))
        assert all(not m for m, p in zip(r["in_loss"], r["policy"]) if not p)


def test_conversational_prompts_and_extra_columns_reach_rewards(tmp_path, tokenizer):
    """A JSONL file whose prompt column holds chat messages trains on those messages (not their
    repr), and reward functions get the row's other columns (per-response and TRL signatures)."""
    rows = [{"prompt": [{"role": "system", "content": "Be short."},
                        {"role": "user", "content": f"What is {i} + 1?"}],
             "answer": str(i + 1), "difficulty": "easy" if i % 2 else "hard", "level": i % 3}
            for i in range(12)]
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "2",
                             "--data.task", "file", "--data.train_path", str(path), "--data.eval_size", "2",
                             "--reward.verifier", "none", "--reward.workers", "0", "--reward.functions",
                             "tests.toy_rewards:difficulty_column,tests.toy_rewards:trl_style"])
    task = build_task(cfg.data)
    p = task.train_pool[0]
    assert p.messages[0] == {"role": "system", "content": "Be short."} and p.prompt.startswith("What is")
    text = tokenizer.decode(encode_prompts(tokenizer, [p], "ignored: the row has its own")[0])
    assert "Be short." in text and "[{" not in text and "ignored" not in text
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    from posttrain.rewards import Scorer
    scorer = Scorer(cfg.reward)
    res = scorer([p], ["x"])
    expect = float(p.meta["difficulty"] == "easy") + 1.0 + float(p.meta["level"] == 2)
    assert res.rewards_B.tolist() == [expect] and not res.failures
    got = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert all(not any(k.startswith("reward/failures") for k in r) for r in got)


def test_bad_conversational_rows_are_refused_with_file_row_and_field(tmp_path):
    from posttrain.data.files import load_problems
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user"}], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl: row 1: field 'prompt': message 0"):
        load_problems(path, "prompt", "answer")
    path.write_text(json.dumps({"prompt": [{"role": "assistant", "content": "x"}], "answer": "1"}) + "\n")
    with pytest.raises(ValueError, match="last message is the assistant's"):
        load_problems(path, "prompt", "answer")


def test_chat_template_kwargs_reach_the_template(tokenizer):
    tok = tokenizer     # (its template is swapped for one that reads a keyword, then restored)
    saved = tok.chat_template
    try:
        tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                             "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}")
        on = tok.decode(encode_prompts(tok, [Problem("Hi", "")], None)[0])
        off = tok.decode(encode_prompts(tok, [Problem("Hi", "")], None, True, {"enable_thinking": False})[0])
        assert on.endswith("Hi") and off.endswith("Hi/no_think")
    finally:
        tok.chat_template = saved
    cfg = load_config(None, ["--data.chat_template_kwargs", "{enable_thinking: false}"])
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}


# ---------------------------------------------------------------------------------------------
# multi-turn SFT data: demonstrations and sampled episodes, with their masks
# ---------------------------------------------------------------------------------------------

def test_demonstrations_hold_calls_results_and_masks_and_sft_trains_on_policy_tokens(tmp_path, tokenizer):
    from posttrain.rollout.forward import pack
    from posttrain.losses.preference import sft_loss
    from posttrain.stages.common import write_jsonl
    from posttrain.stages.generate import demonstration_rows
    from posttrain.stages.sft import sft
    from tests.conftest import stage_config

    cfg = load_config(None, ["--data.task", "multiplication", "--env.tools", "calculator",
                             "--data.system_prompt", "null"])
    env = for_tokenizer(make_env(cfg.env, build_task(cfg.data)), tokenizer)
    problems = [Problem("What is 37 * 48?", "1776"), Problem("What is 12 * 11?", "132")]
    rows = demonstration_rows(problems, env, tokenizer, cfg)
    row = rows[0]
    policy = [t for t, m in zip(row["response_ids"], row["policy_mask"]) if m]
    written = [t for t, m in zip(row["response_ids"], row["policy_mask"]) if not m]
    assert tokenizer.decode(policy) == "<calculator>37*48</calculator>37 * 48 = 1776" + tokenizer.eos_token
    assert written == ReplyEncoder(tokenizer).encode({"role": "tool", "content": "1776"}, False)
    assert row["prompt"][0]["role"] == "system" and "<calculator>" in row["prompt"][0]["content"]
    write_jsonl(tmp_path / "demos.jsonl", rows)
    model = make_tiny_model(tokenizer, init_range=1.0)   # far from uniform: tokens' losses differ
    prompts = encode_prompts(tokenizer, [Problem("", "", messages=tuple(r["prompt"])) for r in rows], None)
    r = pack(tokenizer, prompts, [x["response_ids"] for x in rows], "cpu", [x["policy_mask"] for x in rows])
    with torch.no_grad():
        hand = sft_loss(sequence_logprobs(model, r, torch.arange(2), 1.0).logp, r.policy_tokens_B_T).item()
        everything = sft_loss(sequence_logprobs(model, r, torch.arange(2), 1.0).logp, r.response_mask_B_T).item()
    out = sft(stage_config(data=str(tmp_path / "demos.jsonl"), lr=1e-3, epochs=1, batch_size=2,
                           run_dir=str(tmp_path / "run"), system_prompt=None),
              model=model, tokenizer=tokenizer, show_progress=False)
    # the stage's loss is the policy tokens' own (to 1e-5), measurably not every token's (the two
    # differ by over 1%, 100x the match's tolerance)
    assert out["first_loss"] == pytest.approx(hand, rel=1e-5) and hand != pytest.approx(everything, rel=1e-3)


def test_generate_records_whole_episodes_with_their_masks(tmp_path, tokenizer):
    from posttrain.stages.generate import generate
    cfg = load_config(None, ["--data.task", "guess_number", "--data.difficulty", "4", "--env.max_turns",
                             "3", "--rollout.max_new_tokens", "3", "--data.system_prompt", "null",
                             "--eval_batch_size", "4", "--run_dir", "none"])
    out = generate(cfg, 4, tmp_path / "ep.jsonl", samples=1, only_correct=False,
                   model=make_tiny_model(tokenizer), tokenizer=tokenizer)
    rows = [json.loads(line) for line in open(tmp_path / "ep.jsonl")]
    assert out["written"] == 4 and len(rows) == 4
    for row in rows:
        assert len(row["policy_mask"]) == len(row["response_ids"]) and 0 in row["policy_mask"]
        assert isinstance(row["prompt"], list) and row["prompt"][-1]["role"] == "user"
        assert tokenizer.decode(row["response_ids"], skip_special_tokens=True) == row["response"]
        assert "Higher." in row["transcript"] or "Lower." in row["transcript"] or \
            "Answer with one number." in row["transcript"]


# ---------------------------------------------------------------------------------------------
# reasoning-gym as a data source (the optional extra 'gym')
# ---------------------------------------------------------------------------------------------

def test_reasoning_gym_tasks_are_disjoint_and_scored_by_their_own_scorer():
    import reasoning_gym  # noqa: F401  (installed by scripts/install-cpu.sh)
    cfg = load_config(None, ["--data.task", "reasoning_gym:chain_sum", "--data.eval_size", "50",
                             "--data.train_size", "400", "--data.task_options",
                             "{min_terms: 2, max_terms: 2, min_digits: 1, max_digits: 2}"])
    task = build_task(cfg.data)
    assert len(task.eval_problems) == 50 and task.verifier == "reasoning_gym"
    held = {p.prompt for p in task.eval_problems}
    assert task.train_pool and not held & {p.prompt for p in task.train_pool}
    from posttrain.rewards import Scorer
    p = task.eval_problems[0]
    res = Scorer(cfg.reward, task.verifier)([p] * 3, [f"The answer is {p.answer}.", p.answer, "no idea"])
    assert res.correct_B.tolist() == [True, True, False]
    with pytest.raises(ConfigError, match="reasoning_gym:no_such_task"):
        build_task(load_config(None, ["--data.task", "reasoning_gym:no_such_task"]).data)


@pytest.mark.parametrize("preset", ["ppo", "opd", *(pytest.param(p, marks=pytest.mark.slow)
                                                    for p in ("reinforce", "rloo", "dapo", "dr_grpo"))])
def test_every_preset_trains_on_multi_turn_episodes(tmp_path, tokenizer, preset):
    """Groups are one problem's episodes; PPO's GAE and the distillation teacher see the whole
    episode as context and train on the policy's tokens only."""
    extra = {"dapo": ["--algorithm.overlong", "none"],
             "opd": ["--teacher.path", "unused-a-teacher-is-passed-in"]}.get(preset, [])
    cfg = load_config(None, [*TINY, "--run_dir", str(tmp_path / "run"), "--steps", "2", "--preset", preset,
                             "--data.task", "guess_number", "--data.difficulty", "4", "--data.eval_size", "0",
                             "--env.max_turns", "2", "--rollout.max_new_tokens", "3", *extra])
    teacher = make_tiny_model(tokenizer, seed=5) if preset == "opd" else None
    summary = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False,
                    teacher=teacher)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert summary["steps"] == 2 and all(1.0 <= r["env/turns"] <= 2.0 for r in rows)
    # the environment answered: a random policy's guesses are wrong, so episodes go to turn 2
    assert any(r["env/turns"] > 1.0 for r in rows)
    assert all(math.isfinite(r["policy/grad_norm"]) for r in rows if "policy/grad_norm" in r)


@dataclass(frozen=True)
class BadReward(Echo):
    """Echo whose every turn's reward is `reward` (NaN, Inf, or not a number at all)."""
    reward: object = float("nan")

    def step(self, state, text, turn):
        return Reply({"role": "user", "content": "again"}, reward=self.reward)


class DrivenBadReward:
    """An environment driving its episode (one turn), then reporting `reward`."""
    name, stop, tool_schemas, max_turns = "driven_bad", (), None, 1

    def __init__(self, reward):
        self.reward = reward

    def system_prompt(self, base):
        return base

    def drive(self, policy, problem):
        from posttrain.envs.base import Driven
        policy.chat([{"role": "user", "content": problem.prompt}])
        return Driven(self.reward)


@pytest.mark.parametrize("driven, bad", [(False, float("nan")), (False, "lots"),
                                         (True, float("-inf"))])
def test_an_environment_reward_that_is_not_a_finite_number_is_its_counted_error(tokenizer, bad,
                                                                                 driven):
    """Checked as a reward function's value is: NaN or Inf in one reward would reach every
    advantage of its group. It counts as 0 and as an environment error (FailureWatch sees it)."""
    model = make_tiny_model(tokenizer).double()
    env = DrivenBadReward(bad) if driven else BadReward(max_turns=2, reward=bad)
    ep = _episodes(tokenizer, model, env)
    assert torch.isfinite(ep.env_rewards_B).all() and ep.env_rewards_B.abs().sum() == 0
    tally = ep.tallies()["environment"]
    assert tally.failures == tally.calls == ep.counts["turns"] > 0
    assert "not a" in tally.first_error and "number" in tally.first_error
