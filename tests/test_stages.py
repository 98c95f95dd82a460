"""SFT and DPO stages on tiny models (docs/algorithms.md §8 SFT warm-up, §9 DPO)."""

import json
import random

import pytest

from posttrain.stages.common import length_buckets, write_jsonl
from posttrain.stages.preference import dpo
from posttrain.stages.sft import sft
from posttrain.rollout.forward import pack
from tests.conftest import make_tiny_model, stage_config


def test_pack_puts_loss_on_response_tokens_only(tokenizer):
    r = pack(tokenizer, [[5, 6, 7], [8]], [[1, 2], [3, 4, 9]])
    assert r.prompt_ids_B_L.tolist() == [[5, 6, 7], [tokenizer.pad_token_id] * 2 + [8]]
    assert r.response_mask_B_T.tolist() == [[1, 1, 0], [1, 1, 1]]


def test_length_buckets_cover_everything_once_with_little_padding():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(1000)]
    batches = length_buckets(lengths, 8, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(1000))
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 10     # random batches of 8 would spread ~75


def test_sft_lowers_the_response_loss(tmp_path, tokenizer):
    rows = [{"prompt": f"What is {a} + {a}?", "response": f"{a} + {a} = {2 * a}"} for a in range(10, 26)]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    out = sft(stage_config(data=str(tmp_path / "sft.jsonl"), lr=3e-3, epochs=6, batch_size=4,
                          run_dir=str(tmp_path / "run")),
              model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert out["last_loss"] < 0.6 * out["first_loss"], out
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()


@pytest.mark.parametrize("lora", [{}, dict(lora_rank=8)], ids=["full", "lora"])
def test_dpo_learns_the_preference(tmp_path, tokenizer, lora):
    rows = [{"prompt": f"Question {i}", "chosen": "Yes, gladly.", "rejected": "No way."}
            for i in range(16)]
    write_jsonl(tmp_path / "pairs.jsonl", rows)
    out = dpo(stage_config(data=str(tmp_path / "pairs.jsonl"), lr=1e-2 if lora else 1e-3, epochs=3,
                           batch_size=8, beta=0.1, run_dir=str(tmp_path / "run"), **lora),
              model=make_tiny_model(tokenizer, init_range=0.5 if lora else 0.02), tokenizer=tokenizer,
              show_progress=False)
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train_rows = [m for m in metrics if "dpo/margin" in m]
    assert train_rows[0]["dpo/margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at start
    assert train_rows[-1]["dpo/margin"] > 0.1 and out["reward_accuracy_last"] == 1.0
    # the 3 pairs split off for evaluation were never trained on, and are won too
    assert out["eval_pairs"] == 3 and out["eval_after"]["dpo/eval_reward_accuracy"] == 1.0
    assert not (tmp_path / "run" / "final_model" / "adapter_config.json").exists()   # (merged)


def test_dpo_on_synthetic_pairs_reports_held_out_pairs_and_behaviour(tmp_path, tokenizer):
    out = dpo(stage_config(synthetic="addition", n_pairs=48, eval_size=16, lr=1e-3, epochs=2,
                          batch_size=8, beta=0.1, run_dir=str(tmp_path / "run")),
              model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert out["source"] == "synthetic:addition" and out["train_pairs"] == 48
    after = out["eval_after"]
    # concise > rambling and answer > no answer differ in wording a tiny model can pick up
    assert after["dpo/eval_reward_accuracy@concise>rambling"] > 0.5, after
    assert set(out["behaviour_before"]) == {"eval/accuracy", "eval/length_mean"}
    assert after["dpo/eval_margin"] > 0
    # (what these figures count: test_held_out_behaviour_counts_the_verifiers_verdicts)
    assert 0 < out["behaviour_before"]["eval/length_mean"] <= 48      # greedy, at most 48 new tokens


class ScriptedEngine:
    """Answers each problem of `replies` (prompt -> text) with that text and an EOS, whatever
    the weights: held-out answers known in advance."""

    def __init__(self, tokenizer, replies: dict[str, str]) -> None:
        self.tokenizer, self.replies, self.prompts_seen = tokenizer, replies, []

    def generate(self, prompts, group_size, params, generator=None, seeds=None, respond=None):
        from dataclasses import replace
        tok = self.tokenizer
        texts = []
        for ids in prompts:
            shown = tok.decode(ids)
            [problem] = [q for q in self.replies if q in shown]
            self.prompts_seen.append(problem)
            texts += [self.replies[problem]] * group_size
        responses = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
        rows = [ids for ids in prompts for _ in range(group_size)]
        return replace(pack(tok, rows, responses), group_size=group_size)


def test_held_out_behaviour_counts_the_verifiers_verdicts(tokenizer, monkeypatch):
    """The SFT and DPO stages' before/after figures on answers known in advance: eval/accuracy
    is the share the verifier accepts (4 of 6, counted by hand) and eval/length_mean the mean
    answer length in tokens, EOS included."""
    import posttrain.stages.common as common
    from posttrain.data.tasks import make_task
    task = make_task("addition", 2)
    task.build_eval(6, 1234)
    problems = task.eval_problems
    sums = [p.prompt[len("What is "):-1] for p in problems]          # 'a + b'
    replies = {problems[0].prompt: f"{sums[0]} = {problems[0].answer}.",       # right
               problems[1].prompt: f"{sums[1]} = {int(problems[1].answer) + 1}.",   # off by one
               problems[2].prompt: f"The sum is {problems[2].answer}.",      # right, other words
               problems[3].prompt: "I cannot add.",                          # no number at all
               problems[4].prompt: f"{sums[4]} = {problems[4].answer}",      # right, no full stop
               problems[5].prompt: f"{sums[5]} is {problems[5].answer}."}    # right
    engine = ScriptedEngine(tokenizer, replies)
    monkeypatch.setattr(common, "make_engine", lambda backend, model, tok: engine)
    got = common.held_out_behaviour(make_tiny_model(tokenizer), tokenizer, task, stage_config())
    lengths = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for r in replies.values()]
    assert got == {"eval/accuracy": pytest.approx(4 / 6),
                   "eval/length_mean": pytest.approx(sum(lengths) / 6)}
    assert sorted(engine.prompts_seen) == sorted(replies)     # every held-out problem, once


@pytest.mark.parametrize("row,msg", [({"prompt": "p", "chosen": "a"}, "line 1: field 'rejected'"),
                                     ({"prompt": "p", "chosen": "a", "rejected": "a"}, "identical"),
                                     ({"prompt": " ", "chosen": "a", "rejected": "b"}, "'prompt'")])
def test_bad_preference_rows_are_named(tmp_path, tokenizer, row, msg):
    write_jsonl(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match=msg):
        dpo(stage_config(data=str(tmp_path / "bad.jsonl")), model=object(), tokenizer=tokenizer)


def test_generate_writes_verified_teacher_answers_for_sft(tmp_path, tokenizer):
    from posttrain.config.options import load_config
    from posttrain.stages.generate import generate
    cfg = load_config(None, ["--data.eval_size", "5", "--rollout.max_new_tokens", "4",
                             "--reward.verifier", "none", "--run_dir", "none"])
    out = generate(cfg, 6, tmp_path / "g.jsonl", samples=2, only_correct=False,
                   model=make_tiny_model(tokenizer), tokenizer=tokenizer)
    rows = [json.loads(line) for line in open(tmp_path / "g.jsonl")]
    assert out["written"] == len(rows) == 12 and out["generated"] == 12
    assert {"prompt", "response", "response_ids", "answer", "correct"} <= set(rows[0])
    assert all(tokenizer.decode(r["response_ids"], skip_special_tokens=True) == r["response"] for r in rows)
    assert rows[0]["prompt"] == rows[1]["prompt"] != rows[2]["prompt"]
    kept = generate(cfg, 6, tmp_path / "ok.jsonl", model=make_tiny_model(tokenizer), tokenizer=tokenizer)
    assert kept["written"] == 0     # verifier 'none' accepts nothing: nothing is kept


def test_generate_command_takes_config_overrides(tmp_path, monkeypatch):
    """`posttrain generate --model.path M --data.task subtraction`: a teacher for another domain
    without writing a YAML file."""
    import posttrain.stages.generate
    from posttrain.cli import main
    seen = {}
    monkeypatch.setattr(posttrain.stages.generate, "generate",
                        lambda cfg, n, out, samples, only_correct, **kw: seen.update(cfg=cfg, n=n) or {})
    assert main(["generate", "--model.path", "TEACHER", "--n", "7", "--out", str(tmp_path / "g.jsonl"),
                 "--data.task", "subtraction"]) == 0
    assert (seen["cfg"].data.task, seen["cfg"].model.path, seen["n"]) == ("subtraction", "TEACHER", 7)


def test_generated_responses_keep_the_teachers_stop_string(tmp_path, tokenizer, monkeypatch):
    """An SFT warm-up must end answers as the teacher does ('... = 12.\n\n', not '... = 12.')."""
    from posttrain.config.options import load_config
    from posttrain.stages.generate import generate
    cfg = load_config(None, ["--data.eval_size", "5", "--rollout.max_new_tokens", "4",
                             "--reward.verifier", "none", "--run_dir", "none"])
    monkeypatch.setattr(tokenizer, "batch_decode", lambda ids, **kw: [" 12 + 3 = 15.\n\n"] * len(ids))
    generate(cfg, 2, tmp_path / "g.jsonl", only_correct=False, model=make_tiny_model(tokenizer),
             tokenizer=tokenizer)
    rows = [json.loads(line) for line in open(tmp_path / "g.jsonl")]
    assert [r["response"] for r in rows] == [" 12 + 3 = 15.\n\n"] * 2


def test_sft_on_synthetic_answers_reports_held_out_behaviour(tmp_path, tokenizer):
    from posttrain.data.tasks import make_task
    from posttrain.rewards.verifiers import final_answer
    from posttrain.stages.sft import synthetic_answers

    task = make_task("subtraction", 2)
    task.build_eval(16, 1234)
    rows = synthetic_answers(task, 30, 0)
    held_out = {p.prompt for p in task.eval_problems}
    for row in rows:   # the ground truth, worded as the policy answers, on training problems only
        a, b = (int(x) for x in row["prompt"][len("What is "):-1].split(" - "))
        assert row["response"] == f"{a} - {b} = {a - b}." and final_answer(row["response"]) == str(a - b)
        assert row["prompt"] not in held_out
    out = sft(stage_config(synthetic="subtraction", n_pairs=30, eval_size=16, lr=1e-2, epochs=6,
                          batch_size=6, run_dir=str(tmp_path / "run")),
              model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert out["last_loss"] < 0.5 * out["first_loss"], out
    assert set(out["behaviour_after"]) == {"eval/accuracy", "eval/length_mean"}
    # the tiny model learns the answer's shape (and to stop): shorter than 48 tokens of noise
    assert out["behaviour_after"]["eval/length_mean"] < out["behaviour_before"]["eval/length_mean"]


def test_lr_factor_warms_up_then_decays_to_zero():
    from posttrain.run.optim import lr_factor
    assert [lr_factor(i, 4) for i in range(4)] == [1.0] * 4
    assert [lr_factor(i, 6, 2, "linear") for i in range(7)] == [0.5, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert [round(lr_factor(i, 4, 0, "cosine"), 6) for i in range(5)] == [1.0, 0.853553, 0.5, 0.146447, 0.0]


@pytest.mark.parametrize("schedule,expected", [("constant", [0.5, 1.0, 1.0, 1.0]),
                                               ("linear", [0.5, 1.0, 1.0, 0.5])])
def test_stages_follow_the_learning_rate_schedule(tmp_path, tokenizer, schedule, expected):
    rows = [{"prompt": f"What is {a} + {a}?", "response": f"{2 * a}"} for a in range(10, 18)]
    write_jsonl(tmp_path / "sft.jsonl", rows)
    sft(stage_config(data=str(tmp_path / "sft.jsonl"), lr=1e-3, batch_size=4, epochs=2,
                    schedule=schedule, warmup_steps=2, run_dir=str(tmp_path / "run")),
        model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["optim/lr"] / 1e-3 for r in logged if "optim/lr" in r]
    assert [round(x, 6) for x in lrs] == expected        # 4 steps: 2 of warm-up, then the schedule
    with pytest.raises(ValueError, match="warmup_steps=-1"):
        sft(stage_config(data=str(tmp_path / "sft.jsonl"), warmup_steps=-1), model=make_tiny_model(tokenizer),
            tokenizer=tokenizer, show_progress=False)


def test_sft_trains_on_the_teachers_own_token_ids(tmp_path, tokenizer):
    """A teacher that wrote '\n' '\n' (two tokens) is imitated token for token; the text alone
    re-tokenises to one '\n\n' token the teacher never writes."""
    from posttrain.stages.common import response_ids as _response_ids
    nl = tokenizer("\n", add_special_tokens=False)["input_ids"]
    teacher = tokenizer("12 + 3 = 15", add_special_tokens=False)["input_ids"] + nl + nl
    text = tokenizer.decode(teacher)
    assert tokenizer(text, add_special_tokens=False)["input_ids"] != teacher   # merged
    eos = tokenizer.eos_token_id
    assert _response_ids(tokenizer, text, 256, teacher) == teacher + [eos]
    assert _response_ids(tokenizer, text, 256, teacher + [eos]) == teacher + [eos]   # no second EOS
    assert _response_ids(tokenizer, text, 3, teacher) == teacher[:2] + [eos]
    rows = [{"prompt": "What is 12 + 3?", "response": text, "response_ids": teacher}] * 4
    write_jsonl(tmp_path / "ok.jsonl", rows)
    sft(stage_config(data=str(tmp_path / "ok.jsonl"), batch_size=4, run_dir=str(tmp_path / "run")),
        model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    write_jsonl(tmp_path / "bad.jsonl", rows[:1] + [{**rows[0], "response": "12 + 3 = 16\n\n"}])
    with pytest.raises(ValueError, match="bad.jsonl: line 2: field 'response_ids' does not decode"):
        sft(stage_config(data=str(tmp_path / "bad.jsonl"), run_dir=str(tmp_path / "run2")),
            model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)


def _conversations(n: int, start: int = 0) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"Double {a}."},
                          {"role": "assistant", "content": f"{2 * a}."},
                          {"role": "user", "content": "And half of it?"},
                          {"role": "assistant", "content": f"{a}."}]} for a in range(start, start + n)]


def _held_out_nll_by_hand(model, tokenizer, rows) -> float:
    """-sum log p / tokens over the assistant turns' tokens, one unpadded forward a conversation:
    the tokens after each assistant header through its EOS, found in the rendered text."""
    import torch
    nll, tokens = 0.0, 0
    for row in rows:
        ids = tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True)["input_ids"]
        ids = list(ids)
        head = tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        targets = []   # positions of assistant tokens, through the turn's EOS
        for i in range(len(ids) - len(head)):
            if ids[i:i + len(head)] == head:
                j = i + len(head)
                while ids[j] != tokenizer.eos_token_id:
                    targets.append(j)
                    j += 1
                targets.append(j)
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
        nll -= sum(logp[t - 1, ids[t]].item() for t in targets)
        tokens += len(targets)
    return nll / tokens


def test_sft_with_lora_measures_the_held_out_nll_and_saves_a_merged_model(tmp_path, tokenizer):
    import copy
    import torch
    from transformers import AutoModelForCausalLM
    write_jsonl(tmp_path / "train.jsonl", _conversations(12))
    write_jsonl(tmp_path / "test.jsonl", held := _conversations(5, start=40))
    model = make_tiny_model(tokenizer, init_range=0.5)   # (logits large enough to move under LoRA)
    start = copy.deepcopy(model)
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = sft(stage_config(data=str(tmp_path / "train.jsonl"), eval_data=str(tmp_path / "test.jsonl"),
                           lora_rank=8, lr=1e-2, epochs=4, batch_size=4, eval_every=4,
                           lora_targets=("q_proj", "v_proj", "down_proj", "lm_head"),
                           run_dir=str(tmp_path / "run")),
              model=model, tokenizer=tokenizer, show_progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    nll = {r["step"]: r["eval/nll"] for r in rows if "eval/nll" in r}
    assert sorted(nll) == [0, 4, 8, 12]   # 12 steps: before, every 4, the last one measured once
    # the batched, padded measure of the starting model is the plain one, conversation by conversation
    assert nll[0] == pytest.approx(_held_out_nll_by_hand(start, tokenizer, held), rel=1e-5)
    assert out["eval_nll_before"] == nll[0] and out["eval_nll_after"] == nll[12] < nll[0] - 1.0   # (14.1 -> 11.5 nats)
    # a plain model folder, the adapters merged: it scores the held-out rows as the run last did
    # (the adapted head was tied to the input embedding: merged into its own copy, not into both)
    folder = tmp_path / "run" / "final_model"
    assert not (folder / "adapter_config.json").exists()
    final = AutoModelForCausalLM.from_pretrained(folder)
    assert _held_out_nll_by_hand(final, tokenizer, held) == pytest.approx(nll[12], rel=1e-4)
    # LoRA left the input embeddings and norms alone and moved the adapted projections
    before, after = start.state_dict(), final.state_dict()
    assert torch.equal(before["model.embed_tokens.weight"], final.get_input_embeddings().weight)
    assert not torch.equal(before["model.embed_tokens.weight"], final.get_output_embeddings().weight)
    assert torch.equal(before["model.norm.weight"], after["model.norm.weight"])
    assert not torch.equal(before["model.layers.0.self_attn.q_proj.weight"],
                           after["model.layers.0.self_attn.q_proj.weight"])


def test_stage_lora_and_held_out_options_are_checked_before_any_model_loads(tmp_path, tokenizer):
    from posttrain.config.commands import ConfigError
    from posttrain.stages.reward_model import reward_model
    write_jsonl(tmp_path / "train.jsonl", _conversations(4))
    data = str(tmp_path / "train.jsonl")
    with pytest.raises(ValueError, match="eval_every=2 measures the NLL of held-out rows: give --data.eval_path"):
        sft(stage_config(data=data, eval_every=2), show_progress=False)
    with pytest.raises(ConfigError, match="freeze_layers=1 with lora.rank=4: LoRA already freezes"):
        sft(stage_config(data=data, lora_rank=4, freeze_layers=1), show_progress=False)
    with pytest.raises(ValueError, match="lora.rank=4: reward-model trains every weight"):
        reward_model(stage_config(synthetic="addition", lora_rank=4), show_progress=False)
    with pytest.raises(ValueError, match="eval_every=2 applies to sft .* dpo evaluates its held-out pairs"):
        dpo(stage_config(synthetic="addition", eval_every=2), show_progress=False)
    with pytest.raises(ValueError, match="eval_every=2 applies to sft .* reward-model evaluates"):
        reward_model(stage_config(synthetic="addition", eval_every=2), show_progress=False)
    (tmp_path / "bad.jsonl").write_text('{"messages": "hello"}\n')
    with pytest.raises(ValueError, match="bad.jsonl: line 1: field 'messages' holds text"):
        sft(stage_config(data=data, eval_data=str(tmp_path / "bad.jsonl")), show_progress=False)
