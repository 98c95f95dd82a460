"""User data from local files: JSONL, CSV, Parquet, or a folder saved by `datasets`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.data.tasks import Problem

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local file or `save_to_disk` folder, read with the `datasets` library."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"data file {p} does not exist")
    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except Exception as e:  # noqa: BLE001 - any unreadable folder is the user's input
            raise ValueError(f"data folder {p} is not a saved dataset (Dataset.save_to_disk): "
                             f"{_first_line(e)}") from None
        if isinstance(ds, datasets.DatasetDict):
            if "train" not in ds:
                raise ValueError(f"data folder {p} holds the splits {sorted(ds)} but no 'train' "
                                 "split; save the training rows as DatasetDict({'train': ...})")
            ds = ds["train"]
        return list(ds)
    kind = _FORMATS.get(p.suffix.lower())
    if kind is None:
        raise ValueError(f"data file {p}: unknown format {p.suffix!r}; accepted: "
                         f"{sorted(_FORMATS)} or a datasets folder")
    if p.stat().st_size == 0:
        raise ValueError(f"data file {p} is empty")
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)   # its error is ours to report
    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    except Exception as e:  # noqa: BLE001 - a broken file (bad JSON line, not Parquet, ...)
        raise ValueError(f"data file {p} could not be read as {kind}: {_first_line(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        datasets.enable_progress_bars()
    return list(ds)


def _first_line(e: BaseException) -> str:
    """The innermost cause's first line (datasets wraps the parser's own error)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_problems(path: str | Path, prompt_field: str, answer_field: str,
                  domain_field: str = "domain") -> list[Problem]:
    """Problems from a file; a missing or empty field is reported with file, row and field."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"data file {path} has no rows")
    problems = []
    for i, row in enumerate(rows, start=1):
        for name in (prompt_field, answer_field):
            value = row.get(name)
            if value is None or (isinstance(value, str) and not value.strip()):
                raise ValueError(f"{path}: row {i}: field {name!r} is missing or empty "
                                 f"(fields present: {sorted(row)})")
        meta = {k: v for k, v in row.items() if k not in (prompt_field, answer_field)}
        prompt, messages = row[prompt_field], None
        if isinstance(prompt, (list, tuple)):   # conversational (TRL): chat messages
            messages = chat_messages(prompt, f"{path}: row {i}: field {prompt_field!r}")
            prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"),
                          messages[-1]["content"])
        elif not isinstance(prompt, str):
            raise ValueError(f"{path}: row {i}: field {prompt_field!r} holds a "
                             f"{type(prompt).__name__}; it must be text or a list of chat messages "
                             '([{"role": "user", "content": "..."}])')
        problems.append(Problem(prompt, str(row[answer_field]), meta,
                                str(row.get(domain_field) or "default"), messages))
    return problems


def chat_messages(value: Any, where: str) -> tuple[dict[str, str], ...]:
    """A conversational prompt checked: a non-empty list of {"role", "content"} with text values,
    not ending on an assistant message (the policy writes that one)."""
    if not value:
        raise ValueError(f"{where}: an empty list of messages")
    out = []
    for j, m in enumerate(value):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {j} must look like "
                             f'{{"role": "user", "content": "..."}}, got {str(m)[:80]!r}')
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's; a prompt ends before "
                         "the answer the policy writes")
    return tuple(out)
