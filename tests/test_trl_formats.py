"""TRL's dataset formats (tests/data/trl_formats: the rows of TRL's docs, one file per format)
read by every command that takes them, on a tiny model, one step each; the rest refused in one
line naming the file, row and field before any model loads. Datasets by name from the local
Hugging Face cache, offline."""

import json
import socket
from pathlib import Path

import pytest

from posttrain.config.options import load_config
from posttrain.data.files import load_problems, read_rows
from posttrain.data.formats import (Demonstration, Pair, demonstration, extract_prompt,
                                    preference_pair, trl_type)
from posttrain.stages.common import write_jsonl
from tests.conftest import make_tiny_model, make_tiny_reward_model, stage_config

FORMATS = Path(__file__).resolve().parent / "data" / "trl_formats"
SKY = [{"role": "user", "content": "What color is the sky?"}]
BLUE = [{"role": "assistant", "content": "It is blue."}]
GREEN = [{"role": "assistant", "content": "It is green."}]
MESSAGE = '[{"role": "user", "content": "..."}]'


def path(name: str) -> str:
    return str(FORMATS / f"{name}.jsonl")


def row(name: str) -> dict:
    return json.loads(Path(path(name)).read_text())


def template(tokenizer, messages, generation=True) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


# ---- the rows as data/formats.py reads them ----

def test_each_file_is_the_trl_type_its_name_says():
    assert {p.stem: trl_type(row(p.stem)) for p in sorted(FORMATS.glob("*.jsonl"))} == {
        "conversational_implicit_prompt_preference":
            "a conversational preference (implicit prompt) row",
        "conversational_language_modeling": "a conversational language modeling row",
        "conversational_preference": "a conversational preference row",
        "conversational_prompt_completion": "a conversational prompt-completion row",
        "conversational_prompt_only": "a conversational prompt-only row",
        "conversational_unpaired_preference": "a conversational unpaired preference row",
        "standard_implicit_prompt_preference": "a standard preference (implicit prompt) row",
        "standard_language_modeling": "a standard language modeling row",
        "standard_preference": "a standard preference row",
        "standard_prompt_completion": "a standard prompt-completion row",
        "standard_prompt_only": "a standard prompt-only row",
        "standard_unpaired_preference": "a standard unpaired preference row"}


def test_an_implicit_prompt_is_extracted_as_trl_does():
    """TRL's docs give each implicit-prompt example beside its explicit twin: extract_prompt (the
    shared start, one character earlier before a space) turns one into the other."""
    for form in ("standard", "conversational"):
        implicit = preference_pair(row(f"{form}_implicit_prompt_preference"), "r")
        assert implicit == preference_pair(row(f"{form}_preference"), "r")
    assert preference_pair(row("standard_implicit_prompt_preference"), "r") == Pair(
        "The sky is", " blue.", " green.")
    assert preference_pair(row("conversational_preference"), "r") == Pair(
        tuple(SKY), tuple(BLUE), tuple(GREEN))
    assert extract_prompt("Say: yes", "Say: no") == ("Say:", " yes", " no")
    assert extract_prompt("Hello", "Help") == ("Hel", "lo", "p")
    assert extract_prompt("ab", "abc") is None and extract_prompt("x", "y") is None


def test_demonstrations_of_each_sft_format():
    d = demonstration(row("standard_prompt_completion"), "r")
    assert d == Demonstration(prompt="The sky is", completion=" blue.")
    assert demonstration(row("conversational_prompt_completion"), "r") == Demonstration(
        messages=tuple(SKY + BLUE), start=1)
    assert demonstration(row("conversational_language_modeling"), "r") == Demonstration(
        messages=tuple(SKY + BLUE), start=1)
    assert demonstration(row("standard_language_modeling"), "r") == Demonstration(
        text="The sky is blue.")
    # the project's own (prompt, response) rows, and a text answer to a chat prompt
    assert demonstration({"prompt": SKY, "response": "Blue."}, "r") == Demonstration(
        prompt=tuple(SKY), completion="Blue.")


def test_train_and_eval_read_prompt_only_and_prompt_completion_rows():
    standard = load_problems(path("standard_prompt_completion"), "prompt", "answer")[0]
    # (every column but the prompt stays in meta: reward functions get them all, as under TRL)
    assert (standard.prompt, standard.answer, standard.messages, standard.meta) == (
        "The sky is", " blue.", None, {"completion": " blue."})
    chat = load_problems(path("conversational_prompt_completion"), "prompt", "answer")[0]
    assert (chat.prompt, chat.answer, chat.messages) == ("What color is the sky?", "It is blue.",
                                                         tuple(SKY))
    for form, text in (("standard", "The sky is"), ("conversational", "What color is the sky?")):
        only = load_problems(path(f"{form}_prompt_only"), "prompt", "answer", needs_answer=False)[0]
        assert (only.prompt, only.answer) == (text, "")
    with pytest.raises(ValueError) as e:
        load_problems(path("standard_prompt_only"), "prompt", "answer")
    assert str(e.value) == (
        f"{path('standard_prompt_only')}: row 1: field 'answer' is missing or empty (fields "
        "present: ['prompt']); the verifier scores an answer against it: add the answer (or "
        "TRL's 'completion'), or read prompt-only rows with --reward.verifier none and reward "
        "functions, a judge or a reward model")


REFUSED = [   # (command, file, the one line after "FILE: line|row 1: ")
    ("train", "conversational_language_modeling",
     "a conversational language modeling row (TRL's 'messages') has no prompt to sample from; give "
     "the messages before the answer as 'prompt' and the answer as 'answer' or 'completion', e.g. "
     "dataset.map(lambda r: {'prompt': r['messages'][:-1], 'completion': r['messages'][-1:]})"),
    ("train", "standard_unpaired_preference",
     "a standard unpaired preference row ('label' says whether its 'completion' is good: KTO's "
     "format) is not read by train or eval (as the reference answer); keep the good completions "
     "without 'label', or pair them as 'chosen' / 'rejected' for dpo"),
    ("sft", "conversational_unpaired_preference",
     "a conversational unpaired preference row ('label' says whether its 'completion' is good: "
     "KTO's format) is not read by sft; keep the good completions without 'label', or pair them "
     "as 'chosen' / 'rejected' for dpo"),
    ("sft", "standard_prompt_only",
     "field 'response' (or TRL's 'completion') is missing or empty; this is a standard "
     "prompt-only row, and sft reads prompt-completion, 'messages' or 'text' rows"),
    ("sft", "conversational_implicit_prompt_preference",
     "sft reads a prompt ('prompt') with its completion ('response' or 'completion'), 'messages' "
     "or 'text'; this is a conversational preference (implicit prompt) row (fields present: "
     "['chosen', 'rejected'])"),
    ("dpo", "standard_prompt_completion",
     "field 'chosen' is missing or empty (fields present: ['completion', 'prompt'])"),
    ("reward-model", "conversational_language_modeling",
     "field 'chosen' is missing or empty (fields present: ['messages'])"),
]


@pytest.mark.parametrize("command, name, msg", REFUSED, ids=[f"{c}-{n}" for c, n, _ in REFUSED])
def test_rows_a_command_cannot_read_are_refused_in_one_line_before_any_model(
        command, name, msg, capsys, tmp_path):
    from posttrain.cli import main
    data = ["--data.task", "file"] if command == "train" else []
    label = "row" if command == "train" else "line"
    # the model folder does not exist: the rows are refused before it is looked for
    assert main([command, *data, "--data.train_path", path(name), "--data.eval_path", path(name),
                 "--model.path", str(tmp_path / "no-model"), "--run_dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"{path(name)}: {label} 1: {msg}")


@pytest.mark.parametrize("bad, msg", [
    ({"chosen": 5, "rejected": {"a": 1}},
     f"field 'chosen' holds a int (5); it must be text or a list of chat messages {MESSAGE}"),
    ({"prompt": "q", "chosen": "a", "rejected": {"a": 1}},
     "field 'rejected' holds a dict ({'a': 1}); it must be text or a list of chat messages "
     + MESSAGE),
    ({"chosen": SKY + BLUE, "rejected": "It is green."},
     "field 'chosen' is chat messages but 'rejected' is text; both must be of one kind"),
    ({"chosen": "Blue.", "rejected": "Green."},
     "no prompt: 'chosen' and 'rejected' share no leading prompt (they differ from their first "
     "character); give the prompt in field 'prompt' (text, as the responses)"),
    ({"prompt": "What color is the sky?", "chosen": BLUE, "rejected": GREEN},
     "no prompt (field 'prompt' is text and the responses chat messages: TRL then reads the prompt "
     "from the responses' shared start): 'chosen' and 'rejected' share no leading prompt (they "
     "differ from their first message); give the prompt in field 'prompt' (chat messages, as the "
     "responses)"),
    ({"prompt": SKY, "chosen": SKY + BLUE, "rejected": GREEN},
     "field 'chosen': its first message is the user's; a response starts with the assistant's message"),
    ({"chosen": SKY + BLUE, "rejected": SKY + BLUE + SKY},
     "no prompt: 'chosen' and 'rejected' share no leading prompt (one is the start of the other); "
     "give the prompt in field 'prompt' (chat messages, as the responses)"),
])
def test_bad_preference_rows_are_refused_with_the_exact_line(tmp_path, tokenizer, bad, msg):
    from posttrain.stages.preference import dpo
    from posttrain.stages.reward_model import reward_model
    write_jsonl(tmp_path / "bad.jsonl", [bad])
    bad_file = str(tmp_path / "bad.jsonl")
    for command in (dpo, reward_model):    # model=object(): the rows are refused before it is used
        with pytest.raises(ValueError) as e:
            command(stage_config(data=bad_file, eval_data=bad_file), model=object(), tokenizer=tokenizer)
        assert str(e.value) == f"{tmp_path / 'bad.jsonl'}: line 1: {msg}"


# ---- each format through each command that reads it, one step on a tiny model ----

def spy(monkeypatch, module, name: str) -> list:
    """Record the arguments of every call to `module.name` (which still runs)."""
    calls, real = [], getattr(module, name)

    def recording(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, recording)
    return calls


def stage(name: str, tmp_path, **kw):
    return stage_config(data=path(name), eval_data=path(name), batch_size=1, max_len=16,
                        run_dir=str(tmp_path / "run"), lr=1e-3, **kw)


@pytest.mark.parametrize("name", ["standard_prompt_completion", "conversational_prompt_completion",
                                  "conversational_language_modeling", "standard_language_modeling"])
def test_sft_trains_on_each_format(name, tmp_path, tokenizer, monkeypatch):
    import posttrain.stages.sft as sft_module
    calls = spy(monkeypatch, sft_module, "pack")
    out = sft_module.sft(stage(name, tmp_path), model=make_tiny_model(tokenizer), tokenizer=tokenizer,
                         show_progress=False)
    assert out["steps"] == 1
    _, prompts, responses, _, masks = calls[0]
    eos = "<|im_end|>"
    expected = {   # (prompt, response) as the policy reads and writes them
        "standard_prompt_completion": (template(tokenizer, [{"role": "user", "content": "The sky is"}]),
                                       " blue." + eos),
        "conversational_prompt_completion": (template(tokenizer, SKY), "It is blue." + eos),
        "conversational_language_modeling": (template(tokenizer, SKY), "It is blue." + eos),
        "standard_language_modeling": ("The", " sky is blue." + eos)}[name]
    assert (tokenizer.decode(prompts[0]), tokenizer.decode(responses[0])) == expected
    assert masks is None or masks == [[1] * len(responses[0])]


def test_sft_on_a_conversation_trains_on_the_assistant_turns_only(tokenizer):
    from posttrain.stages.rows import demo_prompt_ids, demo_response
    turns = [*SKY, *BLUE, {"role": "user", "content": "And at night?"},
             {"role": "assistant", "content": "Black."}, {"role": "user", "content": "Thanks."}]
    demo = demonstration({"messages": turns}, "r")
    cfg = stage_config(max_len=64)
    ids, mask = demo_response(tokenizer, cfg, demo)
    assert tokenizer.decode(demo_prompt_ids(tokenizer, cfg, demo)) == template(tokenizer, SKY)
    assert tokenizer.decode(ids) == ("It is blue.<|im_end|>\n<|im_start|>user\nAnd at night?"
                                     "<|im_end|>\n<|im_start|>assistant\nBlack.<|im_end|>")
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "It is blue.<|im_end|>Black.<|im_end|>"
    # (the rendering is the template's: the whole conversation, less what follows the last answer)
    whole = template(tokenizer, turns[:4], generation=False)
    assert template(tokenizer, SKY) + tokenizer.decode(ids) + "\n" == whole


PAIRS = ["standard_preference", "standard_implicit_prompt_preference", "conversational_preference",
         "conversational_implicit_prompt_preference"]


def expected_pair(name: str, tokenizer) -> tuple[str, str, str]:
    if name.startswith("standard"):
        return (template(tokenizer, [{"role": "user", "content": "The sky is"}]), " blue.", " green.")
    return template(tokenizer, SKY), "It is blue.", "It is green."


@pytest.mark.parametrize("name", PAIRS)
def test_dpo_trains_on_each_preference_format(name, tmp_path, tokenizer, monkeypatch):
    """The conversational responses are the chat template's rendering after the prompt, through
    EOS: the tokens of their content and EOS, not the repr of a list of messages."""
    import posttrain.stages.preference as preference
    calls = spy(monkeypatch, preference, "pack")
    out = preference.dpo(stage(name, tmp_path), model=make_tiny_model(tokenizer), tokenizer=tokenizer,
                         show_progress=False)
    assert out["steps"] == 1 and out["train_pairs"] == 1 and out["eval_pairs"] == 1
    _, prompts, responses = calls[0][:3]
    prompt, chosen, rejected = expected_pair(name, tokenizer)
    eos = tokenizer.eos_token_id
    assert [tokenizer.decode(p) for p in prompts] == [prompt, prompt]
    assert responses == [tokenizer(chosen, add_special_tokens=False)["input_ids"] + [eos],
                         tokenizer(rejected, add_special_tokens=False)["input_ids"] + [eos]]


@pytest.mark.parametrize("name", PAIRS)
def test_a_reward_model_trains_on_each_preference_format(name, tmp_path, tokenizer, monkeypatch):
    """A score head reads a response as the policy's answers are read in RLHF: its text."""
    import posttrain.rewards.model as rm
    from posttrain.stages.reward_model import reward_model
    calls = spy(monkeypatch, rm, "pair_scores")
    out = reward_model(stage(name, tmp_path), model=make_tiny_reward_model(tokenizer),
                       tokenizer=tokenizer, show_progress=False)
    assert out["steps"] == 1 and out["train_pairs"] == 1
    _, heads, chosen, rejected = calls[0][:4]
    prompt, good, bad = expected_pair(name, tokenizer)
    assert (tokenizer.decode(heads[0]), chosen, rejected) == (
        prompt, [tokenizer(good, add_special_tokens=False)["input_ids"]],
        [tokenizer(bad, add_special_tokens=False)["input_ids"]])


TRAIN = ["--steps", "1", "--rollout.prompts_per_step", "1", "--rollout.group_size", "2",
         "--rollout.max_new_tokens", "4", "--data.eval_size", "1", "--tensorboard", "false",
         "--threads", "2", "--checkpoint.every_minutes", "null", "--reward.workers", "0"]


@pytest.mark.parametrize("name", ["standard_prompt_only", "conversational_prompt_only",
                                  "standard_prompt_completion", "conversational_prompt_completion"])
def test_train_and_eval_on_each_prompt_format(name, tmp_path, tokenizer):
    from posttrain.rl.loop import train
    from posttrain.stages.evaluate import evaluate_model
    score = (["--reward.verifier", "none", "--reward.functions", "tests.toy_rewards:always_one"]
             if name.endswith("only") else ["--reward.verifier", "exact"])
    cfg = load_config(None, [*TRAIN, *score, "--data.task", "file", "--data.train_path", path(name),
                             "--data.eval_path", path(name), "--run_dir", str(tmp_path / "run")])
    out = train(cfg, model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert out["steps"] == 1
    eval_cfg = load_config(None, [*TRAIN, *score, "--data.task", "file", "--data.train_path",
                                  path(name), "--data.eval_path", path(name), "--run_dir", "none"])
    res = evaluate_model(eval_cfg, show_progress=False, model=make_tiny_model(tokenizer),
                         tokenizer=tokenizer)
    assert (res["problems"], res["of"]) == (1, 1)


# ---- a dataset by name from the local Hugging Face cache ----

def hub_cache(root: Path, repo: str, splits: dict[str, list[dict]]) -> Path:
    """A dataset as `hf download --repo-type dataset REPO` leaves it in the hub cache:
    datasets--ORG--NAME/snapshots/<commit>/data/<split>-00000-of-00001.parquet, refs/main."""
    import pandas as pd
    folder = root / f"datasets--{repo.replace('/', '--')}"
    commit = "d" * 40
    (folder / "snapshots" / commit / "data").mkdir(parents=True)
    for split, rows in splits.items():
        data = folder / "snapshots" / commit / "data"
        pd.DataFrame(rows).to_parquet(data / f"{split}-00000-of-00001.parquet")
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(commit)
    return folder


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    """An empty hub cache, and no network: a connection attempt fails the test."""
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    return tmp_path / "hub"


def test_a_dataset_name_and_split_are_read_from_the_cache_offline(offline_cache, tmp_path, tokenizer):
    pairs = [row(n) for n in ("conversational_preference", "conversational_implicit_prompt_preference")]
    hub_cache(offline_cache, "org/sky", {"train": pairs, "test": pairs[:1]})
    columns = [{"prompt": None, **r} for r in pairs]   # (a parquet table: a column in every row)
    assert read_rows("org/sky") == columns and read_rows("org/sky:test") == columns[:1]
    from posttrain.stages.preference import dpo
    out = dpo(stage_config(data="org/sky", eval_data="org/sky:test", batch_size=2, max_len=16,
                           run_dir=str(tmp_path / "run")),
              model=make_tiny_model(tokenizer), tokenizer=tokenizer, show_progress=False)
    assert (out["train_pairs"], out["eval_pairs"], out["source"]) == (2, 1, "org/sky")
    with pytest.raises(ValueError, match=r"data org/sky split 'validation' in the Hugging Face "
                                         r"cache could not be read: ValueError: Unknown split"):
        read_rows("org/sky:validation")


def test_a_dataset_not_in_the_cache_is_refused_naming_the_cache_and_the_fetch(offline_cache, tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        read_rows("org/elsewhere:train")
    assert str(e.value) == (
        f"data 'org/elsewhere' is no file here and no dataset in the Hugging Face cache "
        f"{offline_cache} (looked up offline; data are never downloaded at run time): fetch it "
        "once where there is a network with `hf download --repo-type dataset org/elsewhere` "
        "(HF_HOME / HF_HUB_CACHE pointing at this cache), or save it as a folder with "
        "datasets.load_dataset('org/elsewhere').save_to_disk(FOLDER) and give the folder")
    with pytest.raises(FileNotFoundError, match="does not exist"):   # a file name: a missing file
        read_rows("data/train.jsonl")


def test_a_saved_datasets_folder_of_trl_rows(tmp_path):
    import datasets
    datasets.Dataset.from_list([row("conversational_implicit_prompt_preference")]).save_to_disk(
        str(tmp_path / "ds"))
    pair = preference_pair(read_rows(tmp_path / "ds")[0], "r")
    assert pair == Pair(tuple(SKY), tuple(BLUE), tuple(GREEN))
