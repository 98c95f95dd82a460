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
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    else:
        kind = _FORMATS.get(p.suffix.lower())
        if kind is None:
            raise ValueError(f"data file {p}: unknown format {p.suffix!r}; accepted: "
                             f"{sorted(_FORMATS)} or a datasets folder")
        ds = datasets.load_dataset(kind, data_files=str(p), split="train")
    return list(ds)


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
        problems.append(Problem(str(row[prompt_field]), str(row[answer_field]), meta,
                                str(row.get(domain_field) or "default")))
    return problems
