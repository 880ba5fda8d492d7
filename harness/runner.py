"""Run a decode plan: expand it into engine jobs and cells, skip stored cells, run each engine in its
own process, and append one record per cell as soon as it is known.

Order: for each context, every arm in turn (the matched pair runs close together in time).
"""

from __future__ import annotations

import importlib.util
import logging
import multiprocessing as mp
import os
import queue as queue_module
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import nvml
from . import provenance as prov
from .arms import arm_file_stem, get_arm
from .plan import DecodePlan
from .presets import ModelGeometry, build_config, materialize_model, preset_names, read_model_dir_config
from .run_state import RunBusy, RunStatus, StoreLock, run_dir
from .store import append_record, cell_key, finished_keys, read_records
from .weights import weights_from_config
from .worker import EngineJob, child_main, run_job
from .workload import Workload

log = logging.getLogger(__name__)


class HarnessError(RuntimeError):
    """A run cannot start; `hint` says how to fix it."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


@dataclass
class RunSummary:
    written: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # cells already stored with a final status


Event = Callable[[str, dict], None]


@dataclass(frozen=True)
class CellGroup:
    """The cells one engine job measures: one (context, arm, budget), keyed by batch size in ascending order."""

    context: int
    arm: str
    budget: int | None
    cells: dict[int, dict]  # batch size -> cell_identity(...)


def model_config(plan: DecodePlan) -> tuple[dict, bool, dict]:
    """(the HF config the engine loads, dummy weights?, changes vs the preset); writes nothing."""
    if plan.model in preset_names():
        config, changes = build_config(plan.model, plan.num_layers, plan.effective_max_model_len)
        return config, True, changes
    return read_model_dir_config(plan.model), False, {}


def resolve_model(plan: DecodePlan) -> tuple[str, dict, bool, dict]:
    """(model dir, its config, dummy weights?, changes vs the preset); materializes a preset's dir."""
    config, dummy, changes = model_config(plan)
    model_dir = materialize_model(config, plan.model_cache_dir) if dummy else Path(plan.model).resolve()
    return str(model_dir), config, dummy, changes


def cell_identity(plan: DecodePlan, arm: str, context: int, batch: int, budget: int | None, layers: int,
                  dummy_weights: bool) -> dict:
    """The knobs that identify a cell (field names of reports/schemas.py); resume skips a cell whose
    identity is stored with a final status."""
    model = plan.model if plan.model in preset_names() else str(Path(plan.model).resolve())
    sparse = budget is not None
    return {
        "arm": arm,
        "backend": get_arm(arm).backend,
        "model": model,
        "num_layers": layers,
        "context_tokens": context,
        "batch_size": batch,
        "budget_tokens": budget,
        "workload": Workload(batch, 1, context).name,
        "summary_format": plan.summary_format if sparse else None,
        "scorer": plan.scorer if sparse else None,
        "combine": plan.combine if sparse else None,
        "graph_mode": plan.graph_mode,
        "dummy_weights": dummy_weights,
        "dtype": plan.dtype,
        "max_model_len": plan.max_model_len_for(context),
        "windows": plan.windows,
        "steps_per_window": plan.steps_per_window,
        "seed": plan.seed,
        # Only TP > 1 cells carry the key, so cells stored before TP existed keep their identity (resume).
        **({"tensor_parallel_size": plan.tensor_parallel_size} if plan.tensor_parallel_size > 1 else {}),
        # Likewise only async cells carry this one (stored sync cells keep their identity).
        **({"async_scheduling": True} if plan.async_scheduling else {}),
        **({"positions_extended": True} if plan.extend_positions else {}),
        # A batch measured on the survivors of a larger batch's prefill is another protocol, so another cell.
        **({"batch_prefill": plan.batch_prefill} if plan.batch_prefill != "per_batch" else {}),
        # A cache filled without prefill attention holds other numbers: another cell (exact cells keep their identity).
        **({"prefill_attention": plan.prefill_attention} if plan.prefill_attention != "exact" else {}),
    }


def plan_cells(plan: DecodePlan) -> list[CellGroup]:
    """Every cell of `plan` in run order (context, then arm, then budget of sparse arms), one group per
    engine job. The one expansion of a plan: `run_plan` and `locks bench decode --dry-run` both use it."""
    config, dummy, _ = model_config(plan)
    layers = ModelGeometry.from_config(config, plan.dtype).num_layers
    groups = []
    for context in plan.contexts:
        for arm in plan.arms:
            for budget in plan.budgets if get_arm(arm).sparse else (None,):
                cells = {b: cell_identity(plan, arm, context, b, budget, layers, dummy)
                         for b in sorted(plan.batch_sizes)}
                groups.append(CellGroup(context, arm, budget, cells))
    return groups


def preflight(plan: DecodePlan) -> None:
    """Fail fast, with a fix, on what would make every engine fail: no vLLM, no GPU, missing plugin."""
    if importlib.util.find_spec("vllm") is None:
        raise HarnessError(
            "vLLM is not installed",
            "pip install 'locks-toolkit[gpu]' (vllm==0.24.0) on a CUDA machine; CPU: bash .ci/install-venv.sh",
        )
    cuda_arms = [a for a in plan.arms if get_arm(a).device == "cuda"]
    if cuda_arms:
        import torch

        if not torch.cuda.is_available():
            raise HarnessError(
                f"arm(s) {', '.join(cuda_arms)} need a CUDA GPU and none is visible",
                "run on the GPU machine, or use --arms cpu for a CPU smoke run",
            )
        visible = torch.cuda.device_count()
        if plan.tensor_parallel_size > 1 and plan.tensor_parallel_size > visible:
            raise HarnessError(
                f"--tp {plan.tensor_parallel_size} needs {plan.tensor_parallel_size} GPUs and {visible} are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})",
                f"pass --tp {max(visible, 1)} or fewer, or run on a machine with {plan.tensor_parallel_size} GPUs",
            )
    for name in plan.arms:
        missing = get_arm(name).missing_plugin()
        if missing:
            raise HarnessError(f"arm {name} needs the {missing} plugin, which is not installed",
                               f"pip install {missing}, or drop {name} from --arms")
    check_writable(Path(plan.output))


def check_writable(store: Path) -> None:
    """The store's folder and its run folder can be created and written, before any engine boots."""
    existing = next(p for p in [store.parent, *store.parent.parents] if p.exists())
    if not existing.is_dir():
        raise HarnessError(f"cannot write the store {store}: {existing} is a file, not a folder",
                           "pass --out a path in a folder you can write")
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        run_dir(store).mkdir(exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir(store), prefix=".write-probe-"):
            pass
        if store.exists() and not os.access(store, os.W_OK):
            raise PermissionError(13, "Permission denied", str(store))
    except OSError as exc:
        raise HarnessError(f"cannot write the store {store}: {exc.strerror or exc} ({exc.filename or store})",
                           "pass --out a path in a folder you can write") from None


def run_plan(plan: DecodePlan, command: str | None = None, on_event: Event | None = None) -> RunSummary:
    """Measure every cell of `plan` not already stored; returns the records written and cells skipped.

    The store is locked for the whole run (harness/run_state.py), so a second run on it refuses while
    this one lives and resumes after it; `<store>.run/status.json` follows every event."""
    preflight(plan)
    try:
        lock = StoreLock(plan.output).acquire()
    except RunBusy as exc:
        raise HarnessError(str(exc), exc.hint) from None
    try:
        return _run_locked(plan, command, on_event or (lambda kind, payload: None))
    finally:
        lock.release()


@dataclass(frozen=True)
class _Setup:
    """What every engine job of one run shares: the model, its geometry and the run's provenance."""

    model_dir: str
    config: dict
    dummy: bool
    changes: dict
    geometry: ModelGeometry
    weights: dict
    provenance: dict


def _run_locked(plan: DecodePlan, command: str | None, on_event: Event) -> RunSummary:
    model_dir, config, dummy, changes = resolve_model(plan)
    provenance = prov.collect(command)
    if plan.tensor_parallel_size > 1:  # `gpu` is the first; a TP engine's guards watch all of them
        provenance["gpus"] = nvml.gpu_infos(nvml.engine_devices(plan.tensor_parallel_size))
    setup = _Setup(model_dir, config, dummy, changes, ModelGeometry.from_config(config, plan.dtype),
                   weights_from_config(config, plan.dtype), provenance)
    done = finished_keys(read_records(plan.output))
    groups = plan_cells(plan)
    status = RunStatus(plan.output, provenance["command"], [
        {"context": g.context, "arm": g.arm, "budget": g.budget,
         "batches": [b for b, c in g.cells.items() if cell_key(c) not in done]}
        for g in groups if any(cell_key(c) not in done for c in g.cells.values())])
    user_event = on_event

    def on_event(kind: str, payload: dict) -> None:
        status.on_event(kind, payload)
        user_event(kind, payload)

    try:
        summary = _run_groups(plan, setup, groups, done, on_event)
    except BaseException as exc:
        status.finish("failed" if isinstance(exc, Exception) else "interrupted", f"{type(exc).__name__}: {exc}")
        raise
    status.finish("finished")
    return summary


def _run_groups(plan: DecodePlan, setup: _Setup, groups: list[CellGroup], done: set[str], on_event: Event) -> RunSummary:
    summary = RunSummary()
    provenance, geometry, weights = setup.provenance, setup.geometry, setup.weights
    plan_knobs = asdict(plan)
    plan_knobs["effective_max_model_len"] = plan.effective_max_model_len
    model_info = {"dir": setup.model_dir, "dummy_weights": setup.dummy, "config_changes": setup.changes,
                  "geometry": asdict(geometry), "weights_config": weights}

    def write(cell: dict, status: str, reason: str, engine: dict | None, measurement: dict) -> None:
        """Envelope of docs/architecture.md around one cell's measurements; appended at once."""
        record = {
            "schema": prov.SCHEMA_DECODE,
            "kind": "decode",
            "cell": cell,
            "sparse": get_arm(cell["arm"]).sparse,
            "status": status,
            "reason": reason,
            "provenance": provenance,
            "command": provenance["command"],
            "plan": plan_knobs,
            "model": model_info,
            "engine": engine,
            **measurement,
        }
        append_record(plan.output, record)
        summary.written.append(record)
        on_event("record", record)

    for group in groups:
        todo = {b: c for b, c in group.cells.items() if cell_key(c) not in done}
        for b, c in group.cells.items():
            if b not in todo:
                summary.skipped.append(c)
                on_event("skipped", c)
        if not todo:
            continue
        job = EngineJob(plan, group.arm, group.context, group.budget, tuple(todo), setup.model_dir, setup.dummy,
                        geometry, int(setup.config.get("vocab_size", 32000)),
                        measure_ttft=min(todo) == min(plan.batch_sizes), weights=weights)
        log_path = engine_log_path(plan, group)
        on_event("job", {"arm": group.arm, "context": group.context, "budget": group.budget, "batches": list(todo),
                         "log": str(log_path)})

        def write_logged(cell, status, reason, engine, measurement, log_path=log_path):
            write(cell, status, reason, engine, {**measurement, "engine_log": str(log_path)})

        _run_job(job, todo, write_logged, lambda message: on_event("phase", {"arm": group.arm, "context": group.context,
                                                                               "budget": group.budget, **message}),
                 log_path=log_path)
    return summary


def engine_log_path(plan: DecodePlan, group: CellGroup) -> Path:
    """Where one engine process's stdout and stderr go (vLLM's logs): beside the store, one file per job."""
    budget = "" if group.budget is None else f"-b{group.budget}"
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return run_dir(plan.output) / "engines" / f"{stamp}-{arm_file_stem(group.arm)}-{group.context}{budget}.log"


def _stop_engine(process, grace_s: float = 10.0) -> None:
    """Terminate an engine process (vLLM tears down its own children on SIGTERM), then kill it if it lingers."""
    if process.is_alive():
        process.terminate()
        process.join(timeout=grace_s)
    if process.is_alive():
        process.kill()
        process.join(timeout=grace_s)


def _run_job(job: EngineJob, cells: dict[int, dict], write, on_phase=lambda message: None,
             log_path: Path | None = None) -> None:
    """Run one engine job (in a spawned process unless isolation is inline) and write its records."""
    pending = dict(cells)
    engine: dict | None = None

    def handle(message: dict) -> bool:
        """Returns True when the job is over."""
        nonlocal engine
        kind = message["type"]
        if kind == "phase":
            on_phase(message)
        elif kind == "engine":
            engine = message["info"]
        elif kind == "cell":
            batch = message.pop("batch")
            status, reason = message.pop("status"), message.pop("reason", "")
            message.pop("type")
            write(pending.pop(batch), status, reason, engine, message)
        elif kind == "fatal":
            for batch in list(pending):
                write(pending.pop(batch), message["status"], message["reason"], engine,
                      {"traceback": message.get("traceback")})
            return True
        return kind == "done"

    if job.plan.isolation == "inline":
        old = dict(os.environ)
        from .worker import job_environment

        os.environ.update(job_environment(job))
        try:
            run_job(job, handle)
        finally:
            os.environ.clear()
            os.environ.update(old)
    else:
        context = mp.get_context("spawn")  # CUDA cannot be forked; spawn also isolates vLLM globals
        messages = context.Queue()
        process = context.Process(target=child_main, args=(job, messages, str(log_path) if log_path else None),
                                  name=f"engine-{job.arm}-{job.context}")
        process.start()
        finished = hung = False
        last_message = time.monotonic()
        try:
            while not finished:
                try:
                    finished = handle(messages.get(timeout=0.5))
                    last_message = time.monotonic()
                except queue_module.Empty:
                    if not process.is_alive():
                        break
                    if time.monotonic() - last_message > job.plan.silence_timeout_s:
                        log.error("engine process %s silent for %.0f s; killing it", process.pid, job.plan.silence_timeout_s)
                        hung = True
                        process.kill()
                        break
        except BaseException:  # Ctrl-C or a failure here: the engine must not outlive the run; its cells stay unwritten
            _stop_engine(process)
            raise
        process.join(timeout=120)  # vLLM teardown; a hung one must not block the ladder
        if process.is_alive():
            log.warning("engine process %s did not exit; terminating it", process.pid)
            process.terminate()
            process.join(timeout=30)
        exit_code = process.exitcode
        # Drain anything sent just before the process ended.
        while not finished:
            try:
                finished = handle(messages.get(timeout=0.1))
            except queue_module.Empty:
                break
        reason = f"engine process exited with code {exit_code} before measuring this cell"
        if hung:
            reason = f"engine process sent nothing for {job.plan.silence_timeout_s:.0f} s (hung?) and was killed"
        if exit_code is not None and exit_code < 0:
            reason += f" (signal {-exit_code}; -9 is usually the host OOM killer)"
        for batch in list(pending):
            write(pending.pop(batch), "error", reason, engine, {})
    for batch in list(pending):  # inline job that returned early after an error
        write(pending.pop(batch), "error", "engine job ended before measuring this cell", engine, {})
