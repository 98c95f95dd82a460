"""OpenEnv's own environments as OpenEnv publishes them (vendored unmodified under
tests/vendor/openenv, see its README): `reasoning_gym_env`, whose task (a question) comes from
`reset`, and `echo_env`, whose actions are MCP tool calls. Each trains two GRPO steps on a tiny
model in process and served by its own server app, with exact checks on what the policy saw."""

import functools
import importlib
import json

import openenv.core  # noqa: F401  (both installed by scripts/install-cpu.sh)
import pytest
import reasoning_gym  # noqa: F401
import torch

import posttrain.sampling.collect as collect
import posttrain.rollout.hf as hf
from posttrain.config.options import load_config
from posttrain.data.tasks import Problem
from posttrain.envs.openenv import OpenEnvEnvironment
from posttrain.model.prompts import ReplyEncoder, encode_prompts
from posttrain.rl.loop import train
from posttrain.rollout import SamplingParams, make_engine
from posttrain.rollout.episodes import EpisodeSettings, run_episodes
from tests.conftest import make_tiny_model
from tests.test_openenv import Served

VENDOR = "tests.vendor.openenv"
RGYM = f"{VENDOR}.reasoning_gym_env.server.reasoning_gym_environment:ReasoningGymEnvironment"
ECHO = f"{VENDOR}.echo_env.server.echo_environment:EchoEnvironment"
COMMON = ["--data.eval_size", "0", "--data.system_prompt", "null", "--tensorboard", "false",
          "--threads", "2", "--algorithm.kl_coef", "0", "--steps", "2", "--env.name", "openenv"]
SEEDS = (1, 2, 3, 4)
CONFIG = {"min_animals": 1, "max_animals": 1}   # (short questions)
TASK = "Answer with a number."


def question(seed: int) -> str:
    import reasoning_gym
    return reasoning_gym.create_dataset("leg_counting", size=1, seed=seed, **CONFIG)[0]["question"]


@pytest.fixture
def seen(monkeypatch):
    """The prompt ids of every sampling call: what the policy saw (the engine's own code runs)."""
    prompts: list[list[int]] = []
    generate = hf.HFRolloutEngine.generate

    @functools.wraps(generate)
    def recording(self, ps, *args, **kwargs):
        prompts.extend(list(p) for p in ps)
        return generate(self, ps, *args, **kwargs)
    monkeypatch.setattr(hf.HFRolloutEngine, "generate", recording)
    return prompts


def rows_file(tmp_path):
    """Rows that are a task's seed and reset options (reasoning_gym_env's reset parameters)."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": TASK, "dataset_name": "leg_counting", "size": 1,
                                        "seed": s, "dataset_config": CONFIG}) + "\n"
                            for s in SEEDS))
    return path


def metrics(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def test_the_question_reset_shows_opens_the_episode_in_process_and_served(tmp_path, tokenizer,
                                                                          seen):
    """Each row's seed reaches reset, whose question follows the row's prompt in the tokens the
    policy saw: the same question for a problem's two episodes. Served by OpenEnv's own app
    (one session at a time, as published), the four episodes of a step queue for it and train
    exactly the in-process episodes (each response a function of its own seed)."""
    from tests.vendor.openenv.reasoning_gym_env.server.app import app
    run = [*COMMON, "--data.task", "file", "--data.train_path", str(rows_file(tmp_path)),
           "--reward.verifier", "none", "--env.max_turns", "1", "--env.max_tokens", "4",
           "--rollout.max_new_tokens", "4", "--rollout.prompts_per_step", "2",
           "--rollout.group_size", "2"]
    expected = {tuple(encode_prompts(tokenizer, [Problem(f"{TASK}\n\n{question(s)}", "")],
                                     None)[0]): s for s in SEEDS}
    with Served(app) as srv:
        for name, where in (("inproc", RGYM), ("served", srv.url)):
            seen.clear()
            cfg = load_config(None, [*run, "--env.openenv", where,
                                     "--run_dir", str(tmp_path / name)])
            train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer,
                  show_progress=False)
            shown = [expected.get(tuple(p)) for p in seen]
            if name == "inproc":   # one prompt per problem: its group shares it
                assert sorted(shown) == list(SEEDS)
            else:                  # queued: one sampling call per episode, a problem's 2 in a row
                assert len(shown) == 8 and sorted(set(shown)) == list(SEEDS)
                assert all(shown[i] == shown[i + 1] for i in range(0, 8, 2))
    inproc, served = metrics(tmp_path / "inproc"), metrics(tmp_path / "served")
    for key in ("reward/mean", "rollout/length_mean", "policy/grad_norm"):
        assert [r[key] for r in served] == [r[key] for r in inproc], key


def test_a_row_of_seeds_alone_is_opened_by_the_question(tokenizer):
    """A problem with no prompt: the question reset shows is the whole prompt."""
    env = OpenEnvEnvironment(load_function(RGYM), max_turns=1)
    engine = make_engine("hf", make_tiny_model(tokenizer, seed=3), tokenizer)
    problems = [Problem("", "", {"dataset_name": "leg_counting", "size": 1, "seed": s,
                                 "dataset_config": CONFIG}) for s in (2, 3)]
    out = run_episodes(engine, tokenizer, env, problems, 2, SamplingParams(2),
                       settings=EpisodeSettings(None, True, None, 8, 8))
    r = out.rollout
    shown = [[t for t, m in zip(ids, mask) if m]
             for ids, mask in zip(r.prompt_ids_B_L.tolist(), r.prompt_mask_B_L.tolist())]
    want = encode_prompts(tokenizer, [Problem(question(s), "") for s in (2, 3)], None)
    assert shown == [want[0], want[0], want[1], want[1]]


def load_function(spec: str):
    from posttrain.util.usercode import load_function as load
    return load(spec)


CALL = "<echo_with_length>hi 3</echo_with_length>"   # (tag format: the template takes no tools)
RESULT = '{"message":"hi 3","length":4}'              # the environment's answer to it


@pytest.fixture
def writes_the_call(monkeypatch, tokenizer):
    """The tiny policy's sampler writes CALL as each turn's first tokens, then its end; the
    log-prob of each token is the model's own (the update is a real one)."""
    ids = tokenizer(CALL, add_special_tokens=False)["input_ids"]

    def forced(logits, params, generator, seeds=None, t=0):
        tok = torch.full((logits.shape[0],), ids[t] if t < len(ids) else tokenizer.eos_token_id)
        logp = torch.log_softmax(logits.float() / params.temperature, -1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    monkeypatch.setattr(hf, "sample_next", forced)
    return ids


@pytest.fixture
def batches(monkeypatch):
    """Each step's Episodes and the environment's session limit after it."""
    out: list[tuple] = []
    run = collect.run_episodes

    def spy(engine, tokenizer, env, *args, **kwargs):
        episodes = run(engine, tokenizer, env, *args, **kwargs)
        out.append((episodes, env.max_episodes, env.system_prompt(None), env.tool_schemas))
        return episodes
    monkeypatch.setattr(collect, "run_episodes", spy)
    return out


def echo_app(monkeypatch, sessions: int):
    """echo_env's own app, which reads its session limit from MAX_CONCURRENT_ENVS on import."""
    monkeypatch.setenv("MAX_CONCURRENT_ENVS", str(sessions))
    module = importlib.import_module(f"{VENDOR}.echo_env.server.app")
    return importlib.reload(module).app


ECHO_RUN = [*COMMON, "--data.task", "guess_number", "--data.difficulty", "8",
            "--env.max_turns", "2", "--env.max_tokens", "64", "--rollout.max_new_tokens", "24",
            "--rollout.prompts_per_step", "2", "--rollout.group_size", "4"]


def check_echo_steps(batches, tokenizer, calls: int, limit: int | None) -> None:
    """Each step: every episode's environment tokens are exactly echo_env's result of the call,
    `calls` calls reached it, its session limit is `limit`; its tools are described to the
    policy (the template takes no tool schemas: the system prompt, tag format)."""
    reply = ReplyEncoder(tokenizer).encode({"role": "tool", "content": RESULT},
                                           policy_wrote_eos=False)
    assert len(batches) == 2
    for episodes, max_episodes, system, schemas in batches:
        r = episodes.rollout
        env_tokens = [[t for t, m, p in zip(ids, mask, pol) if m and not p] for ids, mask, pol
                      in zip(r.response_ids_B_T.tolist(), r.response_mask_B_T.tolist(),
                             r.policy_mask_B_T.tolist())]
        assert env_tokens == [reply] * 8
        assert episodes.counts["tool_calls"] == calls and max_episodes == limit
        assert schemas is None and system.splitlines()[-2:] == [
            "- echo_message: Echo back the provided message. Example: "
            "<echo_message>...</echo_message>",
            "- echo_with_length: Echo back the message with its length. Example: "
            "<echo_with_length>...</echo_with_length>"]
        assert system in tokenizer.decode(r.prompt_ids_B_L[0])


def test_mcp_tools_are_the_policys_and_a_call_reaches_the_environment(
        tmp_path, tokenizer, writes_the_call, batches):
    """echo_env in process: its tools (from list_tools) are described to the policy; the call
    the policy writes goes to the environment as a CallToolAction and its result is the
    environment's tokens, exactly (the turn after it ends the episode: no call, an answer)."""
    assert len(writes_the_call) < 24
    cfg = load_config(None, [*ECHO_RUN, "--env.openenv", ECHO, "--run_dir", str(tmp_path / "r")])
    train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer, show_progress=False)
    check_echo_steps(batches, tokenizer, calls=8, limit=None)


def test_a_served_mcp_environment_with_2_sessions_serves_8_episodes_by_queueing(
        tmp_path, tokenizer, monkeypatch, writes_the_call, batches):
    """echo_env served by its own app with MAX_CONCURRENT_ENVS=2: a step's 8 episodes queue for
    the 2 sessions (the limit learned from the server's refusal), each turn a sampling call of
    the episodes in flight; the same tool results are the environment's tokens (each episode's
    second turn, its last, calls again: 2 calls an episode)."""
    with Served(echo_app(monkeypatch, 2)) as srv:
        cfg = load_config(None, [*ECHO_RUN, "--env.openenv", srv.url,
                                 "--run_dir", str(tmp_path / "r")])
        train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer,
              show_progress=False)
    check_echo_steps(batches, tokenizer, calls=16, limit=2)


@pytest.mark.parametrize("success,solved", [(1.0, [False, True]), (0.2, [True, True])])
def test_a_partial_credit_is_no_solve_unless_the_threshold_says_so(success, solved):
    """reasoning-gym's chain_sum gives the right number with the wrong sign 0.5 (partial credit)
    and the right one 1: the episode is solved at env.openenv_success (1 by default), so
    eval/accuracy counts right answers only."""
    import reasoning_gym
    from posttrain.config.env import EnvConfig
    from posttrain.envs.openenv import from_config
    env = from_config(EnvConfig(name="openenv", openenv=RGYM, openenv_action="answer", max_turns=1,
                                openenv_success=success))
    options = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}
    row = {"dataset_name": "chain_sum", "size": 1, "seed": 1, "dataset_config": options}
    answer = reasoning_gym.create_dataset("chain_sum", size=1, seed=1, **options)[0]["answer"]
    got = []
    for text in ("-" + answer, answer):
        state = env.reset(Problem(TASK, "", dict(row)))
        reply = env.step(state, text, 1)
        got.append((reply.reward, reply.correct))
    assert got == [(0.5, solved[0]), (1.0, solved[1])]
