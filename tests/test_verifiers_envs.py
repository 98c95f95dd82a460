"""Environments from verifiers' own repository (tests/vendor/verifiers, unmodified), loaded as
verifiers loads them and run against posttrain's sampler, offline: Kuhn poker (an Env that
referees two seats of self-play over an INFINITE taskset of prompt-less tasks), glossary (a
task-scoped tool) and scratchpad (a toolset the taskset shares); tests/vf_seats.py for a seat
that runs twice and an untrainable one. docs/environments.md, "Bring your verifiers environment"."""

import json
import logging
import os
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
import verifiers.v1  # noqa: F401  (installed by scripts/install-cpu.sh: a broken install fails)

from posttrain.config.options import load_config
from posttrain.data.source import PromptStream, build_task
from posttrain.envs import for_tokenizer, make_env
from posttrain.losses.advantages import ADVANTAGES, AdvantageInputs, AdvantageParams
from posttrain.rewards import Scorer
from posttrain.sampling.collect import generate_and_score
from posttrain.sampling.setup import SamplingSetup
from posttrain.rollout import SamplingParams
from posttrain.rollout.episodes import EpisodeSettings, padded_rollout, run_episodes
from posttrain.rollout.sessions import EpisodeRows
from posttrain.util.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ROOT / "tests" / "vendor" / "verifiers"
SETTINGS = EpisodeSettings(None, True, None, 400, 64)


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    """The vendored packages importable by name, here and in the toolset processes verifiers
    starts (`python -m glossary.servers.facts`), as `pip install -e` would make them."""
    paths = [str(VENDOR / name) for name in ("kuhn_poker", "glossary", "scratchpad")]
    for path in paths:
        monkeypatch.syspath_prepend(path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [*paths, str(ROOT), os.environ.get("PYTHONPATH")])))


def loaded(task_id, tokenizer, *options):
    cfg = load_config(None, ["--data.task", f"verifiers:{task_id}", "--data.eval_size", "0",
                             "--rollout.prompts_per_step", "1", "--rollout.group_size", "2",
                             "--algorithm.kl_coef", "0", *options])
    task = build_task(cfg.data)
    return cfg, task, for_tokenizer(make_env(cfg.env, task), tokenizer)


class Scripted:
    """An engine whose reply is `reply(prompt text, row seed)`, each token at log-prob -0.5."""

    model = None

    def __init__(self, tokenizer, reply):
        self.tok, self.reply, self.calls = tokenizer, reply, 0

    def generate(self, prompts, G, params, generator=None, seeds=None):
        self.calls += len(prompts)
        ids = [self.tok(self.reply(self.tok.decode(p), None if seeds is None else int(seeds[j])),
                        add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
               for j, p in enumerate(prompts)]
        rows = EpisodeRows(prompts, ids, [[-0.5] * len(x) for x in ids],
                           [[1.0] * len(x) for x in ids], [False] * len(ids))
        return padded_rollout(rows, G, self.tok.pad_token_id, torch.device("cpu"))


def rows_text(tokenizer, rollout, r):
    """(prompt, the policy's tokens, the environment's tokens) of row r, as text."""
    prompt = tokenizer.decode(rollout.prompt_ids_B_L[r][rollout.prompt_mask_B_L[r].bool()])
    n = int(rollout.response_mask_B_T[r].sum())
    ids, policy = rollout.response_ids_B_T[r, :n].tolist(), rollout.policy_tokens_B_T[r, :n].tolist()
    return (prompt, tokenizer.decode([t for t, m in zip(ids, policy) if m]),
            tokenizer.decode([t for t, m in zip(ids, policy) if not m]))


def test_ids_and_options_are_verifiers_own(tokenizer):
    """`kuhn-poker` is the installed module `kuhn_poker` (verifiers' mapping), the package's Env
    is the one loaded, and data.task_options is the taskset's config, checked by verifiers."""
    import kuhn_poker
    import scratchpad
    _, task, _ = loaded("kuhn-poker", tokenizer)
    assert type(task.stream.env_config) is kuhn_poker.taskset.KuhnPokerEnvConfig
    _, task, env = loaded("scratchpad", tokenizer, "--data.task_options",
                          '{"tools": {"setup_seconds": 0.25}}')
    assert task.stream.env_config.taskset.tools == scratchpad.taskset.ScratchpadToolsetConfig(
        setup_seconds=0.25)
    assert env.seats(task.train_problem(0, 0)) == ("agent",)
    with pytest.raises(ConfigError, match=r"data.task verifiers:scratchpad \(data.task_options "
                                          r'\{"tools": \{"setup_second": 1\}\}\).*setup_second'):
        loaded("scratchpad", tokenizer, "--data.task_options", '{"tools": {"setup_second": 1}}')


def test_an_infinite_taskset_draws_only_what_a_step_needs(tokenizer):
    """Kuhn poker's taskset is INFINITE (a generator): loading reads one task (held out none), and
    each step's draw reads only its prompts; 3 held out are drawn from the first 15 read."""
    _, task, _ = loaded("kuhn-poker", tokenizer, "--data.eval_size", "0")
    assert len(task.stream.tasks) == 1 and task.eval_problems == []
    sampler = PromptStream(task, 0)
    for step in (1, 2):
        problems, _ = sampler.draw(2)
        assert [p.meta["verifiers_index"] for p in problems] == [2 * step - 2, 2 * step - 1]
        assert len(task.stream.tasks) == 2 * step
    _, held, _ = loaded("kuhn-poker", tokenizer, "--data.eval_size", "3", "--data.task_options",
                        "{}", "--data.eval_seed", "7")
    chosen = sorted(random.Random(7).sample(range(15), 15)[:3])
    assert [p.meta["verifiers_index"] for p in held.eval_problems] == chosen
    assert held.train_problem(0, 0).meta["verifiers_index"] == min(set(range(16)) - set(chosen))


def test_a_seat_waiting_for_another_seats_move_holds_no_turn(tokenizer):
    """Rows 0 and 1 are one episode's seats, row 2 another episode: a turn is sampled once row 0
    (for its episode) and row 2 have asked, though row 1, whose seat waits, never asks."""
    import threading
    from posttrain.rollout.turns import TurnBatcher
    engine = Scripted(tokenizer, lambda text, seed: "ok")
    batcher = TurnBatcher(engine, SamplingParams(4, 1.0), 3, units=[0, 0, 1])
    got = {}
    watcher = threading.Thread(target=batcher.watch, daemon=True)   # (drive_batch's own thread)
    watcher.start()
    asks = [threading.Thread(target=lambda r=r: got.update({r: batcher.ask(r, [1, 2], 4)}),
                             daemon=True) for r in (0, 2)]
    for t in asks:
        t.start()
    for t in asks:
        t.join(10)
    assert engine.calls == 2 and sorted(got) == [0, 2]
    for r in range(3):
        batcher.done(r)
    watcher.join(10)
    assert not watcher.is_alive()


def kuhn_move(text, seed):
    """Player 0 bets in odd episodes of a group and checks in even ones; every other move is the
    first legal action (player 1: check after a check, fold to a bet)."""
    legal = text.rsplit("Your legal actions: ", 1)[1]
    if "nothing yet" in text.rsplit("Betting so far:", 1)[1] and (seed // 2) % 2:
        return "[bet]"
    return legal.split("[", 1)[1].split("]", 1)[0].join("[]")


def test_kuhn_poker_trains_each_seat_as_its_own_row(tokenizer):
    """One hand per episode, two episodes of task 0 (Player 0 holds Q, Player 1 K): episode 0
    checks down (K wins: -1 / +1), episode 1 bets and Player 1 folds (+1 / -1). Rows: seat 0's
    two, then seat 1's two, each opened by the environment's own message (no empty user
    turn), advantages taken within each seat's group."""
    cfg, task, env = loaded("kuhn-poker", tokenizer)
    batch, _ = generate_and_score(SamplingSetup(cfg=cfg, engine=Scripted(tokenizer, kuhn_move),
                                                tokenizer=tokenizer, scorer=Scorer(cfg.reward),
                                                prompts=PromptStream(task, 0),
                                                generator=torch.Generator(), env=env), Counter())
    env.close()
    assert [p.meta["seat"] for p in batch.problems] == ["player0", "player0", "player1", "player1"]
    assert batch.rewards_B.tolist() == [-1.0, 1.0, 1.0, -1.0]
    assert [p["environment/payoff"] for p in batch.reward_parts] == [-1.0, 1.0, 1.0, -1.0]
    moves = ["[check]", "[bet]", "[check]", "[fold]"]
    opened = ["Betting so far: nothing yet. You are Player 0. Your legal actions: [check] or [bet]."] * 2 + [
        "Betting so far: Player 0 chose [check]. You are Player 1. Your legal actions: [check] or [bet].",
        "Betting so far: Player 0 chose [bet]. You are Player 1. Your legal actions: [fold] or [call]."]
    for r in range(4):
        prompt, mine, theirs = rows_text(tokenizer, batch.rollout, r)
        shown = prompt + theirs   # (the group's common prompt, then this row's own opening)
        card = "Q" if r < 2 else "K"
        assert shown.startswith(f"<|im_start|>system\nYou are playing Kuhn poker as Player {r // 2}.")
        assert f"Your private card: {card}." in shown and shown.count("<|im_start|>user") == 1
        assert shown.endswith(f"<|im_start|>user\n{opened[r]}<|im_end|>\n<|im_start|>assistant\n")
        assert mine == f"{moves[r]}<|im_end|>"
    adv = ADVANTAGES["group"](AdvantageInputs(batch.rewards_P_G, batch.loss_mask_B_T),
                              AdvantageParams()).adv_B_T
    per_row = [float(adv[r][batch.loss_mask_B_T[r] > 0][0]) for r in range(4)]
    z = 1 / (2 ** 0.5 + 1e-6)   # (-1, +1) within a seat: std sqrt(2), eps 1e-6
    assert per_row == pytest.approx([-z, z, z, -z], abs=1e-6)


def answer_with_tool(tool, arg, value):
    """Call `tool` with `arg` = value(prompt) first, then answer with the tool's result."""
    def reply(text, seed):
        last = text.rsplit("<|im_start|>", 2)[-2]
        if last.startswith("tool"):
            return f"<answer>{last.split(chr(10), 1)[1].split('<|im_end|>')[0].strip()}</answer>"
        return f'<tool_call>{{"name": "{tool}", "arguments": {{"{arg}": "{value(text)}"}}}}</tool_call>'
    return reply


def test_a_task_scoped_tool_call_reaches_its_tool(tokenizer):
    """glossary's `facts_lookup` (one MCP server per rollout) answers from its facts.json."""
    import glossary.servers.facts as facts
    _, task, env = loaded("glossary", tokenizer)
    problem = task.train_problem(0, 1)
    entity = problem.prompt.split('look up "')[1].split('"')[0]
    engine = Scripted(tokenizer, answer_with_tool("facts_lookup", "name", lambda t: entity))
    out = run_episodes(engine, tokenizer, env, [problem], 2, SamplingParams(64, 1.0),
                       settings=SETTINGS, seeds=torch.arange(2))
    env.close()
    fact = facts.FACTS[entity.lower()]
    assert entity == "Grace Hopper" and out.parts == [{"looked_up": 1.0}] * 2
    for r in range(2):
        _, mine, theirs = rows_text(tokenizer, out.rollout, r)
        assert theirs == f"\n<|im_start|>tool\n{fact}<|im_end|>\n<|im_start|>assistant\n"
        assert mine.endswith(f"<answer>{fact}</answer><|im_end|>")


@pytest.mark.slow   # (~7 s: in the full suite, README; quick: the task-scoped tool call above)
def test_a_shared_toolset_keeps_each_episode_its_own_state(tokenizer):
    """scratchpad's one server, shared by the taskset's episodes, round-trips each its own word."""
    _, task, env = loaded("scratchpad", tokenizer)
    problems = [task.train_problem(0, i) for i in range(2)]
    word = lambda text: text.rsplit('word="', 1)[1].split('"')[0]  # noqa: E731
    out = run_episodes(Scripted(tokenizer, answer_with_tool("scratchpad_roundtrip", "word", word)),
                       tokenizer, env, problems, 1, SamplingParams(64, 1.0),
                       settings=SETTINGS, seeds=torch.arange(2))
    env.close()
    assert out.parts == [{"isolated": 1.0}] * 2
    assert out.env_correct == [True, True]   # (no answer field: solved at the rubric's full marks)
    for r, expected in enumerate(("alpha", "bravo")):
        assert rows_text(tokenizer, out.rollout, r)[2] == (
            f"\n<|im_start|>tool\n{expected}<|im_end|>\n<|im_start|>assistant\n")


def test_a_seat_that_runs_twice_trains_its_first_trace_and_an_untrainable_one_none(tokenizer, caplog):
    """tests/vf_seats.py: the solver answers twice in one episode, the critic once. The solver's
    row holds its first answer only (the second was sampled on its row, recorded nowhere, and
    said in the log); the critic's row is out of its group's baseline and the loss."""
    cfg, task, env = loaded("tests.vf_seats", tokenizer)
    engine = Scripted(tokenizer, lambda text, seed: "ok")
    with caplog.at_level(logging.WARNING, logger="posttrain"):
        batch, stats = generate_and_score(SamplingSetup(cfg=cfg, engine=engine,
                                                        tokenizer=tokenizer,
                                                        scorer=Scorer(cfg.reward),
                                                        prompts=PromptStream(task, 0),
                                                        generator=torch.Generator(), env=env), Counter())
    env.close()
    assert engine.calls == 6   # (2 episodes x 3 answers)
    assert stats["env/turns"] == 1.0 and stats["env/forks"] == 0.0   # (a turn per row recorded)
    assert [p.meta["seat"] for p in batch.problems] == ["solver", "solver", "critic", "critic"]
    assert batch.rewards_B.tolist() == [1.0] * 4
    assert batch.scored_B.tolist() == [True, True, False, False]
    assert batch.loss_mask_B_T[2:].sum() == 0
    for r in range(2):
        assert rows_text(tokenizer, batch.rollout, r)[1:] == ("ok<|im_end|>", "")
    assert "seat 'solver' ran more than one trace" in caplog.text


def test_kuhn_poker_trains_a_step_on_a_tiny_model(tmp_path, tokenizer):
    """The whole loop on a random model: its moves are never legal, so Player 0 forfeits each
    hand after one re-prompt (-1, Player 1 +1, never asked); held out, the first seat's payoff."""
    from posttrain.rl.loop import train
    from tests.conftest import make_tiny_model
    cfg = load_config(None, ["--data.task", "verifiers:kuhn-poker", "--data.eval_size", "1",
                             "--rollout.prompts_per_step", "1", "--rollout.group_size", "2",
                             "--rollout.max_new_tokens", "4", "--steps", "1",
                             "--env.max_tokens", "64", "--tensorboard", "false",
                             "--algorithm.kl_coef", "0", "--run_dir", str(tmp_path / "r")])
    train(cfg, model=make_tiny_model(tokenizer, seed=3), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "r" / "metrics.jsonl")]
    held_out, step = [r for r in rows if "eval/env_reward" in r], [r for r in rows if "env/turns" in r]
    assert [(r["eval/env_reward"], r["eval/turns"]) for r in held_out] == [(-1.0, 2.0)] * 2
    (step,) = step   # 2 episodes, 4 rows: Player 0 asked twice (-1), Player 1 never (+1)
    assert step["rollout/generated_responses"] == 4 and step["env/turns"] == 1.0
    assert step["env/reward_payoff"] == 0.0 and step.get("env/env_errors", 0) == 0
