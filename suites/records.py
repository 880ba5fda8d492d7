"""Microscope results as JSON: one `locks.microscope/1` record per (prompt, selector, budget, layer).

Each record carries the envelope of docs/architecture.md (schema, kind, cell, status, reason,
provenance, command), the cell's §7 `metrics` (reports/schemas.py) and its per-(step, head)
arrays, so tables can be rebuilt without running the model again.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from ..harness.record_schemas import MICROSCOPE
from .fidelity import MicroscopeRun
from .microscope import CellResult, summarize

SCHEMA = MICROSCOPE
SUMMARY_SCHEMA = "locks.microscope.summary/1"


def _rounded(values: torch.Tensor, digits: int = 6) -> list:
    return torch.round(values.to(torch.float64), decimals=digits).tolist()


def _per_step(cell: CellResult) -> dict:
    """Per-(step, KV head[, query head]) metric arrays of the cell's layer, nested lists in `dims` order."""
    return {
        "dims": ["step", "kv_head", "q_head"],
        "gamma": _rounded(cell.gamma),
        "gamma_c": _rounded(cell.gamma_c),
        "recall": _rounded(cell.recall),  # [step, kv_head]: one shared page set per KV head
        "needle_kept": cell.carrier_kept.tolist(),
        "needle_eligible": cell.carrier_eligible.tolist(),
    }


def cell_records(run: MicroscopeRun, provenance: dict, command: str) -> list[dict]:
    """Every (prompt, arm, budget, layer) cell of a run as a JSON-ready record (reports/schemas.py)."""
    config = run.config
    infos = {info.prompt.record_id: info for info in run.records}
    records = []
    for cell in run.cells:
        records.append(
            {
                "schema": SCHEMA,
                "kind": "microscope",
                "cell": {
                    "selector": cell.arm.scorer,
                    "format": cell.arm.fmt.name if cell.arm.fmt else None,
                    "budget_tokens": cell.budget_tokens,
                    "layer": cell.layer,
                    "record_id": cell.record_id,
                    "model": run.model_source,
                    "suite": "niah",
                    "context_tokens": config.context_tokens,
                    "decode_steps": config.decode_steps,
                    "combine": config.combine,
                    # only captures of another engine name it, so transformers cells keep their identity
                    **({"engine": config.engine} if config.engine != "transformers" else {}),
                },
                "status": "ok",
                "reason": None,
                "provenance": provenance,
                "command": command,
                "metrics": summarize([cell]),
                "page_budget": cell.page_budget,
                "geometry": asdict(run.geometry),
                "prompt": infos[cell.record_id].to_json(),
                "per_step": _per_step(cell),
            }
        )
    return records


def run_summary(run: MicroscopeRun, provenance: dict, command: str) -> dict:
    """The whole run in one JSON object: settings, prompts, and one pooled row per (budget, arm)."""
    config = run.config
    return {
        "schema": SUMMARY_SCHEMA,
        "model": run.model_source,
        "geometry": asdict(run.geometry),
        "settings": {
            "prompts": config.prompts,
            "context_tokens": config.context_tokens,
            "decode_steps": config.decode_steps,
            "seed": config.seed,
            "selectors": [arm.label for arm in config.arms],
            "budgets_tokens": list(config.budgets_tokens),
            "combine": config.combine,
            "engine": config.engine,
        },
        "prompts": [info.to_json() for info in run.records],
        "rows": run.summary(),
        "seconds": {k: round(v, 2) for k, v in run.seconds.items()},
        "provenance": provenance,
        "command": command,
    }
