"""TRL's dataset formats, read row by row (https://huggingface.co/docs/trl/dataset_formats): the
parts each command needs of a row, checked, with a one-line error naming the file, row and field
before any model loads.

A row is *standard* (its columns hold text) or *conversational* (chat messages, a list of
{"role", "content"}), and of one *type* by its columns:

    language modeling    text | messages
    prompt-only          prompt
    prompt-completion    prompt, completion
    preference           prompt, chosen, rejected   (or chosen, rejected: the prompt implicit)

`train` and `eval` read prompt-only and prompt-completion rows (`problem_parts`), `sft`
prompt-completion and language-modeling rows (`demonstration`), `dpo` and `reward-model`
preference rows (`preference_pair`). Rendering conversational parts through the chat template
needs the tokenizer: that is the stages' (stages/rows.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

Messages = tuple[dict[str, str], ...]
Text = str | Messages                   # standard (a string) or conversational (chat messages)
T = TypeVar("T")

_MESSAGE = '{"role": "user", "content": "..."}'
# TRL's types by the columns a row fills (trl/data_utils.py::apply_chat_template's list)
_TYPES = {frozenset({"text"}): "language modeling", frozenset({"messages"}): "language modeling",
          frozenset({"prompt"}): "prompt-only",
          frozenset({"prompt", "completion"}): "prompt-completion",
          frozenset({"prompt", "chosen", "rejected"}): "preference",
          frozenset({"chosen", "rejected"}): "preference (implicit prompt)",
          frozenset({"prompt", "completion", "label"}): "unpaired preference",
          frozenset({"prompt", "completions", "labels"}): "stepwise supervision"}
_COLUMNS = frozenset().union(*_TYPES)


def is_conversational(value: Any) -> bool:
    """Chat messages, as TRL tells them (trl/data_utils.py::is_conversational): a list whose first
    item is a dict with 'role' and 'content'."""
    return (isinstance(value, (list, tuple)) and len(value) > 0 and isinstance(value[0], dict)
            and "role" in value[0] and "content" in value[0])


def trl_type(row: dict[str, Any]) -> str:
    """'a conversational preference row' / 'a standard prompt-only row': TRL's name for the row's
    columns, for errors ('a row of no TRL type' when they match none)."""
    keys = frozenset(k for k in _COLUMNS if row.get(k) is not None)
    if keys not in _TYPES:
        return "a row of no TRL type"
    form = "conversational" if any(is_conversational(row[k]) for k in keys) else "standard"
    return f"a {form} {_TYPES[keys]} row"


def row_label(path: Any) -> str:
    """How the stages number rows in errors: 'line' in a JSON Lines file, 'row' elsewhere."""
    return "line" if str(path).endswith((".jsonl", ".json")) else "row"


def read_each(path: Any, rows: list[dict[str, Any]], parse: Callable[[dict[str, Any], str], T],
              label: str = "row") -> list[T]:
    """`parse(row, where)` of every row, `where` naming the file and row ('d.jsonl: line 3')."""
    if not rows:
        raise ValueError(f"{path}: no rows")
    return [parse(row, f"{path}: {label} {i}") for i, row in enumerate(rows, start=1)]


def _present(row: dict[str, Any]) -> list[str]:
    return sorted(k for k in row if row[k] is not None)


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, (str, list, tuple)) and not
                             (value.strip() if isinstance(value, str) else value))


def messages(value: Any, where: str) -> Messages:
    """A non-empty list of {"role", "content"} with text values (other keys dropped)."""
    if not value:
        raise ValueError(f"{where}: an empty list of messages")
    out = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {j} must look like {_MESSAGE}, got {str(m)[:80]!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return tuple(out)


def chat_messages(value: Any, where: str) -> Messages:
    """A conversational prompt: `messages`, not ending on an assistant message (the policy writes
    that one)."""
    out = messages(value, where)
    if out[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; a prompt ends before "
                         "the answer the policy writes")
    return out


def text(row: dict[str, Any], name: str, where: str) -> Text:
    """Field `name`: text, or chat messages; missing, empty or anything else is refused."""
    value = row.get(name)
    if _missing(value):
        raise ValueError(f"{where}: field {name!r} is missing or empty "
                         f"(fields present: {_present(row)})")
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        return messages(value, f"{where}: field {name!r}")
    raise ValueError(f"{where}: field {name!r} holds a {type(value).__name__} "
                     f"({str(value)[:40]}); it must be text or a list of chat messages [{_MESSAGE}]")


def prompt(row: dict[str, Any], name: str, where: str) -> Text:
    """Field `name` as a prompt: text, or chat messages that end before the assistant's answer."""
    value = text(row, name, where)
    return value if isinstance(value, str) else chat_messages(value, f"{where}: field {name!r}")


def _response(value: Messages, where: str, name: str) -> Messages:
    """Chat messages that answer a prompt: the first is the assistant's."""
    if value[0]["role"] != "assistant":
        raise ValueError(f"{where}: field {name!r}: its first message is the "
                         f"{value[0]['role']}'s; a response starts with the assistant's message")
    return value


def _not_unpaired(row: dict[str, Any], where: str, command: str) -> None:
    """An unpaired preference row's completion may be the bad one: not an answer to learn."""
    if row.get("label") is not None:
        raise ValueError(f"{where}: {trl_type(row)} ('label' says whether its 'completion' is "
                         f"good: KTO's format) is not read by {command}; keep the good completions "
                         "without 'label', or pair them as 'chosen' / 'rejected' for dpo")


def _kind(value: Any) -> str:
    return "chat messages" if is_conversational(value) else "text"


# ---- train, eval: a prompt to sample from and the reference answer that scores it ----

def answer_text(value: Any, where: str, name: str) -> str:
    """A reference answer: text or a number as written; a conversational completion (TRL) its
    last assistant message's content."""
    if not is_conversational(value):
        return str(value)
    said = [m["content"] for m in messages(value, f"{where}: field {name!r}")
            if m["role"] == "assistant"]
    if not said:
        raise ValueError(f"{where}: field {name!r} has no assistant message to take the answer from")
    return said[-1]


def problem_parts(row: dict[str, Any], where: str, prompt_field: str, answer_field: str,
                  needs_answer: bool = True) -> tuple[Text, str, set[str]]:
    """(prompt, reference answer, the columns they came from) of a prompt-only or prompt-completion
    row. The answer is `answer_field`, else TRL's 'completion'; a prompt-only row gets '' when
    nothing needs an answer (`needs_answer` False: rewards from functions, a judge or a reward
    model). A language-modeling row has no prompt to sample from: refused with the fix."""
    if row.get(prompt_field) is None and row.get("messages") is not None:
        raise ValueError(
            f"{where}: {trl_type(row)} (TRL's 'messages') has no prompt to sample from; give the "
            f"messages before the answer as {prompt_field!r} and the answer as {answer_field!r} or "
            "'completion', e.g. dataset.map(lambda r: {'prompt': r['messages'][:-1], "
            "'completion': r['messages'][-1:]})")
    question = prompt(row, prompt_field, where)
    for name in dict.fromkeys((answer_field, "completion")):
        if not _missing(row.get(name)):
            if name == "completion":
                _not_unpaired(row, where, "train or eval (as the reference answer)")
            return question, answer_text(row[name], where, name), {prompt_field, name}
    if needs_answer:
        raise ValueError(
            f"{where}: field {answer_field!r} is missing or empty (fields present: "
            f"{_present(row)}); the verifier scores an answer "
            "against it: add the answer (or TRL's 'completion'), or read prompt-only rows with "
            "--reward.verifier none and reward functions, a judge or a reward model")
    return question, "", {prompt_field}


# ---- sft: a demonstration ----

@dataclass(frozen=True)
class Demonstration:
    """One SFT example, one of three kinds: `prompt` answered by the text `completion`; a
    conversation `messages` whose assistant messages from index `start` on are the target (the
    messages before it are the prompt); or `text` alone (standard language modeling)."""
    prompt: Text = ""
    completion: str | None = None
    messages: Messages = ()
    start: int = 0
    text: str | None = None


def demonstration(row: dict[str, Any], where: str, prompt_field: str = "prompt",
                  response_field: str = "response") -> Demonstration:
    """A prompt-completion row (the completion in `response_field` or TRL's 'completion'; text,
    or the assistant's messages), a conversational language-modeling row ('messages': trained on
    its assistant messages) or a standard one ('text'); any other row is refused, named."""
    if row.get(prompt_field) is not None:
        return _prompt_completion(row, where, prompt_field, response_field)
    if row.get("messages") is not None:
        conversation = text(row, "messages", where)
        if isinstance(conversation, str):
            raise ValueError(f"{where}: field 'messages' holds text; it must be a list of chat "
                             f"messages [{_MESSAGE}] (standard rows put text in 'text')")
        return _conversation(conversation, where)
    if row.get("text") is not None:
        body = text(row, "text", where)
        if not isinstance(body, str):
            raise ValueError(f"{where}: field 'text' holds chat messages; put them in 'messages'")
        return Demonstration(text=body)
    raise ValueError(f"{where}: sft reads a prompt ({prompt_field!r}) with its completion "
                     f"({response_field!r} or 'completion'), 'messages' or 'text'; this is "
                     f"{trl_type(row)} (fields present: {_present(row)})")


def _prompt_completion(row: dict[str, Any], where: str, prompt_field: str,
                       response_field: str) -> Demonstration:
    question = prompt(row, prompt_field, where)
    name = next((n for n in (response_field, "completion") if not _missing(row.get(n))), None)
    if name is None:
        raise ValueError(f"{where}: field {response_field!r} (or TRL's 'completion') is missing or "
                         f"empty; this is {trl_type(row)}, and sft reads prompt-completion, "
                         "'messages' or 'text' rows")
    if name == "completion":
        _not_unpaired(row, where, "sft")
    answer = text(row, name, where)
    if isinstance(answer, str):
        return Demonstration(prompt=question, completion=answer)
    head = question if isinstance(question, tuple) else ({"role": "user", "content": question},)
    return Demonstration(messages=head + _response(answer, where, name), start=len(head))


def _conversation(conversation: Messages, where: str) -> Demonstration:
    """Trained on the assistant messages; the ones before the first of them are the prompt."""
    start = next((j for j, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if start is None:
        raise ValueError(f"{where}: field 'messages' has no assistant message: nothing to train on")
    if start == 0:
        raise ValueError(f"{where}: field 'messages' starts with the assistant's message; sft "
                         "needs a prompt (a user or system message) before it")
    return Demonstration(messages=conversation, start=start)


# ---- dpo, reward-model: a preference pair ----

@dataclass(frozen=True)
class Pair:
    """A preference pair: the prompt and both responses text, or all three chat messages (the
    responses the assistant's)."""
    prompt: Text
    chosen: Text
    rejected: Text


def preference_pair(row: dict[str, Any], where: str, prompt_field: str = "prompt",
                    chosen_field: str = "chosen", rejected_field: str = "rejected") -> Pair:
    """A preference row with an explicit prompt, or an implicit one (TRL's maybe_extract_prompt:
    when the row has no prompt, or one of the other kind than the responses, the prompt is the
    start that `chosen` and `rejected` share; see `extract_prompt`)."""
    chosen, rejected = text(row, chosen_field, where), text(row, rejected_field, where)
    if isinstance(chosen, str) != isinstance(rejected, str):
        raise ValueError(f"{where}: field {chosen_field!r} is {_kind(chosen)} but "
                         f"{rejected_field!r} is {_kind(rejected)}; both must be of one kind")
    if chosen == rejected:
        raise ValueError(f"{where}: {chosen_field!r} and {rejected_field!r} are identical")
    given = row.get(prompt_field)
    if given is not None and is_conversational(given) == isinstance(chosen, tuple):
        question = prompt(row, prompt_field, where)
    else:
        question, chosen, rejected = _implicit(chosen, rejected, where, given, (prompt_field,
                                               chosen_field, rejected_field))
    if isinstance(chosen, tuple):
        chosen, rejected = (_response(chosen, where, chosen_field),
                            _response(rejected, where, rejected_field))
    return Pair(question, chosen, rejected)


def extract_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text] | None:
    """TRL's extract_prompt (trl/data_utils.py): the prompt is `chosen` up to the first character
    (or message) where `chosen` and `rejected` differ, one character earlier when a space
    precedes it; chosen and rejected are the rest. None where TRL's split is an accident of its
    loop: they never differ before one ends, or no prompt is left (they differ at once)."""
    idx = next((i for i in range(min(len(chosen), len(rejected))) if chosen[i] != rejected[i]), None)
    if idx is None or idx == 0:
        return None
    if chosen[idx - 1] == " ":          # (never true of a message)
        idx -= 1
    return (chosen[:idx], chosen[idx:], rejected[idx:]) if idx else None


def _implicit(chosen: Text, rejected: Text, where: str, given: Any,
              names: tuple[str, str, str]) -> tuple[Text, Text, Text]:
    """The implicit prompt of a pair, checked as an explicit one would be."""
    prompt_field, chosen_field, rejected_field = names
    split = extract_prompt(chosen, rejected)
    if split is None:
        unit = "character" if isinstance(chosen, str) else "message"
        short = min(chosen, rejected, key=len)
        how = ("one is the start of the other" if chosen[:len(short)] == rejected[:len(short)]
               else f"they differ from their first {unit}")
        why = "" if given is None else (
            f" (field {prompt_field!r} is {_kind(given)} and the responses {_kind(chosen)}: TRL "
            "then reads the prompt from the responses' shared start)")
        raise ValueError(f"{where}: no prompt{why}: {chosen_field!r} and {rejected_field!r} share "
                         f"no leading prompt ({how}); give the prompt in field {prompt_field!r} "
                         f"({_kind(chosen)}, as the responses)")
    question, chosen, rejected = split
    if isinstance(question, tuple):
        question = chat_messages(question, f"{where}: the prompt {chosen_field!r} and "
                                           f"{rejected_field!r} share")
    return question, chosen, rejected
