"""`locks bench`: Speed: matched-pair engine sessions and kernel profiles."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..kernels.vllm_backend.settings import BackendSettings
from .errors import fail, stderr_console

app = typer.Typer(help="Speed: matched-pair engine sessions and kernel profiles.", no_args_is_help=True)
_stderr = stderr_console


def _finished_table(records: list[dict]) -> Table:
    table = Table(title="finished cells", title_justify="left", expand=False)
    for name in ("arm", "context", "batch", "status", "TPOT ms", "sd/mean", "guards"):
        table.add_column(name)
    for record in records[-30:]:
        cell, tpot = record["cell"], record.get("tpot_ms") or {}
        guards = record.get("guards") or {}
        arm = cell["arm"] if cell.get("budget_tokens") is None else f"{cell['arm']} b={cell['budget_tokens']}"
        ok = record["status"] == "ok"
        table.add_row(
            arm, str(cell["context_tokens"]), str(cell["batch_size"]),
            record["status"] if ok else f"{record['status']}: {str(record.get('reason'))[:60]}",
            f"{tpot['mean']:.3f} ± {tpot['sd']:.3f}" if ok else "—",
            f"{100 * tpot['cv']:.1f}%" if ok and tpot.get("cv") is not None else "—",
            f"{guards.get('clean_windows', 0)}/{guards.get('windows', 0)} clean, throttle {guards.get('throttle', '—')}"
            if guards else "—",
        )
    return table


@app.command("decode")
def decode(
    plan_file: Optional[Path] = typer.Argument(None, help="YAML plan (default: the packaged default plan)."),
    model: Optional[str] = typer.Option(None, help="Preset (glm-4-9b-chat-1m, llama-3.1-8b, qwen3-4b, tiny-llama; dummy weights), a model dir, a .gguf file or gemma3-270m (real weights)."),
    arms: Optional[str] = typer.Option(None, help="Comma-separated arms: fa3, flashinfer, locks, locks-kv (the published peer), cpu, locks-cpu (CPU engine); Locks with other kernel settings (same pages): locks[select=auto|merge|chunked,scorer_kernel=cuda|transposed|pages]."),
    contexts: Optional[str] = typer.Option(None, help="Comma-separated contexts, e.g. 16k,32k,128k."),
    batch: Optional[str] = typer.Option(None, help="Comma-separated batch sizes, e.g. 1,4,16."),
    budget: Optional[str] = typer.Option(None, help="Comma-separated token budgets of sparse arms (multiples of 16)."),
    layers: Optional[int] = typer.Option(None, help="Override the preset's layer count."),
    windows: Optional[int] = typer.Option(None, help="Timed windows per cell (protocol: 3)."),
    steps: Optional[int] = typer.Option(None, help="Decode steps per window (protocol: 64)."),
    ttft_repeats: Optional[int] = typer.Option(None, help="Steady TTFT repeats (protocol: >= 3)."),
    graph_mode: Optional[str] = typer.Option(None, help="full_decode_only | eager | compile."),
    async_scheduling: Optional[bool] = typer.Option(
        None, "--async-scheduling/--sync-scheduling",
        help="vLLM async scheduling (its default; host work of step n+1 overlaps step n). Plan default: sync."),
    max_model_len: Optional[str] = typer.Option(None, help="Engine max_model_len (default: longest context + decode room)."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-mem", help="vLLM gpu_memory_utilization."),
    summary_format: Optional[str] = typer.Option(None, "--format", help="Locks summary format, e.g. r8i4."),
    seed: Optional[int] = typer.Option(None, help="Prompt and engine seed."),
    require_nvml: Optional[bool] = typer.Option(None, "--require-nvml/--allow-no-nvml", help="Refuse cells without NVML."),
    isolation: Optional[str] = typer.Option(None, help="process (one engine process per arm/context) or inline."),
    peer_config: Optional[str] = typer.Option(None, help="LOCKS_CONFIG value for the locks-kv peer arm."),
    tensor_parallel_size: Optional[int] = typer.Option(
        None, "--tensor-parallel-size", "--tp", help="vLLM tensor parallelism: GPUs per engine (divides the query and KV heads)."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSONL result file (appended; reruns resume)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="List the cells (and which are already stored); run nothing."),
    as_json: bool = typer.Option(False, "--json", help="Print this run's records as a JSON array instead of markdown."),
    single_prefill_from: Optional[str] = typer.Option(
        None, "--single-prefill-from", help="From this context on a cell pays one prefill (no warm-up prefill, TTFT = "
        "that prefill, no steady repeats); plan default 256k."),
    extend_positions: Optional[bool] = typer.Option(
        None, "--extend-positions/--trained-positions", help="Presets only: allow max_model_len past the model's "
        "trained positions (dummy weights; recorded in the cell)."),
    batch_prefill: Optional[str] = typer.Option(
        None, "--batch-prefill", help="per_batch (each batch size its own prefill) or once (one prefill of the "
        "largest batch that fits; smaller batches keep the first b of its requests, largest first)."),
    prefill_attention: Optional[str] = typer.Option(
        None, "--prefill-attention", help="exact, or skip: prefill batches write the KV cache and skip their attention "
        "(decode timing at 512K-1M without ~3-11 min of causal prefill per engine; no TTFT; presets only)."),
    detach: bool = typer.Option(False, "--detach", help="Run in the background, in its own session (survives the "
                                "shell); follow it with `locks bench status OUT`, stop it with `locks bench stop OUT`."),
) -> None:
    """Matched-pair decode ladder: TPOT, TTFT, bytes/step with lockstep, throttle and deployed-path guards."""
    from ..harness.plan import load_plan
    from ..kernels.config import ConfigError

    if model is not None:
        model = _local_model(model)
    overrides = {
        "model": model, "arms": arms, "contexts": contexts, "batch_sizes": batch, "budgets": budget,
        "num_layers": layers, "windows": windows, "steps_per_window": steps, "ttft_repeats": ttft_repeats,
        "graph_mode": graph_mode, "async_scheduling": async_scheduling, "max_model_len": max_model_len,
        "gpu_memory_utilization": gpu_memory_utilization,
        "summary_format": summary_format, "seed": seed, "require_nvml": require_nvml, "isolation": isolation,
        "peer_config": peer_config, "output": str(out) if out is not None else None,
        "tensor_parallel_size": tensor_parallel_size, "single_prefill_from": single_prefill_from,
        "extend_positions": extend_positions, "batch_prefill": batch_prefill, "prefill_attention": prefill_attention,
    }
    try:
        plan = load_plan(plan_file, overrides)
    except (ConfigError, ValueError) as exc:
        raise fail(str(exc), "see `locks bench decode --help` for the knobs and their formats") from None
    if dry_run:
        _dry_run(plan, as_json)
        return
    if detach:
        _launch_detached(plan)
        return
    _run(plan, as_json)


def _local_model(model: str) -> str:
    """`--model` as the plan takes it: a GGUF (gemma3-270m's or a file) becomes the local HF folder converted
    from it once (cached); presets, folders and anything else pass through for the plan to judge."""
    if model != "gemma3-270m" and not model.lower().endswith(".gguf"):
        return model
    from ..suites.model_source import resolve_model_source, vllm_model_dir
    from ..suites.models import INSTALL_HINT, ModelMissingError

    try:
        source = resolve_model_source(model)
        _stderr.print(f"{model}: using its weights as a local HF folder (converted once, then cached)", highlight=False)
        return str(vllm_model_dir(source))
    except ValueError as exc:
        raise fail(str(exc), "pass a .gguf file that exists, a model folder or a preset") from None
    except ModelMissingError as exc:
        raise fail(str(exc), f"install the model extra: {INSTALL_HINT}") from None


def _launch_detached(plan) -> None:
    from ..harness.detach import DetachError, launch
    from ..harness.provenance import reproduce_command
    from ..harness.run_state import RunBusy
    from ..harness.runner import HarnessError, preflight

    try:
        preflight(plan)  # a setup error shows here, not in a log nobody reads
        command = reproduce_command([arg for arg in sys.argv if arg != "--detach"])
        pid, folder = launch(plan, command)
    except (HarnessError, DetachError, RunBusy) as exc:
        raise fail(str(exc), exc.hint) from None
    _stderr.print(f"detached run pid {pid}: state and logs in {folder}/")
    typer.echo(f"locks bench status {plan.output}")


def _dry_run(plan, as_json: bool) -> None:
    from ..harness.runner import plan_cells
    from ..harness.store import cell_key, finished_keys, read_records

    done = finished_keys(read_records(plan.output))
    cells = [{**cell, "stored": cell_key(cell) in done} for group in plan_cells(plan) for cell in group.cells.values()]
    if as_json:
        typer.echo(json.dumps({"max_model_len": plan.effective_max_model_len, "cells": cells}, indent=1))
        return
    typer.echo(f"output {plan.output}")
    for cell in cells:
        mark = "stored" if cell["stored"] else "todo"
        prefills = "1 prefill" if plan.single_prefill(cell["context_tokens"]) else "full protocol"
        if plan.batch_prefill == "once":
            prefills += ", one prefill shared by the batches"
        typer.echo(f"{mark:6} {cell['arm']:10} {cell['workload']:>12} budget={cell['budget_tokens']} "
                   f"max_model_len={cell['max_model_len']} ({prefills})")


def _run(plan, as_json: bool) -> None:
    from ..harness.detach import COMMAND_ENV, DETACHED_ENV
    from ..harness.provenance import reproduce_command
    from ..harness.run_state import RunBusy, read_status_file, store_is_locked
    from ..harness.runner import HarnessError, preflight, run_plan
    from ..harness.store import cell_key, read_records
    from ..kernels.config import ConfigError
    from ..reports.render import render_decode_run

    try:
        preflight(plan)  # before the live table, so a setup error is one clean line
        if store_is_locked(plan.output):  # run_plan takes the lock; this only fails before the live table
            raise RunBusy(Path(plan.output), read_status_file(plan.output))
    except (HarnessError, RunBusy) as exc:
        raise fail(str(exc), exc.hint) from None
    finished: list[dict] = []
    skipped: list[dict] = []
    command = os.environ.get(COMMAND_ENV) or reproduce_command()
    detached = os.environ.get(DETACHED_ENV) == "1"  # no terminal: plain log lines, `locks bench status` shows the rest

    def view():
        state = read_status_file(plan.output)
        line = _progress_line(state, time.time()) if state and state.get("pid") == os.getpid() else "starting"
        return Group(Text(line), _finished_table(finished))

    # The live view wraps its long status line (a soft-wrapped console would crop it at the width).
    with Live(view(), console=Console(stderr=True), refresh_per_second=2, transient=False, auto_refresh=not detached) as live:

        def on_event(kind: str, payload: dict) -> None:
            if kind == "record":
                finished.append(payload)
            elif kind == "skipped":
                skipped.append(payload)
            elif kind == "job":
                budget = "" if payload["budget"] is None else f" budget {payload['budget']}"
                live.console.print(f"[cyan]engine[/] {payload['arm']} @ {payload['context']} tokens{budget}, "
                                   f"batches {payload['batches']}")
            live.update(view())  # the status file already holds this event (runner order)

        try:
            run_plan(plan, command=command, on_event=on_event)
        except HarnessError as exc:
            raise fail(str(exc), exc.hint) from None
        except ConfigError as exc:
            raise fail(str(exc)) from None
        except KeyboardInterrupt:
            raise fail(f"interrupted; {len(finished)} cell(s) of this run are stored in {plan.output}, the cell in "
                       "progress is not", "rerun the same command to resume (finished cells are kept)", code=130) from None
        except OSError as exc:  # the store's disk filled up or went away mid-run
            raise fail(f"writing the run's files failed: {exc.strerror or exc} ({exc.filename or plan.output}); "
                       f"{len(finished)} cell(s) of this run are stored, the cell in progress is not",
                       "free space (or pass --out elsewhere), then rerun the same command: finished cells are kept") from None
    if skipped:
        _stderr.print(f"resumed: {len(skipped)} cell(s) already stored in {plan.output} were skipped")
    wanted = {cell_key(r["cell"]) for r in finished} | {cell_key(c) for c in skipped}
    records = [r for r in read_records(plan.output) if cell_key(r.get("cell", {})) in wanted]
    if as_json:
        typer.echo(json.dumps(records, allow_nan=False, default=str))
    else:
        typer.echo(render_decode_run(records, title=f"Decode cells of this run ({plan.output})"), nl=False)
    errors = [r for r in finished if r["status"] == "error"]
    if errors:
        _stderr.print(f"[bold red]error:[/] {len(errors)} cell(s) failed; first: {errors[0].get('reason')}")
        where = f"; the engine's log: {errors[0]['engine_log']}" if errors[0].get("engine_log") else ""
        _stderr.print(f"[yellow]hint:[/] rerun the same command to retry them (finished cells are kept){where}")
        raise typer.Exit(1)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def _progress_line(state: dict, now: float) -> str:
    """cells done / total, the current cell and phase, elapsed and time left: the live view's first line."""
    done = f"{state['cells_done']}/{state['cells_total']} cells"
    now_text = _phase_text(state["current"], now) if state.get("current") else "between engines"
    eta = state.get("eta_s")
    left = f"~{_duration(max(eta - (now - state['updated']), 0.0))} left" if eta is not None else "time left: after the first engine"
    return f"{done} | {now_text} | elapsed {_duration(now - state['started'])} | {left}"


def _phase_text(current: dict, now: float) -> str:
    budget = "" if current.get("budget") is None else f", budget {current['budget']}"
    detail = current.get("phase_detail") or {}
    where = []
    if "batch" in detail:
        where.append(f"batch {detail['batch']}")
    if "index" in detail and "of" in detail:
        where.append(f"{detail['index']} of {detail['of']}")
    phase = current.get("phase", "?") + (f" ({', '.join(where)})" if where else "")
    return (f"{current['arm']} @ {current['context']} tokens{budget}: {phase}, "
            f"for {_duration(now - current.get('phase_since', now))}")


@app.command("status")
def status(
    run: Path = typer.Argument(..., help="The run's store (the --out of `locks bench decode`) or its .run folder."),
    as_json: bool = typer.Option(False, "--json", help="Print the status as JSON (with `alive` and the store's records)."),
) -> None:
    """Where a decode run stands: alive or not, cells done of the total, the live phase, time left, finished cells."""
    from ..harness.run_state import read_status, run_dir, store_of
    from ..harness.store import cell_key, read_records

    state = read_status(run)
    if state is None:
        raise fail(f"no run state at {run_dir(run)}", "pass the --out store of a `locks bench decode` run "
                   "(its state folder is <store>.run/)")
    store = store_of(run)
    wanted = {(g["context"], g["arm"], g["budget"]) for g in state.get("groups", [])}
    records = [r for r in read_records(store)
               if (r.get("cell", {}).get("context_tokens"), r.get("cell", {}).get("arm"),
                   r.get("cell", {}).get("budget_tokens")) in wanted]
    newest = {cell_key(r["cell"]): r for r in records}
    if as_json:
        typer.echo(json.dumps({**state, "records": list(newest.values())}, default=str))
        return
    now = time.time()
    alive = "running" if state["alive"] else state["state"]
    typer.echo(f"run     {store}  (pid {state['pid']}, {alive})")
    typer.echo(f"command {state.get('command')}")
    typer.echo(f"started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(state['started']))}, "
               f"elapsed {_duration(state['updated'] - state['started'] if not state['alive'] else now - state['started'])}, "
               f"last update {_duration(now - state['updated'])} ago")
    statuses = ", ".join(f"{n} {name}" for name, n in sorted(state.get("statuses", {}).items()))
    resumed = f"; {state['cells_resumed']} already stored, skipped" if state.get("cells_resumed") else ""
    typer.echo(f"cells   {state['cells_done']} of {state['cells_total']} done" + (f" ({statuses})" if statuses else "")
               + resumed)
    if state.get("current") and state["alive"]:
        typer.echo(f"now     {_phase_text(state['current'], now)}")
        eta = state.get("eta_s")
        if eta is not None:
            eta = max(eta - (now - state["updated"]), 0.0)
        typer.echo(f"left    {'~' + _duration(eta) if eta is not None else 'unknown until the first engine job ends'}"
                   " (estimated from this run's own boots and prefills)")
    elif not state["alive"] and state["state"] == "stopped":
        where = _phase_text(state["current"], state["updated"]) if state.get("current") else "between cells"
        typer.echo(f"stopped no process holds the store; it was at: {where}. Rerun the same command to resume.")
    if state.get("error"):
        typer.echo(f"error   {state['error']}")
    engine_log = (state.get("current") or {}).get("log") if state["alive"] else None
    typer.echo(f"log     {engine_log or run_dir(run) / 'log.txt'}" + (" (this engine's)" if engine_log else ""))
    _stderr.print(_finished_table(list(newest.values())))


@app.command("stop")
def stop(
    run: Path = typer.Argument(..., help="The run's store (the --out of `locks bench decode`) or its .run folder."),
    grace: float = typer.Option(10.0, help="Seconds between SIGTERM and SIGKILL."),
) -> None:
    """Stop a decode run (detached or not): finished cells stay in the store; the same command resumes."""
    from ..harness.run_state import stop_run

    typer.echo(stop_run(run, grace_s=grace))


def _require_devices(arms, cpu_hint: str) -> None:
    """Refuse, before any engine boots, arms whose device this machine lacks (a CUDA arm here would fall onto
    vLLM's CPU platform and run for minutes measuring something else)."""
    from ..harness.arms import get_arm

    cuda = [name for name in arms if get_arm(name).device == "cuda"]
    if cuda:
        import torch

        if not torch.cuda.is_available():
            raise fail(f"arm(s) {', '.join(cuda)} need a CUDA GPU and none is visible", f"run on the GPU machine; {cpu_hint}")


@app.command("tp-check")
def tp_check(
    tp: int = typer.Option(2, "--tp", help="Tensor parallel size compared with TP=1."),
    arms: str = typer.Option("fa3,locks", help="dense,sparse arms (CPU: cpu,locks-cpu)."),
    context: str = typer.Option("16k", help="Prompt length, e.g. 16k (must exceed the budget)."),
    steps: int = typer.Option(32, help="Greedy decode steps compared."),
    budget: int = typer.Option(2048, help="Locks token budget."),
    layers: int = typer.Option(4, help="Layers of the random checkpoint (GLM-4-9B attention geometry)."),
    qk_std: Optional[float] = typer.Option(None, help="std of the q/k projections (larger: peaked attention; default: 0.02 like the rest)."),
    tolerance: float = typer.Option(0.1, help="Allowed excess of Locks' max |delta logprob| over the dense arm's (nats)."),
    graph_mode: str = typer.Option("full_decode_only", help="full_decode_only | eager | compile."),
    dtype: str = typer.Option("bfloat16", help="Checkpoint and engine dtype."),
    seed: int = typer.Option(0, help="Seed of the checkpoint and the prompt."),
    capture_layers: str = typer.Option("0", "--capture-layers", help="Layers whose Locks decode captures are checked per "
                                       "rank and compared across TP (must include 0; eager); '' or none: judge by logprobs."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSONL file the record is appended to."),
    as_json: bool = typer.Option(False, "--json", help="Print the whole record as JSON."),
) -> None:
    """Locks at TP=N vs TP=1 on a seeded random checkpoint, next to the dense arm's own TP drift."""
    from ..harness.lab.tp_check import main as tp_check_main
    from ..harness.workload import parse_size
    from ..kernels.config import ConfigError

    dense, _, sparse = arms.partition(",")
    argv = ["--tp", str(tp), "--arms", arms, "--context", str(parse_size(context)), "--steps", str(steps),
            "--budget", str(budget), "--layers", str(layers), "--tolerance", str(tolerance), "--graph-mode", graph_mode,
            "--dtype", dtype, "--seed", str(seed), "--capture-layers", capture_layers] + (["--out", str(out)] if out else []) + (
            ["--qk-std", str(qk_std)] if qk_std is not None else [])
    if not sparse:
        raise fail(f"--arms {arms!r} must name a dense and a sparse arm", "e.g. --arms fa3,locks")
    try:
        _require_devices((dense, sparse), "on the CPU compare --arms cpu,locks-cpu")
        code = tp_check_main(argv, print_record=as_json)
    except ConfigError as exc:
        raise fail(str(exc), "see `locks bench tp-check --help`") from None
    if code:
        raise typer.Exit(code)


@app.command("kernel")
def kernel(
    preset: str = typer.Option("glm4-9b-1m", help="Geometry: glm4-9b-1m, llama-3.1-8b, qwen3-4b, gemma-3-4b, gemma-3-27b."),
    contexts: str = typer.Option("16k,32k,128k,1m", help="Comma-separated contexts, e.g. 32k,128k,1m."),
    batch: str = typer.Option("1,8", help="Comma-separated batch sizes, e.g. 1,8,32."),
    budget: int = typer.Option(2048, help="Token budget b per (layer, KV head); k = b / 16 pages."),
    summary_format: str = typer.Option("r8i4", "--format", help="Summary format, e.g. r8i4, r8i8, r4i4."),
    combine: str = typer.Option("share_average", help="GQA combine: share_average, group_max, group_mass."),
    replays: int = typer.Option(20, help="Timed CUDA-graph replays per stage."),
    seed: Optional[int] = typer.Option(None, help="Seed of the correctness check and the random data."),
    select: str = typer.Option(BackendSettings.select, help="Selection path as the backend's `select` setting: auto (the merge "
                               "path, as deployed), merge or chunked."),
    scorer_kernel: str = typer.Option(BackendSettings.scorer_kernel, "--scorer-kernel", help="Score kernel as the backend's `scorer_kernel` "
                                      "setting: cuda (deployed; Triton transposed where it declines), transposed, pages."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSONL file the records are appended to."),
    as_json: bool = typer.Option(False, "--json", help="Print the records as a JSON array instead of markdown."),
) -> None:
    """Kernel profile per layer of the kernels the backend runs (its settings resolved as it resolves them): build,
    score, select, sparse decode, Locks step and dense baselines vs the byte floor; each record names the kernels."""
    from ..harness.lab.kernel_bench import KernelBenchConfig, markdown_table, run_kernel_bench
    from ..harness.provenance import reproduce_command
    from ..harness.store import append_record
    from ..harness.workload import parse_size_list
    from ..kernels.config import ConfigError

    try:
        cfg = KernelBenchConfig(preset=preset, contexts=parse_size_list(contexts), batch_sizes=parse_size_list(batch),
                                budget_tokens=budget, summary_format=summary_format, combine=combine, replays=replays,
                                seed=seed, select=select, scorer_kernel=scorer_kernel)
        records = run_kernel_bench(cfg, reproduce_command(), sink=(lambda r: append_record(out, r)) if out else None)
    except ConfigError as exc:
        raise fail(str(exc), "see `locks bench kernel --help`") from None
    typer.echo(json.dumps(records, allow_nan=False, default=str) if as_json else markdown_table(records))
    if any(r["status"] == "error" for r in records):
        raise typer.Exit(1)


@app.command("trace")
def trace(
    arm: str = typer.Option(..., help="One arm: fa3, flashinfer, locks, locks-kv, cpu, locks-cpu."),
    context: str = typer.Option(..., help="Prompt length, e.g. 128k."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="YAML plan for the engine knobs (default plan otherwise)."),
    model: Optional[str] = typer.Option(None, help="Preset or model dir (default: the plan's)."),
    budget: Optional[int] = typer.Option(None, help="Token budget of a sparse arm (default: the plan's first)."),
    layers: Optional[int] = typer.Option(None, help="Override the preset's layer count."),
    steps: int = typer.Option(8, help="Decode steps traced."),
    warm_steps: int = typer.Option(8, help="Untraced decode steps before them."),
    graph_mode: Optional[str] = typer.Option(None, help="full_decode_only | eager | compile."),
    async_scheduling: Optional[bool] = typer.Option(
        None, "--async-scheduling/--sync-scheduling", help="vLLM async scheduling (plan default: sync)."),
    gpu_memory_utilization: Optional[float] = typer.Option(None, "--gpu-mem", help="vLLM gpu_memory_utilization."),
    out: Path = typer.Option(Path("runs/trace"), "--out", help="Folder for trace.jsonl and the chrome trace."),
) -> None:
    """Where one arm's decode step goes: kernel time, idle time and the costliest kernels per step (torch.profiler)."""
    from ..harness.lab.step_trace import markdown, trace_arm
    from ..harness.plan import load_plan
    from ..harness.store import append_record
    from ..harness.workload import parse_size
    from ..kernels.config import ConfigError

    try:
        _require_devices((arm,), "on the CPU trace --arm cpu or --arm locks-cpu")
        tokens = parse_size(context)
        overrides = {"model": model, "arms": arm, "contexts": str(tokens), "batch_sizes": "1", "num_layers": layers,
                     "graph_mode": graph_mode, "gpu_memory_utilization": gpu_memory_utilization,
                     "async_scheduling": async_scheduling, "budgets": str(budget) if budget is not None else None}
        plan = load_plan(plan_file, overrides)
        record = trace_arm(plan, arm, tokens, plan.budgets[0] if plan.budgets else None, steps, warm_steps, out)
    except (ConfigError, ValueError) as exc:
        raise fail(str(exc), "see `locks bench trace --help`") from None
    append_record(out / "trace.jsonl", record)
    typer.echo(markdown(record))
