"""Records of earlier schema versions, read as the current one: the only module that knows old shapes.

`upgrade(record)` takes a record to its schema's current version; readers (the reports) then read current
field names and never branch on a record's age. A migration fills in what the older writer did not record,
derived the way the older reader derived it, and marks what it derived (`step_floor_basis`,
`build_method`). It never touches `cell`, so a cell's identity (resume) is the same before and after.

Decode records, version 1 -> 2: version 2 records say themselves whether the arm is sparse (`sparse`),
always carry `tpot_ms.cv`, `build_method`, `ttft_ms.build_counters_each`, and carry `step_floor_ms` with
its basis whenever the bytes and the bandwidth allow it.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable

from .presets import build_config, preset_names
from .record_schemas import BUILD_SD_MULTIPLE, DECODE, FLOOR_KV_ONLY, FLOOR_PRESET, FLOOR_RECORDED
from .weights import weights_from_config

log = logging.getLogger(__name__)

DECODE_V1 = "locks.bench.decode/1"


def _get(mapping, key):
    return mapping.get(key) if isinstance(mapping, dict) else None


def preset_weight_bytes(model: str, num_layers: int | None, dtype: str | None) -> float | None:
    """Weight bytes one decode step reads for a preset model (an HF id's last part counts), or None."""
    if not model or model.startswith(("/", ".")):
        return None
    name = model.rsplit("/", 1)[-1] if model.count("/") == 1 else model
    if name not in preset_names():
        return None
    config, _ = build_config(name, num_layers if num_layers is not None and num_layers > 0 else None, 0)
    weights = weights_from_config(config, dtype or "auto")
    return None if weights is None else float(weights["read_per_step"])


def _v1_step_floor(record: dict) -> None:
    """Version 1 records before `step_floor_ms`: weights from the preset, else the attention-only floor."""
    if record.get("step_floor_ms") is not None:
        record.setdefault("step_floor_basis", FLOOR_RECORDED)
        return
    traffic = record.get("bytes_per_step") or {}
    attention = traffic.get("locks") if traffic.get("locks") is not None else traffic.get("dense")
    bandwidth = traffic.get("bandwidth_bytes_per_s") or _get(record.get("plan"), "hbm_bytes_per_s")
    cell = record.get("cell") or {}
    if attention is not None and bandwidth:
        weights, basis = traffic.get("weights"), FLOOR_RECORDED
        if weights is None:
            weights = preset_weight_bytes(str(cell.get("model") or ""), cell.get("num_layers"), cell.get("dtype"))
            basis = FLOOR_PRESET
        if weights is not None:
            record["bytes_per_step"] = {**traffic, "weights": float(weights), "bandwidth_bytes_per_s": float(bandwidth)}
            record["step_floor_ms"] = (float(weights) + float(attention)) / float(bandwidth) * 1e3
            record["step_floor_basis"] = basis
            return
    if not bandwidth:
        why = "the record has no weight bytes and no copy bandwidth"
    elif attention is None:
        why = "the record has no attention bytes"
    else:
        why = "the record has no weight bytes and the model is not a preset"
    if record.get("floor_ms") is not None:
        record["step_floor_ms"] = float(record["floor_ms"])
    record["step_floor_basis"], record["step_floor_why"] = FLOOR_KV_ONLY, why


def _v1_build(record: dict) -> None:
    """Records before `build_method` published any difference; keep it only where today's rule would."""
    if "build_method" in record or record.get("build_ms") is None:
        record.setdefault("build_method", "")
        return
    build, sd = float(record["build_ms"]), _get(record.get("ttft_ms"), "steady_sd")
    if build > 0 and (sd is None or build > BUILD_SD_MULTIPLE * sd):
        record["build_method"] = f"version 1 record: first prefill after decode minus steady mean, above {BUILD_SD_MULTIPLE:g} sd"
    else:
        record["build_ms"] = None
        record["build_method"] = f"version 1 record: not significant (within {BUILD_SD_MULTIPLE:g} sd of the steady samples)"


def _decode_v1_to_v2(record: dict) -> dict:
    record = copy.deepcopy(record)
    cell = record.get("cell") or {}
    # Version 1 writers gave every sparse cell a budget and no dense cell one (harness/runner.cell_identity).
    record.setdefault("sparse", cell.get("budget_tokens") is not None)
    tpot = record.get("tpot_ms")
    if isinstance(tpot, dict) and tpot.get("cv") is None and tpot.get("mean") and tpot.get("sd") is not None:
        tpot["cv"] = float(tpot["sd"]) / float(tpot["mean"])
    ttft = record.get("ttft_ms")
    if isinstance(ttft, dict) and not ttft.get("build_counters_each"):
        counters = ttft.get("build_counters")  # records before per-prefill counters: the last prefill's only
        ttft["build_counters_each"] = [counters] if isinstance(counters, dict) and counters.get("build_ms") is not None else []
    _v1_build(record)
    _v1_step_floor(record)
    record["schema"] = DECODE
    return record


MIGRATIONS: dict[str, Callable[[dict], dict]] = {DECODE_V1: _decode_v1_to_v2}


def upgrade(record: dict) -> dict:
    """`record` at its schema's current version (the same object when it already is); unknown schemas pass."""
    seen = set()
    while (schema := record.get("schema")) in MIGRATIONS:
        if schema in seen:  # a migration that does not advance the version would loop
            raise RuntimeError(f"record migration for {schema} did not change the schema")
        seen.add(schema)
        record = MIGRATIONS[schema](record)
    return record
