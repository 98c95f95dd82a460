"""User data: JSONL, CSV, Parquet, a folder saved by `datasets`, or a dataset of the local Hugging
Face cache by name (ORG/NAME[:SPLIT], read offline), as rows in TRL's formats (data/formats.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from posttrain.data.formats import problem_parts
from posttrain.data.tasks import Problem

_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
# ORG/NAME, then optionally :SPLIT or :CONFIG:SPLIT (a split as datasets takes it: 'train[:100]')
_HUB_NAME = re.compile(r"([\w.-]+/[\w.-]+)(?::(.+))?")


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a local file or `save_to_disk` folder, or of a dataset in the Hugging Face cache
    named ORG/NAME[:SPLIT] (split 'train' unless named), read with the `datasets` library."""
    import datasets

    p = Path(path).expanduser()
    if not p.exists():
        if p.suffix.lower() in _FORMATS or not (m := _HUB_NAME.fullmatch(str(path))):
            raise FileNotFoundError(f"data file {p} does not exist")
        rest = m[2] or "train"
        config, split = rest.split(":", 1) if ":" in rest.split("[")[0] else (None, rest)
        return cached_hub_rows(m[1], config, split)
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
                         f"{sorted(_FORMATS)}, a datasets folder or ORG/NAME[:SPLIT] of the "
                         "Hugging Face cache")
    if p.stat().st_size == 0:
        raise ValueError(f"data file {p} is empty")
    return _load(f"data file {p} could not be read as {kind}", kind, data_files=str(p), split="train")


def cached_hub_rows(name: str, config: str | None, split: str) -> list[dict[str, Any]]:
    """The rows of `split` of the Hub dataset `name` as the local Hugging Face cache holds it
    (HF_HOME / HF_HUB_CACHE: the snapshot refs/main names, as `hf download` or an earlier
    `datasets.load_dataset` left it), found by huggingface_hub's offline lookup and read as a
    local folder: never a request."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    try:
        folder = snapshot_download(name, repo_type="dataset", local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise FileNotFoundError(
            f"data {name!r} is no file here and no dataset in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE} (looked up offline; data are never downloaded at run time): "
            f"fetch it once where there is a network with `hf download --repo-type dataset {name}` "
            "(HF_HOME / HF_HUB_CACHE pointing at this cache), or save it as a folder with "
            f"datasets.load_dataset({name!r}).save_to_disk(FOLDER) and give the folder") from None
    where = f"data {name}" + (f" (config {config!r})" if config else "") + f" split {split!r}"
    return _load(f"{where} in the Hugging Face cache could not be read", folder, config,
                 split=split)


def _load(what: str, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
    """`datasets.load_dataset(*args, **kwargs)` as rows, quietly; its error is `what`: one line."""
    import datasets

    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)   # its error is ours to report
    datasets.disable_progress_bars()
    try:
        return list(datasets.load_dataset(*args, **kwargs))
    except Exception as e:  # noqa: BLE001 - a broken file (bad JSON line, not Parquet, ...)
        raise ValueError(f"{what}: {_first_line(e)}") from None
    finally:
        datasets.logging.set_verbosity(verbosity)
        datasets.enable_progress_bars()


def _first_line(e: BaseException) -> str:
    """The innermost cause's first line (datasets wraps the parser's own error)."""
    while e.__cause__ is not None or e.__context__ is not None:
        e = e.__cause__ or e.__context__
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def load_problems(path: str | Path, prompt_field: str, answer_field: str,
                  domain_field: str = "domain", needs_answer: bool = True) -> list[Problem]:
    """Problems from prompt-only or prompt-completion rows, standard or conversational (TRL's
    formats, data/formats.py::problem_parts); a bad row is reported with file, row and field.
    `needs_answer` False: a prompt-only row is read with the answer '' (no verifier needs it)."""
    rows = read_rows(path)
    if not rows:
        raise ValueError(f"data file {path} has no rows")
    problems = []
    for i, row in enumerate(rows, start=1):
        prompt, answer, _ = problem_parts(row, f"{path}: row {i}", prompt_field, answer_field,
                                             needs_answer)
        # every column but the prompt (TRL hands reward functions all of them: the answer's too)
        meta = {k: v for k, v in row.items() if k != prompt_field}
        if isinstance(prompt, tuple):   # conversational (TRL): the last user message is its text
            messages = prompt
            prompt = next((m["content"] for m in reversed(messages) if m["role"] == "user"),
                          messages[-1]["content"])
        else:
            messages = None
        problems.append(Problem(prompt, answer, meta, str(row.get(domain_field) or "default"),
                                messages))
    return problems
