"""A microscope run as terminal tables: a header line, one table per budget, and the column legend."""

from __future__ import annotations

from rich import box
from rich.console import Group
from rich.styled import Styled
from rich.table import Table
from rich.text import Text

from .fidelity import MicroscopeRun

_COLUMNS = ("selector", "γ", "γ min", "γc", "recall", "needle", "|Δs| p50", "p95", "max", "share err", "energy",
            "bounds")
_LEGEND = (
    "γ: attention mass inside the selected pages; γc: the same over contested pages (sink and recent "
    "excluded); recall vs the exact-LSE selection; needle: carrier pages kept when the exact selection "
    "keeps them; |Δs|: page log-mass error; share err: mass-weighted |log Δ| of the group shares; "
    "energy: within-page key variance kept; bounds: locks.md §5 audits violated/checked."
)


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _header(run: MicroscopeRun) -> Text:
    config, geometry = run.config, run.geometry
    correct = sum(info.fullkv_correct for info in run.records)
    capture_err = max((i.capture_output_max_err or 0.0) for i in run.records)
    engine = ""
    agreements = [i.engine_agreement for i in run.records if i.engine_agreement]
    if agreements:
        worst = {key: max(a[key] or 0.0 for a in agreements) for key in ("query_rel_err", "key_rel_err", "value_rel_err")}
        same = sum(bool(a["same_tokens"]) for a in agreements)
        engine = (f"; captured in vLLM with the Locks backend: vs transformers, same greedy tokens {same}/{len(agreements)}, "
                  f"max relative |Δq| {worst['query_rel_err']:.1e}, |Δk| {worst['key_rel_err']:.1e}, "
                  f"|Δv| {worst['value_rel_err']:.1e}")
    return Text.from_markup(
        f"[bold]{run.model_source}[/]: {len(run.records)} needle prompts of ~{config.context_tokens} tokens "
        f"(FullKV correct {correct}/{len(run.records)}), {config.decode_steps} decode steps, "
        f"full-attention layers {list(geometry.global_layers)}, {geometry.num_q_heads} q heads / "
        f"{geometry.num_kv_heads} KV head(s), d={geometry.head_dim}, scale {geometry.scale:.4g} "
        f"(query_pre_attn_scalar), soft-cap {geometry.softcap or 'none'}, capture check max |Δo| {capture_err:.1e}"
        f"{engine}"
    )


def _budget_table(run: MicroscopeRun, budget: int, rows: list[dict]) -> Table:
    """The pooled rows of one budget (run.summary() rows with budget_tokens == budget)."""
    table = Table(
        title=f"budget {budget} tokens = {rows[0]['page_budget']} pages per (layer, KV head), "
        f"{run.config.combine}; samples per row: {rows[0]['samples']} (prompt, layer, step, q head)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for header in _COLUMNS:
        table.add_column(header, justify="left" if header == "selector" else "right", no_wrap=True)
    for row in rows:
        retention = row["needle_retention"]
        table.add_row(
            row["label"], _num(row["gamma"]), _num(row["gamma_min"]), _num(row["gamma_c"]), _num(row["recall"]),
            "—" if retention is None else f"{retention:.3f} ({row['needle_kept']}/{row['needle_eligible']})",
            _num(row["score_err_p50"]), _num(row["score_err_p95"]), _num(row["score_err_max"]),
            _num(row["share_log_err"]), _num(row["captured_energy"]),
            f"{row['bound_violations']}/{row['bound_checks']}",
        )
    return table


def render_fidelity_tables(run: MicroscopeRun) -> Group:
    """The run summary as one rich renderable (header, a table per budget in config order, dim legend)."""
    rows = run.summary()
    tables = [_budget_table(run, b, [r for r in rows if r["budget_tokens"] == b]) for b in run.config.budgets_tokens]
    # Styled, not Text(style=...): it dims every segment, newlines included, exactly as print(..., style=) did.
    return Group(_header(run), *tables, Styled(Text.from_markup(_LEGEND), "dim"))
