"""Decode records -> the markdown table `locks bench decode` prints at the end (pure function).

One row per cell (the newest record of a cell wins), ordered by setup, context, batch, then arm;
a second table gives the noise (sd/mean of the timed steps) per arm.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable

DECODE_SCHEMA = "locks.bench.decode/1"
DASH = "—"

HEADER = ["Model", "Context", "Batch", "Arm", "Status", "TPOT ms (mean ± sd)", "sd/mean", "p50", "p99", "n",
          "tok/s", "vs fastest dense", "Steady TTFT ms", "Build ms", "KV MB/step", "Floor ms", "Guards"]
ALIGN = "llrllrrrrrrrrrrrl"


def _tokens(n: int | None) -> str:
    if n is None:
        return DASH
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _num(value, digits: int = 2) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def latest_by_cell(records: Iterable[dict]) -> list[dict]:
    """Decode records, one per cell identity: the last one appended wins."""
    latest: dict[str, dict] = {}
    for record in records:
        if record.get("schema") == DECODE_SCHEMA and isinstance(record.get("cell"), dict):
            latest[json.dumps(record["cell"], sort_keys=True, default=str)] = record
    return list(latest.values())


def _sort_key(record: dict) -> tuple:
    cell = record["cell"]
    return (str(cell.get("model")), cell.get("num_layers") or 0, str(cell.get("graph_mode")),
            cell.get("context_tokens") or 0, cell.get("batch_size") or 0,
            cell.get("budget_tokens") is not None, cell.get("budget_tokens") or 0, str(cell.get("arm")))


def _arm_label(cell: dict) -> str:
    budget = cell.get("budget_tokens")
    return str(cell.get("arm")) if budget is None else f"{cell.get('arm')} b={budget}"


def _guards(record: dict) -> str:
    guards = record.get("guards") or {}
    if not guards:
        return DASH
    parts = [f"{guards.get('clean_windows', 0)}/{guards.get('windows', 0)} clean"]
    for name in ("lockstep", "throttle", "deployed"):
        status = guards.get(name)
        if status and status not in ("pass", "not_applicable"):
            parts.append(f"{name} {status}")
    return ", ".join(parts)


def _setup(cell: dict) -> tuple:
    return (str(cell.get("model")), cell.get("num_layers"), str(cell.get("graph_mode")),
            cell.get("context_tokens"), cell.get("batch_size"))


def fastest_dense(records: Iterable[dict]) -> dict[tuple, float]:
    """(model, layers, graph mode, context, batch) -> the lowest mean TPOT of an ok dense (budget-less) cell."""
    best: dict[tuple, float] = {}
    for record in records:
        mean = (record.get("tpot_ms") or {}).get("mean")
        if record.get("status") == "ok" and record["cell"].get("budget_tokens") is None and mean:
            key = _setup(record["cell"])
            best[key] = min(best.get(key, mean), mean)
    return best


def _row(record: dict, dense: dict[tuple, float]) -> list[str]:
    cell = record["cell"]
    layers = cell.get("num_layers")
    model = f"{cell.get('model')} ({layers}L)" if layers else str(cell.get("model"))
    head = [model, _tokens(cell.get("context_tokens")), str(cell.get("batch_size")), _arm_label(cell)]
    status = record.get("status", "?")
    if status != "ok":
        reason = _escape(str(record.get("reason") or ""))
        return head + [f"{status}: {reason[:120]}"] + [DASH] * (len(HEADER) - 6) + [_guards(record)]
    tpot = record.get("tpot_ms") or {}
    ttft = record.get("ttft_ms") or {}
    traffic = record.get("bytes_per_step") or {}
    kv_bytes = traffic.get("locks") if traffic.get("locks") is not None else traffic.get("dense")
    return head + [
        "ok",
        f"{_num(tpot.get('mean'))} ± {_num(tpot.get('sd'))}",
        DASH if tpot.get("cv") is None else f"{100 * tpot['cv']:.1f}%",
        _num(tpot.get("p50")),
        _num(tpot.get("p99")),
        str(tpot.get("n", DASH)),
        _num(record.get("throughput_tok_s"), 1),
        _speedup(record, dense),
        DASH if not ttft else f"{ttft['steady_mean']:.1f} ± {ttft['steady_sd']:.1f}",
        _num(record.get("build_ms"), 1),
        DASH if kv_bytes is None else f"{kv_bytes / 1e6:.1f}",
        _num(record.get("floor_ms"), 3),
        _guards(record),
    ]


def _speedup(record: dict, dense: dict[tuple, float]) -> str:
    """Fastest dense TPOT / this cell's TPOT at the same setup, context and batch (1.00x for the fastest)."""
    reference, mean = dense.get(_setup(record["cell"])), (record.get("tpot_ms") or {}).get("mean")
    return DASH if not reference or not mean else f"{reference / mean:.2f}×"


def _table(header: list[str], rows: list[list[str]], align: str) -> str:
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def noise_table(records: Iterable[dict]) -> str:
    """Per arm: ok cells, median and max sd/mean of the timed decode steps."""
    by_arm: dict[str, list[float]] = {}
    for record in records:
        cv = (record.get("tpot_ms") or {}).get("cv")
        if record.get("status") == "ok" and cv is not None:
            by_arm.setdefault(_arm_label(record["cell"]), []).append(cv)
    rows = [[arm, str(len(cvs)), f"{100 * statistics.median(cvs):.1f}%", f"{100 * max(cvs):.1f}%"]
            for arm, cvs in sorted(by_arm.items())]
    return _table(["Arm", "ok cells", "median sd/mean", "max sd/mean"], rows, "lrrr") if rows else ""


def decode_table(records: Iterable[dict]) -> str:
    """Markdown: the cell table (every status, reasons inline) and the per-arm noise table."""
    cells = sorted(latest_by_cell(records), key=_sort_key)
    if not cells:
        return "_no decode records_\n"
    dense = fastest_dense(cells)
    parts = [_table(HEADER, [_row(r, dense) for r in cells], ALIGN)]
    noise = noise_table(cells)
    if noise:
        parts += ["", noise]
    return "\n".join(parts) + "\n"
