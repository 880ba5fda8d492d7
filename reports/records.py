"""Reading JSONL result files (through the harness store) and sorting records by schema."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..harness.record_migrations import upgrade
from ..harness.store import read_records
from .schemas import KNOWN_SCHEMAS

logger = logging.getLogger(__name__)

Record = Mapping[str, Any]


class RecordsError(ValueError):
    """A results file is missing or holds no usable record; `hint` says what to pass instead."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(f"{message}; {hint}" if hint else message)
        self.message, self.hint = message, hint


def read_jsonl(paths: Iterable[str | Path]) -> list[dict[str, Any]]:
    """All records of the given JSONL files, in order (the store's reader: a torn line is skipped with a warning)."""
    records: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise RecordsError(f"results file {path} does not exist", "pass the JSONL written by `locks bench` or `locks eval`")
        records.extend(read_records(path))
    logger.debug("read %d records", len(records))
    return records


@dataclass(frozen=True)
class RecordSet:
    """Records grouped by known schema, plus the ones the report cannot read (kept for the notes)."""

    by_schema: dict[str, list[Record]]
    unknown: dict[str, int] = field(default_factory=dict)
    upgraded: dict[str, dict[str, int]] = field(default_factory=dict)  # current schema -> {written as: count}

    def get(self, schema: str) -> list[Record]:
        return self.by_schema.get(schema, [])

    @property
    def all(self) -> list[Record]:
        return [record for schema in KNOWN_SCHEMAS for record in self.get(schema)]


def split_by_schema(records: Iterable[Record]) -> RecordSet:
    """Group records by `schema`, each at its current version (older versions are upgraded); counts of
    unknown schemas are kept so the report can name them."""
    by_schema: dict[str, list[Record]] = {schema: [] for schema in KNOWN_SCHEMAS}
    unknown: dict[str, int] = {}
    upgraded: dict[str, dict[str, int]] = {}
    for written in records:
        record = upgrade(written)
        schema = str(record.get("schema", "<missing>"))
        if schema in by_schema:
            by_schema[schema].append(record)
            if record.get("schema") != written.get("schema"):
                old = upgraded.setdefault(schema, {})
                old[str(written.get("schema"))] = old.get(str(written.get("schema")), 0) + 1
        else:
            unknown[schema] = unknown.get(schema, 0) + 1
    return RecordSet(by_schema={k: v for k, v in by_schema.items() if v}, unknown=dict(sorted(unknown.items())),
                     upgraded=upgraded)


def dig(record: Record, *path: str, default: Any = None) -> Any:
    """`record[a][b]...`, or `default` when any level is missing or null."""
    value: Any = record
    for key in path:
        if not isinstance(value, Mapping) or value.get(key) is None:
            return default
        value = value[key]
    return value


def status_of(record: Record) -> tuple[str, str]:
    """(status, reason); a record without a status counts as an error so it is never mistaken for data."""
    status = str(record.get("status") or "error").lower()
    reason = str(record.get("reason") or ("no status field" if "status" not in record else ""))
    return status, reason
