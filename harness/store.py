"""The JSONL result store: one record per line, appended atomically, readable after any crash.

Atomicity: each record is serialized to one line and written with a single `os.write` on an
O_APPEND descriptor, then fsynced. POSIX appends of one buffer land at the end as one extent, so
concurrent writers never interleave, and a crash can at worst leave a torn *last* line, which the
reader skips with a warning (and the next append starts on a fresh line).
"""

from __future__ import annotations

import gzip
import json
import logging
import math
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

FINAL_STATUSES = frozenset({"ok", "refused", "oom"})  # `error` cells are retried on resume


def cell_key(cell: dict) -> str:
    """Identity of a cell: its knobs as canonical JSON (key order and whitespace never matter)."""
    return json.dumps(cell, sort_keys=True, separators=(",", ":"), default=str)


def append_record(path: str | os.PathLike, record: dict) -> None:
    """Append `record` as one JSON line: one os.write on an O_APPEND fd, then fsync."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(_finite(record), sort_keys=True, separators=(",", ":"), allow_nan=False, default=str)
    if "\n" in line:  # json.dumps escapes newlines inside strings; this would be a bug upstream
        raise ValueError("a record serialized to more than one line")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        payload = line.encode() + b"\n"
        if _ends_torn(fd):
            payload = b"\n" + payload  # seal a torn tail so this record stays on its own line
        written = os.write(fd, payload)
        if written != len(payload):
            raise OSError(f"short write to {path}: {written} of {len(payload)} bytes (disk full?)")
        os.fsync(fd)
    finally:
        os.close(fd)


def _finite(value):
    """NaN/inf -> None, so every line is strict JSON that any reader (jq, pandas, browsers) accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def _ends_torn(fd: int) -> bool:
    size = os.fstat(fd).st_size
    if size == 0:
        return False
    return os.pread(fd, 1, size - 1) != b"\n"


def read_records(path: str | os.PathLike) -> list[dict]:
    """Every complete record of a JSONL file (`.jsonl.gz`: gzip-compressed, as large result sets are kept in
    the repository), in order; torn or corrupt lines are skipped with a warning."""
    path = Path(path)
    if not path.exists():
        return []
    records: list[dict] = []
    with (gzip.open(path, "rb") if path.suffix == ".gz" else path.open("rb")) as handle:
        for number, raw in enumerate(handle, start=1):
            text = raw.strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except (json.JSONDecodeError, UnicodeDecodeError):
                where = "torn last line" if not raw.endswith(b"\n") else "corrupt line"
                log.warning("%s:%d: skipping %s (%d bytes); an interrupted write?", path, number, where, len(raw))
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                log.warning("%s:%d: skipping a line that is not a JSON object", path, number)
    return records


def finished_keys(records: Iterable[dict]) -> set[str]:
    """Keys of cells already stored with a final status: resume skips these."""
    return {cell_key(r["cell"]) for r in records if r.get("status") in FINAL_STATUSES and "cell" in r}


def to_frame(records: Iterable[dict]):
    """Records -> pandas DataFrame: one row per record, `cell.*` and measurement columns flattened."""
    import pandas as pd

    rows = []
    for record in records:
        row = {"schema": record.get("schema"), "status": record.get("status"), "reason": record.get("reason")}
        row.update({f"cell.{k}": v for k, v in record.get("cell", {}).items()})
        for section in ("tpot_ms", "ttft_ms", "bytes_per_step", "guards", "path_check"):
            for key, value in (record.get(section) or {}).items():
                if not isinstance(value, (list, dict)):
                    row[f"{section}.{key}"] = value
        for key in ("build_ms", "floor_ms", "throughput_tok_s"):
            row[key] = record.get(key)
        row["date"] = (record.get("provenance") or {}).get("date")
        rows.append(row)
    return pd.DataFrame(rows)
