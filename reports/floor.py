"""The byte floor of one decode step: (weights + attention bytes) / bandwidth, with fallbacks for old records.

A record of the current harness carries `bytes_per_step.weights` and `step_floor_ms`. Older records
carry only the attention bytes (KV, or the Locks summary + selected-page bytes) and `floor_ms` of
those alone; for them the weight bytes are computed from the model preset of the same name (layer
count of the cell), and when no preset matches or no bandwidth is recorded the attention-only
floor is kept and labelled as such.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from .records import Record, dig

log = logging.getLogger(__name__)

RECORDED, PRESET, KV_ONLY = "recorded", "preset", "kv_only"


@dataclass(frozen=True)
class StepFloor:
    floor_ms: float  # NaN when nothing is known
    basis: str  # RECORDED, PRESET (weights computed from the preset) or KV_ONLY (attention bytes alone)
    weights_bytes: float  # NaN unless the basis counts weights
    why_kv_only: str = ""  # what was missing, for KV_ONLY


def _preset_name(model: str) -> str | None:
    """`glm-4-9b-chat-1m` or an HF id `THUDM/glm-4-9b-chat-1m` -> the preset of that name; local paths: None."""
    from ..harness.presets import preset_names

    if not model or model.startswith(("/", ".")):
        return None
    name = model.rsplit("/", 1)[-1] if model.count("/") == 1 else model
    return name if name in preset_names() else None


def preset_weight_bytes(model: str, num_layers: int | None, dtype: str | None) -> float | None:
    """Weight bytes one decode step reads, from the preset geometry (harness/weights.py), or None."""
    from ..harness.presets import build_config
    from ..harness.weights import weights_from_config

    name = _preset_name(model)
    if name is None:
        return None
    layers = num_layers if num_layers is not None and num_layers > 0 else None
    config, _ = build_config(name, layers, 0)
    weights = weights_from_config(config, dtype or "auto")
    return None if weights is None else float(weights["read_per_step"])


def _bandwidth(record: Record) -> float | None:
    value = dig(record, "bytes_per_step", "bandwidth_bytes_per_s") or dig(record, "plan", "hbm_bytes_per_s")
    return float(value) if value else None


def step_floor(record: Record) -> StepFloor:
    """The step floor of a decode record and what it counts."""
    nan = math.nan
    if record.get("step_floor_ms") is not None:
        weights = dig(record, "bytes_per_step", "weights")
        return StepFloor(float(record["step_floor_ms"]), RECORDED, nan if weights is None else float(weights))
    traffic = record.get("bytes_per_step") or {}
    attention = traffic.get("locks") if traffic.get("locks") is not None else traffic.get("dense")
    bandwidth = _bandwidth(record)
    cell = record.get("cell") or {}
    if attention is not None and bandwidth:
        weights, basis = traffic.get("weights"), RECORDED
        if weights is None:
            weights, basis = preset_weight_bytes(str(cell.get("model") or ""), cell.get("num_layers"), cell.get("dtype")), PRESET
        if weights is not None:
            return StepFloor((float(weights) + float(attention)) / bandwidth * 1e3, basis, float(weights))
    if not bandwidth:
        why = "the record has no weight bytes and no copy bandwidth"
    elif attention is None:
        why = "the record has no attention bytes"
    else:
        why = "the record has no weight bytes and the model is not a preset"
    kv_floor = record.get("floor_ms")
    return StepFloor(nan if kv_floor is None else float(kv_floor), KV_ONLY, nan, why)
