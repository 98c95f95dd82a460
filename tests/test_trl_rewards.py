"""Reward functions with TRL's signature (`prompts, completions, completion_ids, **columns`):
one call per batch, inside the reward sandbox, as TRL's GRPOTrainer makes it; TRL's own
functions and its documentation's examples run as TRL publishes them (tests/vendor/trl)."""

import json

import pytest

from posttrain import load_config, train
from posttrain.config.sections import RewardConfig
from posttrain.data.tasks import Problem
from posttrain.rewards import Scorer
from tests.conftest import make_tiny_model

VENDOR = "tests.vendor.trl"


def score(functions: list[str], problems, completions, workers: int = 1, ids=None, **cfg):
    scorer = Scorer(RewardConfig(verifier="none", workers=workers, functions=tuple(functions), **cfg))
    try:
        return scorer(problems, completions, completion_ids=ids)
    finally:
        scorer.close()


def plain(n: int, **columns) -> list[Problem]:
    return [Problem(f"q{i}", str(i), {k: v[i] for k, v in columns.items()}) for i in range(n)]


def chat(n: int) -> list[Problem]:
    return [Problem(f"q{i}", str(i), {}, messages=({"role": "user", "content": f"q{i}"},))
            for i in range(n)]


@pytest.mark.parametrize("workers", [1, 0])
def test_a_trl_function_sees_the_whole_batch_once(workers):
    """Ranks within the batch (one response at a time, every rank would be 0), token ids and a
    column, in the sandbox and in process."""
    got = score(["tests.toy_rewards:batch_rank", "tests.toy_rewards:ids_and_columns"],
                plain(3, level=[0, 1, 2]), ["b", "a", "c"], workers, ids=[[5], [6, 7], []])
    assert [p["tests.toy_rewards:batch_rank"] for p in got.parts_B] == [1.0, 0.0, 2.0]
    assert [p["tests.toy_rewards:ids_and_columns"] for p in got.parts_B] == [1.0, 102.0, 200.0]
    assert got.rewards_B.tolist() == [2.0, 102.0, 202.0] and not got.failures
    assert got.tallies["reward function 'tests.toy_rewards:batch_rank'"].calls == 3


def test_trls_documented_functions_give_their_documented_values():
    """The values TRL's documentation prints for its own examples, on its examples' inputs:
    standard data (a column, an async function awaited) and conversational data."""
    lengths = f"{VENDOR}.grpo_docs_example_1_1:reward_func"
    got = score([lengths], plain(2), [" blue.", " in the sky."])
    assert [p[lengths] for p in got.parts_B] == [6.0, 12.0]
    reference, wait = (f"{VENDOR}.grpo_docs_example_3:reward_func",
                       f"{VENDOR}.grpo_docs_example_5:async_reward_func")
    got = score([reference, wait], plain(2, ground_truth=["2", "5"]),
                [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."])
    assert [p[reference] for p in got.parts_B] == [1.0, 0.0]
    assert [p[wait] for p in got.parts_B] == [1.0, 1.0]
    assert score([wait], plain(2), ["x", ""]).rewards_B.tolist() == [1.0, 0.0]
    conversational = [f"{VENDOR}.grpo_docs_example_2:format_reward_func",
                      f"{VENDOR}.format_rewards:think_format_reward"]
    got = score(conversational, chat(2), [
        "<think>The sum of 1 and 2 is 3, which we multiply by 4 to get 12.</think>"
        "<answer>(1 + 2) * 4 = 12</answer>",
        "The sum of 3 and 1 is 4, which we multiply by 2 to get 8. So (3 + 1) * 2 = 8."])
    assert [[p[s] for s in conversational] for p in got.parts_B] == [[1.0, 1.0], [0.0, 0.0]]
    assert not got.failures


def test_none_leaves_a_response_out_only_when_no_function_scores_it():
    """TRL's None: that function's part is absent; a response no function scored is unscorable
    (out of its group's baseline and the loss, counted), one another function scored is not."""
    alone = score(["tests.toy_rewards:none_for_odd"], plain(4), ["a"] * 4)
    assert alone.scored_B.tolist() == [True, False, True, False] and alone.unscored == 2
    assert alone.parts_B[1] == {} and alone.rewards_B.tolist() == [1.0, 0.0, 1.0, 0.0]
    assert not alone.failures
    both = score(["tests.toy_rewards:none_for_odd", "tests.toy_rewards:odd_only"], plain(4), ["a"] * 4)
    assert both.scored_B is None and both.unscored == 0
    assert both.rewards_B.tolist() == [1.0, 2.0, 1.0, 2.0]


def test_bad_entries_are_counted_each_and_a_wrong_length_fails_the_call():
    got = score(["tests.toy_rewards:bad_entries"], plain(4), ["a"] * 4, fallback=-1.0)
    assert got.rewards_B.tolist() == [1.0, -1.0, -1.0, 0.0]
    assert got.failures == {"nonfinite": 1, "error": 1} and got.unscored == 1
    got = score(["tests.toy_rewards:wrong_length"], plain(3), ["a"] * 3, fallback=-1.0)
    assert got.rewards_B.tolist() == [-1.0] * 3 and got.failures == {"error": 3}
    assert "returned 4 rewards for 3 completions" in got.tallies[
        "reward function 'tests.toy_rewards:wrong_length'"].first_error


def test_a_batch_call_has_the_time_of_as_many_calls_as_it_scores():
    """reward.timeout_s 0.4 and a function taking 1 s over the whole batch: 4 responses give it
    1.6 s (it scores), 2 give it 0.8 s (it times out)."""
    got = score(["tests.toy_rewards:batch_sleeps_1s"], plain(4), ["a"] * 4, timeout_s=0.4)
    assert got.rewards_B.tolist() == [1.0] * 4 and not got.failures
    got = score(["tests.toy_rewards:batch_sleeps_1s"], plain(2), ["a"] * 2, timeout_s=0.4)
    assert got.failures == {"timeout": 2}


def test_a_run_with_a_trl_function_leaves_its_unscored_responses_out(tmp_path, tokenizer):
    """Two steps of GRPO on a tiny model: every second response unscored, counted, and out of
    the loss (its tokens' mask is 0 in the token records)."""
    cfg = load_config(None, ["--model.path", "unused", "--run_dir", str(tmp_path / "run"),
                             "--steps", "2", "--rollout.prompts_per_step", "2",
                             "--rollout.group_size", "4", "--rollout.max_new_tokens", "6",
                             "--data.eval_size", "0", "--reward.verifier", "none",
                             "--reward.functions", "tests.toy_rewards:none_for_odd"])
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steps = [r for r in rows if "reward/unscored" in r]
    assert [r["reward/unscored"] for r in steps] == [4.0, 4.0]
    import pyarrow.parquet as pq
    recs = pq.read_table(tmp_path / "run" / "tokens" / "step_000001.parquet").to_pylist()
    assert [any(r["in_loss"]) for r in recs] == [True, False] * 4


def test_a_file_rows_answer_column_reaches_trl_functions_under_its_own_name(tmp_path):
    """TRL hands a reward function every column but the prompt: with --data.answer_field
    ground_truth, TRL's documented `reward_func(completions, ground_truth, **kwargs)` reads it."""
    from posttrain.data.files import load_problems
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "ground_truth": gt}) + "\n"
                            for i, gt in enumerate(["2", "5"])))
    problems = load_problems(path, "prompt", "ground_truth")
    assert [p.answer for p in problems] == ["2", "5"] and "prompt" not in problems[0].meta
    got = score([f"{VENDOR}.grpo_docs_example_3:reward_func"], problems,
                [r" The solution is \boxed{2}.", r" The solution is \boxed{6}."])
    assert got.rewards_B.tolist() == [1.0, 0.0] and not got.failures


def test_a_trl_function_is_known_by_any_of_trls_names():
    """`completion_ids` or `prompts` alone (with **kwargs) is TRL's signature too; `prompt,
    completion, answer` is one response per call."""
    from posttrain.rewards.scorer import call_style

    def ids_only(completion_ids, **kwargs): ...

    def prompts_only(prompts, **kwargs): ...

    def per_response(prompt, completion, answer, **kwargs): ...
    assert [call_style(f).batched for f in (ids_only, prompts_only, per_response)] == [True, True, False]
