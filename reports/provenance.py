"""The provenance header: what the tables were measured on, gathered from the records themselves."""

from __future__ import annotations

from collections import Counter

from . import markdown as md
from .records import Record, RecordSet, dig, status_of
from .schemas import DECODE, EVAL, KNOWN_SCHEMAS


def _counted(values: list[str]) -> str:
    """`a (3), b (1)` sorted by value; one value is written alone."""
    counts = Counter(values)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{value} ({count})" for value, count in sorted(counts.items()))


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _commit(record: Record) -> str:
    commit = str(dig(record, "provenance", "git_commit", default="unknown"))[:12]
    return commit + ("-dirty" if dig(record, "provenance", "git_dirty") else "")


def _gpu(record: Record) -> str:
    name = dig(record, "provenance", "gpu", "name", default="no GPU")
    driver = dig(record, "provenance", "gpu", "driver")
    return f"{name} (driver {driver})" if driver else str(name)


def _status_counts(records: list[Record]) -> str:
    counts = Counter(status_of(r)[0] for r in records)
    return ", ".join(f"{counts[s]} {md.STATUS_LABEL.get(s, s)}" for s in sorted(counts, key=lambda s: (s != "ok", s)))


def provenance_header(record_set: RecordSet, notes: md.Notes, sources: list[str] | None = None) -> str:
    """A bullet list: the files read (when given), record counts by status, commits, GPUs, versions, date
    range, weights."""
    records = record_set.all
    lines = ["## Provenance", ""]
    if sources:
        lines.append(f"- Files: {', '.join(f'`{name}`' for name in sources)}")
    for schema in KNOWN_SCHEMAS:
        if record_set.get(schema):
            lines.append(f"- `{schema}`: {_plural(len(record_set.get(schema)), 'record')} ({_status_counts(record_set.get(schema))})")
            for old, count in sorted(record_set.upgraded.get(schema, {}).items()):
                lines[-1] += f"; {count} written as `{old}` and read through harness/record_migrations.py"
    for schema, count in record_set.unknown.items():
        lines.append(f"- `{schema}`: {_plural(count, 'record')} not shown{notes.mark(f'schema {schema} is unknown to this report; known: ' + ', '.join(KNOWN_SCHEMAS))}")
    lines.append(f"- Commits: {_counted([_commit(r) for r in records])}")
    if any(dig(r, "provenance", "git_dirty") for r in records):
        lines[-1] += notes.mark("some records were measured on a dirty working tree; their commit does not reproduce them exactly")
    lines.append(f"- GPUs: {_counted([_gpu(r) for r in records])}")
    versions: dict[str, set[str]] = {}
    for record in records:
        for package, version in (dig(record, "provenance", "versions") or {}).items():
            if version is not None:  # None: not installed where the record was made
                versions.setdefault(str(package), set()).add(str(version))
    if versions:
        lines.append("- Versions: " + ", ".join(
            f"{package} {' / '.join(sorted(found))}" + (" (mixed)" if len(found) > 1 else "")
            for package, found in sorted(versions.items())
        ))
    dates = sorted(str(d) for d in (dig(r, "provenance", "date") for r in records) if d)
    if dates:
        lines.append(f"- Dates: {dates[0]} to {dates[-1]}" if dates[0] != dates[-1] else f"- Date: {dates[0]}")
    decode = record_set.get(DECODE)
    if decode:
        weights = ["dummy" if dig(r, "cell", "dummy_weights") else "real" for r in decode]
        lines.append(f"- Decode weights: {_counted(weights)}")
    engines = [f"{r['engine']}, {r['selection']}" if r.get("selection") else str(r["engine"])
               for r in record_set.get(EVAL) or () if r.get("engine")]  # fmt: skip
    if engines:
        lines.append(f"- Eval engines (how the selection ran): {_counted(engines)}")
    models = sorted({str(m) for m in (dig(r, "cell", "model") for r in records) if m})
    if models:
        lines.append(f"- Models: {', '.join(models)}")
    return "\n".join(lines)


def records_caption(records: list[Record], sources: list[str] | None = None) -> str:
    """One line naming what a figure was drawn from: files, commits, GPUs, dates."""
    parts = [f"records: {', '.join(sources)}"] if sources else []
    parts.append(f"commit {', '.join(sorted({_commit(r) for r in records}))}")
    parts.append(", ".join(sorted({_gpu(r) for r in records})))
    days = sorted({str(d)[:10] for d in (dig(r, "provenance", "date") for r in records) if d})
    if days:
        parts.append(days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}")
    return " · ".join(parts)
