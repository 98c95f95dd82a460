"""Bradley-Terry reward models (docs/algorithms.md §1): synthetic pairs, training, use as a reward."""

import json
import logging

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from posttrain.cli import main
from posttrain.config.options import load_config
from posttrain.data.preferences import synthetic_preferences
from posttrain.data.tasks import make_task
from posttrain.rewards.model import RewardModel
from posttrain.rewards.verifiers import final_answer
from posttrain.stages.reward_model import reward_model
from posttrain.rl.loop import train
from tests.conftest import make_tiny_model, make_tiny_reward_model as tiny_reward_model, stage_config
from tests.test_trainer import toy_config


def test_synthetic_pairs_follow_the_ground_truth():
    task = make_task("addition", 2)
    task.build_eval(50, 1234)
    train_rows = synthetic_preferences(task, 400, seed=0)
    held_out = synthetic_preferences(task, 100, seed=0, held_out=True)
    assert {r["kind"] for r in train_rows} == {"correct>wrong", "concise>rambling", "answer>no_answer"}
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in held_out}
    for row in train_rows + held_out:
        a, b = (int(x) for x in row["prompt"][len("What is "):-1].split(" + "))
        assert final_answer(row["chosen"]) == str(a + b), row
        assert row["chosen"] != row["rejected"]
        if row["kind"] == "correct>wrong":
            assert final_answer(row["rejected"]) not in (None, str(a + b)), row
        elif row["kind"] == "concise>rambling":
            assert final_answer(row["rejected"]) == str(a + b)
            assert len(row["rejected"]) > len(row["chosen"]) + 40
        else:
            assert str(a + b) not in row["rejected"]
    with pytest.raises(ValueError, match="What is <expression>"):
        synthetic_preferences(make_task("countdown", 3), 3)


def test_terse_wrong_answers_are_added_to_training_pairs_only():
    """terse_wrong_share: that share of correct > wrong training pairs get a terse wrong answer
    (what a hacking policy writes); 0 leaves the pairs exactly as before; held-out pairs never
    change."""
    task = make_task("addition", 2)
    task.build_eval(50, 1234)
    plain = synthetic_preferences(task, 400, seed=0)
    assert synthetic_preferences(task, 400, seed=0, terse_wrong_share=0.0) == plain
    mixed = synthetic_preferences(task, 400, seed=0, terse_wrong_share=0.5)

    def terse_share(rows):   # correct > wrong pairs whose wrong answer is "{w}" / "The answer is {w}."
        wrong = [r for r in rows if r["kind"] == "correct>wrong"]
        for r in wrong:
            a, b = (int(x) for x in r["prompt"][len("What is "):-1].split(" + "))
            assert final_answer(r["rejected"]) not in (None, str(a + b)), r
        w = [final_answer(r["rejected"]) for r in wrong]
        return sum(r["rejected"] in (x, f"The answer is {x}.") for r, x in zip(wrong, w)) / len(wrong)
    # same wording on both sides: 2 of the 8 wordings are terse; plus half the pairs made terse
    assert 0.15 < terse_share(plain) < 0.35
    assert 0.5 < terse_share(mixed) < 0.75
    assert (synthetic_preferences(task, 60, seed=0, held_out=True, terse_wrong_share=1.0)
            == synthetic_preferences(task, 60, seed=0, held_out=True))
    with pytest.raises(ValueError, match="data.terse_wrong_share=1.5 must be <= 1"):
        reward_model(stage_config(synthetic="addition", terse_wrong_share=1.5))


@pytest.mark.parametrize("row, msg", [
    ({"prompt": "p", "chosen": "a"}, "line 2: field 'rejected' is missing or empty"),
    ({"prompt": "p", "chosen": "  ", "rejected": "b"}, "line 2: field 'chosen' is missing or empty"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "line 2: 'chosen' and 'rejected' are identical"),
])
def test_bad_preference_files_are_reported_with_file_line_and_field(tmp_path, capsys, row, msg):
    path = tmp_path / "prefs.jsonl"
    path.write_text(json.dumps({"prompt": "q", "chosen": "x", "rejected": "y"}) + "\n" + json.dumps(row) + "\n")
    # the data are checked before any model is loaded (the model path does not even exist)
    assert main(["reward-model", "--data.train_path", str(path), "--model.path", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and msg in err


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory, tokenizer):
    """A tiny reward model trained on synthetic pairs (it learns at least the easy kinds)."""
    run = tmp_path_factory.mktemp("rm")
    cfg = stage_config(synthetic="addition", n_pairs=320, eval_size=60, lr=3e-3, batch_size=16,
                      run_dir=str(run), system_prompt="Be brief.")
    out = reward_model(cfg, model=tiny_reward_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    return out


def test_reward_model_training_raises_held_out_pairwise_accuracy(trained_rm):
    before, after = trained_rm["eval_before"], trained_rm["eval_after"]
    assert before["rm/eval_accuracy"] < 0.6                  # zero head: every pair is a tie
    assert after["rm/eval_accuracy"] > 0.6, after
    assert after["rm/eval_accuracy@answer>no_answer"] > 0.9, after
    assert after["rm/eval_margin"] > 0


def test_saved_reward_model_loads_with_transformers_and_normalises(trained_rm, tokenizer):
    folder = trained_rm["final_model"]
    hf = AutoModelForSequenceClassification.from_pretrained(folder)
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == tokenizer.pad_token_id
    task = make_task("addition", 2)
    task.build_eval(60, 1234)
    rows = synthetic_preferences(task, 60, seed=0, held_out=True)
    rm = RewardModel(folder, normalize=True, system_prompt="Be brief.")
    scores = rm([r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows])
    # normalised with the held-out statistics saved at training time: mean 0, std 1 on that set
    assert abs(scores.mean().item()) < 1e-3 and abs(scores.std().item() - 1) < 1e-3
    raw = RewardModel(folder, normalize=False, system_prompt="Be brief.")
    s = raw(["What is 1 + 2?"], ["3"])
    stats = json.loads(open(f"{folder}/reward_stats.json").read())
    torch.testing.assert_close(rm(["What is 1 + 2?"], ["3"]), (s - stats["mean"]) / stats["std"])


def test_trainer_uses_the_reward_model_as_reward(tmp_path, trained_rm, tokenizer, caplog):
    cfg = toy_config(tmp_path, "--steps", "2", "--reward.model", trained_rm["final_model"],
                     "--reward.functions", "", "--reward.verifier", "math",
                     "--reward.correct_reward", "0", "--reward.model_weight", "2.0",
                     "--data.system_prompt", "Be brief.")
    with caplog.at_level(logging.INFO, logger="posttrain"):
        train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert "shares the policy's tokenizer" in caplog.text
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for r in rows:   # the reward is exactly 2 x the normalised reward-model score
        assert r["reward/mean"] == pytest.approx(2.0 * r["reward/model_score"], abs=1e-5)
        assert "reward/accuracy" in r        # the truth is still measured beside the proxy
    assert any(abs(r["reward/model_score"]) > 1e-3 for r in rows)   # (not 0 = 2 x 0)


def test_a_reward_model_with_another_tokenizer_is_fed_retokenised_text(tmp_path, trained_rm,
                                                                       tokenizer, caplog):
    import shutil
    other = tmp_path / "rm"
    shutil.copytree(trained_rm["final_model"], other)
    tok = type(tokenizer).from_pretrained(other)
    tok.add_tokens(["<extra_token_for_test>"])
    tok.save_pretrained(other)
    rm = RewardModel(other, system_prompt="Be brief.")
    with caplog.at_level(logging.INFO, logger="posttrain"):
        rm.check_tokenizer(tokenizer)
    assert "re-tokenised" in caplog.text and "vocabulary sizes differ" in caplog.text
    same = RewardModel(trained_rm["final_model"], system_prompt="Be brief.")
    torch.testing.assert_close(rm(["What is 1 + 2?"], ["3"]), same(["What is 1 + 2?"], ["3"]))


def sequence_scores(model, ids, pad_id):
    """The plain definition: left-pad whole sequences, score head on the last column."""
    from posttrain.rollout.hf import left_pad
    input_ids, mask = left_pad(ids, pad_id)
    hidden = model.base_model(input_ids=input_ids, attention_mask=mask,
                              position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).last_hidden_state
    return model.score(hidden[:, -1]).squeeze(-1)


def test_pair_scores_share_the_prompt_and_equal_full_sequence_scores(tokenizer):
    from posttrain.rewards.model import encode_parts, pair_scores
    model = tiny_reward_model(tokenizer).double()
    torch.nn.init.normal_(model.score.weight)
    prompts = ["What is 12 + 30?", "What is 5 + 7? Answer briefly please."]
    heads, chosen = encode_parts(tokenizer, prompts, ["42", "The answer is 12."])
    _, rejected = encode_parts(tokenizer, prompts, ["I am not sure how to add numbers.", "13"])
    c, r, _ = pair_scores(model, heads, chosen, rejected, tokenizer.pad_token_id)
    full = sequence_scores(model, [h + t for h, t in zip(heads + heads, chosen + rejected)],
                           tokenizer.pad_token_id)
    torch.testing.assert_close(torch.cat([c, r]), full.float(), atol=1e-5, rtol=1e-5)
    # groups of 3 responses per prompt (a rollout), as the trainer's reward model call sees them
    from posttrain.rewards.model import _group_size, group_scores
    tails = chosen[:1] + rejected[:1] + [chosen[1]] + chosen[1:] + rejected[1:] + [chosen[0]]
    g = group_scores(model, heads, tails, 3, tokenizer.pad_token_id)
    full = sequence_scores(model, [heads[i // 3] + t for i, t in enumerate(tails)], tokenizer.pad_token_id)
    torch.testing.assert_close(g, full.float(), atol=1e-5, rtol=1e-5)
    assert _group_size(["a", "a", "b", "b"]) == 2 and _group_size(["a", "b", "a", "b"]) == 1
    assert _group_size(["a", "a", "a"]) == 3 and _group_size(["a", "a", "b"]) == 1


def test_reward_model_config_errors(tmp_path):
    from posttrain.config.commands import ConfigError
    with pytest.raises(ConfigError, match="reward.model="):
        load_config(None, ["--reward.model", str(tmp_path / "missing")])


def test_the_score_head_can_have_its_own_learning_rate(tmp_path, tokenizer):
    model = tiny_reward_model(tokenizer)
    head0 = model.score.weight.detach().clone()
    body0 = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    reward_model(stage_config(synthetic="addition", n_pairs=16, eval_size=8, lr=1e-3, head_lr=0.0,
                             batch_size=8, run_dir=str(tmp_path / "run")),
                 model=model, tokenizer=tokenizer, show_progress=False)
    assert torch.equal(model.score.weight, head0)                    # lr 0: the head stays put
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, body0)   # the body learns


def test_a_reward_model_trained_on_end_of_turn_is_read_the_same_way(tmp_path, tokenizer):
    out = reward_model(stage_config(synthetic="addition", n_pairs=16, eval_size=20, lr=1e-3,
                                   batch_size=8, end_of_turn=True, run_dir=str(tmp_path / "run")),
                       model=tiny_reward_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rm = RewardModel(out["final_model"], normalize=True)
    assert rm.end_of_turn
    task = make_task("addition", 2)
    task.build_eval(20, 1234)
    rows = synthetic_preferences(task, 20, seed=0, held_out=True)
    scores = rm([r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows])
    # the statistics saved at training time fit only if responses end in '<|im_end|>\n' again
    assert abs(scores.mean().item()) < 1e-3 and abs(scores.std().item() - 1) < 1e-3
    rm.end_of_turn = False
    plain = rm([r["prompt"] for r in rows] * 2, [r["chosen"] for r in rows] + [r["rejected"] for r in rows])
    assert not torch.allclose(plain, scores, atol=1e-3)


def test_chosen_nll_is_the_bodys_next_token_loss_through_the_tied_embedding(tokenizer):
    from posttrain.rewards.model import encode_parts, pair_scores
    model = tiny_reward_model(tokenizer, tied=True).double()
    prompts = ["What is 12 + 30?", "What is 5 + 7? Answer briefly please."]
    heads, chosen = encode_parts(tokenizer, prompts, ["42", "The answer is 12."])
    _, rejected = encode_parts(tokenizer, prompts, ["I am not sure how to add numbers.", "13"])
    out = pair_scores(model, heads, chosen, rejected, tokenizer.pad_token_id, chosen_nll=True)
    expected = []
    for head, tail in zip(heads, chosen):     # the plain causal-LM loss on one full sequence
        ids = torch.tensor([head + tail])
        logits = model.base_model(input_ids=ids).last_hidden_state[0] @ model.get_input_embeddings().weight.T
        logp = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        expected.append(-logp[-len(tail):].sum())
    torch.testing.assert_close(out.chosen_nll, torch.stack(expected), atol=1e-8, rtol=1e-8)
    assert pair_scores(model, heads, chosen, rejected, tokenizer.pad_token_id).chosen_nll is None


def test_the_chosen_lm_loss_trains_the_body_and_needs_a_tied_head(tmp_path, tokenizer):
    cfg = stage_config(synthetic="addition", n_pairs=96, eval_size=8, lr=3e-3, batch_size=8,
                      lm_coef=1.0, run_dir=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        reward_model(cfg, model=tiny_reward_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    reward_model(cfg, model=tiny_reward_model(tokenizer, tied=True), tokenizer=tokenizer,
                 show_progress=False)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    nll = [r["loss/chosen_nll"] for r in rows if "loss/chosen_nll" in r]
    assert len(nll) == 12 and nll[0] > 9          # ~log(vocab) for a random body
    assert max(nll[-3:]) < nll[0] - 1, nll          # the body learns the chosen answers (-1.5)


def test_frozen_lower_layers_stay_put_and_the_top_learns(tmp_path, tokenizer):
    """--freeze_layers 1: embeddings and layer 0 never change; layer 1 and the score head train."""
    model = tiny_reward_model(tokenizer)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = reward_model(stage_config(synthetic="addition", n_pairs=16, eval_size=8, lr=1e-3,
                                   batch_size=8, freeze_layers=1, run_dir=str(tmp_path / "run")),
                       model=model, tokenizer=tokenizer, show_progress=False)
    after = model.state_dict()
    frozen = [k for k in before if k.startswith(("model.embed_tokens", "model.layers.0."))]
    trained = [k for k in before if k.startswith(("model.layers.1.", "score"))]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert trained and all(not torch.equal(before[k], after[k]) for k in trained)
    assert out["steps"] == 2
    with pytest.raises(ValueError, match="freeze_layers=3: the model has 2 decoder layers"):
        reward_model(stage_config(synthetic="addition", n_pairs=16, eval_size=8, freeze_layers=3,
                                 run_dir=str(tmp_path / "r2")),
                     model=tiny_reward_model(tokenizer), tokenizer=tokenizer, show_progress=False)


@pytest.fixture(scope="module")
def log_ratio_rm(tmp_path_factory, tokenizer):
    """A tiny log-ratio reward model (r = beta log pi/pi_ref) trained on synthetic pairs, its
    reference a saved folder."""
    ref = tmp_path_factory.mktemp("ref")
    make_tiny_model(tokenizer).save_pretrained(ref)
    tokenizer.save_pretrained(ref)
    run = tmp_path_factory.mktemp("rm_log_ratio")
    cfg = stage_config(model=str(ref), synthetic="addition", n_pairs=96, eval_size=40, lr=1e-3,
                      epochs=2, batch_size=16, beta=0.1, reward_form="log_ratio",
                      run_dir=str(run), system_prompt="Be brief.")
    return {**reward_model(cfg, show_progress=False), "reference": ref}


def full_sequence_logp(model, tokenizer, prompt: str, response: str) -> float:
    """The plain definition: one unpadded sequence, sum of log p over the response and its EOS."""
    from posttrain.rewards.model import encode_parts
    heads, tails = encode_parts(tokenizer, [prompt], [response], "Be brief.")
    ids = torch.tensor([heads[0] + tails[0] + [tokenizer.eos_token_id]])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
    targets = ids[0, 1:]
    return logp[torch.arange(len(targets)), targets][len(heads[0]) - 1:].sum().item()


def test_log_ratio_reward_model_learns_and_scores_beta_log_pi_over_pi_ref(log_ratio_rm, tokenizer):
    from transformers import AutoModelForCausalLM
    before, after = log_ratio_rm["eval_before"], log_ratio_rm["eval_after"]
    assert before["rm/eval_accuracy"] == 0.0 and before["rm/eval_margin"] == 0.0  # pi = pi_ref: ties
    assert after["rm/eval_accuracy"] > 0.6 and after["rm/eval_margin"] > 0, after
    assert after["rm/eval_accuracy@answer>no_answer"] > 0.9, after
    folder = log_ratio_rm["final_model"]
    stats = json.loads(open(f"{folder}/reward_stats.json").read())
    assert stats["form"] == "log_ratio" and stats["beta"] == 0.1
    assert stats["reference"] == str(log_ratio_rm["reference"].resolve())
    raw = RewardModel(folder, normalize=False, system_prompt="Be brief.")
    prompts = ["What is 12 + 30?", "What is 12 + 30?", "What is 5 + 7?"]
    answers = ["42", "12 + 30 = 43.", "I cannot answer that question."]
    policy = AutoModelForCausalLM.from_pretrained(folder)
    ref = AutoModelForCausalLM.from_pretrained(log_ratio_rm["reference"])
    expected = [0.1 * (full_sequence_logp(policy, tokenizer, p, a) - full_sequence_logp(ref, tokenizer, p, a))
                for p, a in zip(prompts, answers)]
    torch.testing.assert_close(raw(prompts, answers), torch.tensor(expected), atol=1e-4, rtol=1e-4)
    # a rollout's group (prompts repeated) runs the prompt once and scores the same
    torch.testing.assert_close(raw(prompts[:1] * 3, answers),
                               torch.cat([raw(prompts[:1], [a]) for a in answers]), atol=1e-4, rtol=1e-4)
    rm = RewardModel(folder, normalize=True, system_prompt="Be brief.")
    torch.testing.assert_close(rm(prompts, answers), (raw(prompts, answers) - stats["mean"]) / stats["std"])


def test_trainer_uses_a_log_ratio_reward_model(tmp_path, log_ratio_rm, tokenizer):
    cfg = toy_config(tmp_path, "--steps", "1", "--reward.model", log_ratio_rm["final_model"],
                     "--reward.functions", "", "--reward.verifier", "math",
                     "--reward.correct_reward", "0", "--data.system_prompt", "Be brief.")
    train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows and all(r["reward/mean"] == pytest.approx(r["reward/model_score"], abs=1e-5) for r in rows)
    assert any(r["reward/model_score"] != 0 for r in rows)


def test_reward_model_moves_with_its_reference(log_ratio_rm):
    rm = RewardModel(log_ratio_rm["final_model"]).to("meta")    # the trainer: .to(policy device)
    assert {p.device.type for m in (rm.model, rm.reference) for p in m.parameters()} == {"meta"}


def test_log_ratio_reward_model_errors(tmp_path, log_ratio_rm, tokenizer):
    import shutil
    with pytest.raises(ValueError, match="head_lr=0.1 applies to reward_form=score_head"):
        reward_model(stage_config(synthetic="addition", reward_form="log_ratio", head_lr=0.1),
                     model=object(), tokenizer=tokenizer)
    moved = tmp_path / "rm"
    shutil.copytree(log_ratio_rm["final_model"], moved)
    stats = json.loads((moved / "reward_stats.json").read_text())
    (moved / "reward_stats.json").write_text(json.dumps({**stats, "reference": str(tmp_path / "gone")}))
    with pytest.raises(FileNotFoundError, match="reference .*gone"):
        RewardModel(moved)
