"""Read the local JSONL files users supply, with errors that show the expected schema."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any


class DataFileError(FileNotFoundError):
    """A user-supplied data file is missing or malformed; the message carries the expected schema."""


def read_jsonl(path: Path, schema: str) -> list[dict[str, Any]]:
    """All JSON objects of `path`, one per non-blank line."""
    if not path.is_file():
        raise DataFileError(
            f"data file {path} not found; put it there (or pass another data directory). Expected {schema}"
        )
    records = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataFileError(f"{path}:{number}: not valid JSON ({error.msg}). Expected {schema}") from error
        if not isinstance(record, dict):
            raise DataFileError(f"{path}:{number}: a line must be a JSON object. Expected {schema}")
        records.append(record)
    if not records:
        raise DataFileError(f"data file {path} is empty. Expected {schema}")
    return records


def require_field(record: Mapping[str, Any], names: Sequence[str], path: Path, index: int, schema: str) -> Any:
    """The first of `names` present in `record`; DataFileError naming the record and the schema otherwise."""
    for name in names:
        if name in record:
            return record[name]
    raise DataFileError(f"{path}: record {index} has no field {' / '.join(names)}. Expected {schema}")


def seeded_subset(count: int, num_samples: int | None, seed: int, task: str) -> list[int]:
    """Record indices to use, ascending: all of them, or a subset drawn from (seed, task) when smaller."""
    if num_samples is None or num_samples >= count:
        return list(range(count))
    return sorted(random.Random(f"{seed}:{task}").sample(range(count), num_samples))


def iter_records(
    data_file: Path, schema: str, num_samples: int | None, seed: int, task: str
) -> Iterator[tuple[int, dict[str, Any]]]:
    """(index, record) of the seeded subset of `data_file`'s records, in file order."""
    records = read_jsonl(data_file, schema)
    for index in seeded_subset(len(records), num_samples, seed, task):
        yield index, records[index]
