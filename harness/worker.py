"""One engine job = one (arm, context[, budget]) engine measured at each batch size, in its own process.

The job runs the protocol: boot, warm-up (a full prefill and a clock-ramp decode), then per batch
size one prefill, settle steps, `windows` x `steps_per_window` timed decode steps with the guards,
abort; and once per engine the TTFT repeats. It reports through `emit(message)`: the parent turns
messages into records, so a crash in here loses no finished cell.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

from ..kernels.vllm_backend import prefill_attention
from . import guards, nvml
from .arms import SparseKnobs, get_arm
from .plan import DecodePlan
from .presets import ModelGeometry
from .bandwidth import FROM_PLAN, MEASURED, copy_bandwidth_bytes_per_s
from .traffic import FloorBasis, cell_bytes, step_stats
from .ttft import build_estimate, counter_delta, measure_ttft, prefill_protocol, single_prefill_ttft
from .weights import choose_weights

log = logging.getLogger(__name__)

_CLOCK_WINDOW = 8  # consecutive SM clock samples that must agree for the ramp to end


@dataclass(frozen=True)
class EngineJob:
    plan: DecodePlan
    arm: str
    context: int
    budget: int | None
    batch_sizes: tuple[int, ...]  # the cells still to measure, ascending
    model_dir: str
    dummy_weights: bool
    geometry: ModelGeometry
    vocab_size: int
    measure_ttft: bool
    weights: dict | None = None  # harness/weights.py count from the config (fallback of the engine's count)

    @property
    def knobs(self) -> SparseKnobs | None:
        if self.budget is None:
            return None
        plan = self.plan
        return SparseKnobs(self.budget, plan.summary_format, plan.scorer, plan.combine)


# TP > 1 on shared multi-GPU hosts: NVLink multicast (NVLS) can take the host's GPUs out of service, so it
# stays off in NCCL, PyTorch and NVSHMEM; vLLM's symmetric-memory all-reduce needs multicast on Hopper and
# would switch itself off anyway, so it is not tried. Both arms of a pair get the same all-reduce.
TP_ENVIRONMENT = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",
}


def job_environment(job: EngineJob) -> dict[str, str]:
    """Environment the engine process needs, set before vLLM is imported (recorded in every record)."""
    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # in-process engine core: step() is synchronous
        "VLLM_USE_FLASHINFER_SAMPLER": "0",  # same sampler for every arm, and no nvcc JIT at start-up
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    arm = get_arm(job.arm)
    if job.plan.tensor_parallel_size > 1:
        env.update(TP_ENVIRONMENT)
        if arm.device == "cpu":  # vLLM's CPU TP binds each rank to a NUMA node of its own by default
            env["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    env.update(arm.environment(job.knobs, job.plan.peer_config))
    return env


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return (
        "outofmemory" in text
        or "out of memory" in text
        or ("kv cache" in text and ("larger than the available" in text or "no available memory" in text))
    )


REASON_CHARS = 400  # a record's reason is one readable line; the full text stays in its traceback


def error_reason(exc: BaseException, stage: str | None = None) -> str:
    """'stage: Type: message' on one line, cut at REASON_CHARS (vLLM's errors can list hundreds of names)."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    if stage:
        text = f"{stage}: {text}"
    if len(text) > REASON_CHARS:
        text = text[: REASON_CHARS - 1].rstrip() + "… (the record's traceback has the rest)"
    return text


def _fatal(stage: str, exc: BaseException) -> dict:
    """The message that ends a job before any cell ran (call inside the `except`: it formats the traceback)."""
    return {"type": "fatal", "status": "oom" if is_oom(exc) else "error",
            "reason": error_reason(exc, stage), "traceback": traceback.format_exc()}


def child_main(job: EngineJob, queue, log_path: str | None = None) -> None:
    """Entry point of the spawned engine process; with `log_path` its stdout and stderr (vLLM's logs) go there.
    A terminal's Ctrl-C reaches this process too: it is ignored here, and the harness stops the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if log_path is not None:
        _redirect_output(log_path)
    os.environ.update(job_environment(job))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_job(job, queue.put)


def _die_with_parent() -> None:
    """Linux: the kernel kills this engine process when the harness that spawned it dies (a killed or
    stopped run must not leave an engine holding the GPU's memory for the run that resumes it)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError as exc:
        log.warning("could not tie the engine process to its parent: %s", exc)


_PR_SET_PDEATHSIG = 1


def _redirect_output(path: str) -> None:
    """Point fds 1 and 2 at the engine's log file, so vLLM's logs and those of its C++ parts stay out of the
    terminal that shows the progress view and the tables."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def phase_message(phase: str, **detail) -> dict:
    """A live-progress message (no record): what the engine job is doing now."""
    return {"type": "phase", "phase": phase, "time": time.time(), **detail}


def run_job(job: EngineJob, emit) -> None:
    from .session import EngineSession

    emit(phase_message("boot", pid=os.getpid()))
    try:
        prefill_attention.configure(job.plan.prefill_attention)
        session = EngineSession(job.plan, job.arm, job.model_dir, job.dummy_weights, job.knobs, job.vocab_size,
                                max_model_len=job.plan.max_model_len_for(job.context))
    except Exception as exc:  # noqa: BLE001 - any boot failure becomes a recorded status
        emit(_fatal("engine boot failed", exc))
        return
    try:
        _run_session(session, job, emit)
    finally:
        if job.plan.tensor_parallel_size > 1:  # rank processes must free their GPUs before the next engine
            session.close()


def _run_session(session, job: EngineJob, emit) -> None:
    from .session import EngineStall

    arm = get_arm(job.arm)
    devices = _devices(job)
    gpus = {str(nvml.engine_devices(1)[0]): nvml.gpu_info()} if devices is None else nvml.gpu_infos(devices)
    gpu = next(iter(gpus.values()))
    tied = bool((job.weights or {}).get("tied_embeddings", False))
    weights = choose_weights(session.model_weights(tied), job.weights)
    basis = floor_basis(job, weights)
    info = {
        "boot_s": session.boot_s,
        "num_kv_blocks": session.num_kv_blocks,
        "block_size": session.block_size,
        "backend_requested": arm.backend,
        "backend_in_use": session.backend_in_use(),
        "engine_kwargs": {k: v for k, v in session.engine_kwargs.items() if k != "model"},
        "env": job_environment(job),
        "dummy_weights": job.dummy_weights,
        "gpu_at_boot": gpu,
        "gpus_at_boot": gpus,  # every GPU of the engine, keyed by its NVML name (TP > 1: one per rank)
        "tensor_parallel_size": job.plan.tensor_parallel_size,
        "ranks": session.rank_facts(),
        "weights": weights,
        "weights_config": job.weights,
        "copy_bandwidth_bytes_per_s": basis.bandwidth_bytes_per_s,
        "bandwidth_source": basis.bandwidth_source,
        **({"prefill_attention": {"mode": "skip", "wrapped": prefill_attention.wrapped()}}
           if job.plan.prefill_attention == "skip" else {}),
    }
    single = job.plan.single_prefill(job.context)
    try:
        info["warmup"] = _SINGLE_PREFILL_WARMUP if single else _warm_up(session, job, emit)
    except Exception as exc:  # noqa: BLE001
        emit(_fatal("warm-up failed", exc))
        return
    emit({"type": "engine", "info": info})
    sm_max = {key: (info_ or {}).get("sm_clock_max_mhz") for key, info_ in gpus.items()}
    if job.plan.batch_prefill == "once":
        _run_prefill_once(session, job, emit, sm_max, basis)
        emit({"type": "done"})
        return
    frontier: int | None = None
    for index, batch in enumerate(job.batch_sizes):
        if frontier is not None:
            emit({"type": "cell", "batch": batch, "status": "oom",
                  "reason": f"beyond the OOM frontier (batch {frontier} did not fit)"})
            continue
        need, have = session.blocks_needed(batch, job.context), session.num_kv_blocks
        if have is not None and need > have:
            frontier = batch
            emit({"type": "cell", "batch": batch, "status": "oom",
                  "reason": f"needs {need} KV blocks, the engine has {have}"})
            continue
        try:
            result = measure_cell(session, job, batch, sm_max, with_ttft=job.measure_ttft and index == 0,
                                  basis=basis, ramp=single and index == 0, emit=emit)
        except EngineStall as exc:
            frontier = batch
            emit({"type": "cell", "batch": batch, "status": "oom", "reason": f"KV pressure: {exc}"})
            continue
        except Exception as exc:  # noqa: BLE001
            status = "oom" if is_oom(exc) else "error"
            emit({"type": "cell", "batch": batch, "status": status,
                  "reason": error_reason(exc), "traceback": traceback.format_exc()})
            if status == "oom":
                frontier = batch
                continue
            return  # the engine state is unknown after an error; the parent marks the rest
        emit({"type": "cell", "batch": batch, **result})
    emit({"type": "done"})


def _run_prefill_once(session, job: EngineJob, emit, sm_max: dict, basis: FloorBasis) -> None:
    """batch_prefill once: prefill the largest batch that fits, measure it, then keep the last b requests
    for each smaller batch (largest first) and measure again; one prefill per engine. The last requests are
    the ones prefilled last: under chunked prefill the first ones decode while the later chunks run (at 32K x
    32 in 16K-token chunks, the first request outran the plan's room by ~50 tokens, and the batch-1 cell's
    last window ran out of positions).

    A batch fits when its requests, with everything they will have decoded by the end of its cell, fit in
    the engine's KV blocks; batches that do not are oom records without a prefill."""
    from .session import EngineStall

    plan = job.plan
    single = plan.single_prefill(job.context)
    have = session.num_kv_blocks
    fitting: list[int] = []
    for batch in sorted(job.batch_sizes, reverse=True):
        need = session.blocks_needed(batch, job.context, plan.decode_tokens_held(job.context, len(fitting), batch))
        if have is not None and need > have:
            emit({"type": "cell", "batch": batch, "status": "oom",
                  "reason": f"needs {need} KV blocks, the engine has {have}"})
        else:
            fitting.append(batch)
    while fitting:  # a prefill that stalls under KV pressure hands the prefill to the next smaller batch
        largest = fitting[0]
        try:
            pre, prefill_counters = _prefill(session, job, largest, emit)
            break
        except EngineStall as exc:
            emit({"type": "cell", "batch": fitting.pop(0), "status": "oom", "reason": f"KV pressure: {exc}"})
    if not fitting:
        return
    ids, decoded = list(pre.request_ids), 0
    for index, batch in enumerate(fitting):
        if index:
            session.abort(ids[:-batch], drain=False)  # the settle steps below let the scheduler drop them
            ids = ids[-batch:]
        try:
            result, steps = measure_live(session, job, batch, ids, sm_max, basis, ramp=single and index == 0,
                                         emit=emit, decoded_before=decoded)
        except Exception as exc:  # noqa: BLE001 - the shared requests' state is unknown; the parent marks the rest
            emit({"type": "cell", "batch": batch, "status": "oom" if is_oom(exc) else "error",
                  "reason": error_reason(exc), "traceback": traceback.format_exc()})
            return
        decoded += steps
        last = index == len(fitting) - 1
        if last:
            session.abort(ids)
        result["prefill"] = (_prefill_fields(pre, batch, prefill_counters) if index == 0 else
                             {"ttft_ms": None, "step_ms": [], "batch_size": largest, "counters": None})
        result["prefills"] = {
            "mode": "once", "count": 1 if index == 0 else 0, "prefilled_batch": largest,
            "from_context": plan.single_prefill_from,
            "why": (f"batch_prefill once: one prefill of batch {largest} per engine; this batch keeps the first "
                    f"{batch} of its requests, which had decoded {result['decoded_before_tokens']} tokens before "
                    "this cell's settle steps"),
        }
        # TTFT: a single-prefill context's is the one prefill (the first cell); else the batch-1 repeats run
        # once nothing else is live, after the smallest batch.
        with_ttft = job.measure_ttft and (index == 0 if single else last)
        _add_ttft(result, session, job, pre, largest, prefill_counters, with_ttft, emit)
        emit({"type": "cell", "batch": batch, **result})


def floor_basis(job: EngineJob, weights: dict | None) -> FloorBasis:
    """The engine's floor basis: its weight bytes and the plan's pinned rate, or else this device's copy
    bandwidth measured now (after boot: a TP engine's rank processes are already spawned)."""
    if job.plan.hbm_bytes_per_s is not None:
        return FloorBasis(weights, job.plan.hbm_bytes_per_s, FROM_PLAN)
    device = "cuda" if get_arm(job.arm).device == "cuda" else "cpu"
    rate = copy_bandwidth_bytes_per_s(device)
    log.info("copy bandwidth of %s: %.2f TB/s (every byte floor of this engine's cells)", device, rate / 1e12)
    return FloorBasis(weights, rate, MEASURED)


def _devices(job: EngineJob) -> list[int | str] | None:
    """NVML names of the engine's GPUs when it spans several (TP > 1); None: this process's own GPU."""
    tp = job.plan.tensor_parallel_size
    return nvml.engine_devices(tp) if tp > 1 and get_arm(job.arm).device == "cuda" else None


def _slowest_clock(devices: list[int | str] | None) -> float | None:
    """SM clock of the slowest engine GPU now (a TP step waits for every rank); None without NVML."""
    samples = [nvml.sample()] if devices is None else [nvml.sample(device) for device in devices]
    clocks = [item["sm_mhz"] for item in samples if item and item.get("sm_mhz")]
    return min(clocks) if clocks else None


_SINGLE_PREFILL_WARMUP = {"mode": "single prefill: no warm-up prefill; the clock ramp decodes on the first cell's "
                                   "measured requests (its record's `ramp`)"}


def _warm_up(session, job: EngineJob, emit) -> dict:
    """One full prefill, then decode until the SM clock is stable (NVML) or the ramp limits are hit."""
    emit(phase_message("warm-up prefill", batch=job.batch_sizes[0]))
    pre = session.prefill(job.batch_sizes[0], job.context, "warm")
    emit(phase_message("clock ramp"))
    ramp = _ramp(session, job, pre.request_ids)
    session.abort(pre.request_ids)
    return {"prefill_ms": pre.ttft_ms, **ramp}


def _ramp(session, job: EngineJob, request_ids: list[str]) -> dict:
    """Decode until the SM clock is stable (NVML) or the ramp limits are hit."""
    plan = job.plan
    clocks: list[float | None] = []
    devices = _devices(job)

    def ramp_done(index: int) -> bool:
        clocks.append(_slowest_clock(devices))
        if index + 1 < plan.ramp_min_steps:
            return False
        recent = [c for c in clocks[-_CLOCK_WINDOW:] if c]
        if not recent:  # no NVML: the minimum ramp is all we can do
            return True
        stable = len(recent) == _CLOCK_WINDOW and max(recent) - min(recent) <= plan.ramp_clock_tolerance * max(recent)
        return stable

    ramp = session.decode(request_ids, plan.ramp_max_steps, on_step=ramp_done)
    return {"ramp_steps": len(ramp.step_ms), "ramp_step_ms": ramp.step_ms, "ramp_sm_mhz": clocks}


def measure_cell(session, job: EngineJob, batch: int, sm_max: dict, with_ttft: bool, basis: FloorBasis,
                 ramp: bool = False, emit=None) -> dict:
    """Prefill, [clock ramp,] settle, timed windows with guards, abort; optionally the TTFT repeats.

    ramp: the engine had no warm-up (single-prefill context), so the clock ramp decodes on this cell's
    requests before the settle steps. At a single-prefill context TTFT is this cell's own prefill.

    sm_max: the max SM clock of each engine GPU, keyed like `ThrottleSampler.by_device`. Counters are
    summed over TP ranks and every GPU is sampled: a window is clean only if every GPU was.
    Returns the status, reason and measurement fields of a record (names of reports/schemas.py).
    """
    emit = emit or (lambda message: None)
    pre, prefill_counters = _prefill(session, job, batch, emit)
    result, _ = measure_live(session, job, batch, pre.request_ids, sm_max, basis, ramp=ramp, emit=emit)
    session.abort(pre.request_ids)
    result["prefill"] = _prefill_fields(pre, batch, prefill_counters)
    result["prefills"] = prefill_protocol(job.plan, job.context, with_ttft)
    _add_ttft(result, session, job, pre, batch, prefill_counters, with_ttft, emit)
    return result


def _prefill_fields(pre, batch: int, counters: dict | None) -> dict:
    """A cell's `prefill` field: the prefill its requests came from."""
    return {"ttft_ms": pre.ttft_ms, "step_ms": pre.step_ms, "batch_size": batch, "counters": counters}


def _prefill(session, job: EngineJob, batch: int, emit):
    """`batch` fresh requests prefilled; (their PrefillLog, the backend counters the prefill moved)."""
    emit(phase_message("prefill", batch=batch))
    before, skipped = session.read_counters(), prefill_attention.skipped_batches()
    pre = session.prefill(batch, job.context, "measure")
    if job.plan.prefill_attention == "skip" and prefill_attention.skipped_batches() == skipped:
        raise RuntimeError(f"prefill_attention skip: the prefill ran its attention ({session.backend_in_use()} is not "
                           f"among the wrapped backends: {', '.join(prefill_attention.wrapped()) or 'none'})")
    return pre, counter_delta(before, session.read_counters())


def _add_ttft(result: dict, session, job: EngineJob, pre, batch: int, prefill_counters, with_ttft: bool, emit) -> None:
    """TTFT fields of a cell: at a single-prefill context its own prefill, else the repeats (batch 1)."""
    result.update(ttft_ms=None, build_ms=None, build_method=None)
    if job.plan.prefill_attention == "skip":
        result["build_method"] = ("not measured: prefill_attention skip (the prefill ran without its attention; its "
                                  "backend counters are in prefill.counters)")
    elif with_ttft and job.plan.single_prefill(job.context):
        result["ttft_ms"] = single_prefill_ttft(pre, batch, prefill_counters)
        result["build_method"] = ("not estimated: a single-prefill context has no steady repeats; the prefill's "
                                  "backend counters are in ttft_ms.build_counters" if job.budget is not None
                                  else "dense arm: no summaries to build")
    elif with_ttft:
        result["ttft_ms"] = measure_ttft(session, job.context, job.plan.ttft_repeats,
                                         lambda index, of: emit(phase_message("ttft", index=index, of=of)))
        result["build_ms"], result["build_method"] = build_estimate(result["ttft_ms"], sparse=job.budget is not None)


def measure_live(session, job: EngineJob, batch: int, request_ids: list[str], sm_max: dict, basis: FloorBasis,
                 ramp: bool = False, emit=None, decoded_before: int = 0) -> tuple[dict, int]:
    """[Clock ramp,] settle and the timed windows on `batch` live requests that have already decoded
    `decoded_before` tokens; (the cell's status and measurement fields, decode steps this ran)."""
    plan, arm = job.plan, get_arm(job.arm)
    emit = emit or (lambda message: None)
    ramp_log = None
    if ramp:
        emit(phase_message("clock ramp", batch=batch))
        ramp_log = _ramp(session, job, request_ids)
    ramp_steps = ramp_log["ramp_steps"] if ramp_log else 0
    settle = session.decode(request_ids, plan.settle_steps) if plan.settle_steps else None
    windows, verdicts, deployed = [], [], []
    devices = _devices(job)
    counters_start = session.read_counters()
    for window in range(plan.windows):
        emit(phase_message("window", batch=batch, index=window + 1, of=plan.windows))
        before = session.read_counters()
        with nvml.ThrottleSampler(devices=devices) as sampler:
            log_ = session.decode(request_ids, plan.lead_steps + plan.steps_per_window).after(plan.lead_steps)
        after = session.read_counters()
        lockstep = guards.check_lockstep(log_.step_tokens, log_.step_requests, batch)
        throttle = guards.check_throttle_devices(sampler.by_device, sm_max, plan.clock_sag_threshold)
        if arm.counters is not None:
            dep = guards.check_deployed(before, after, sparse_arm=True)
        else:
            dep = guards.GuardResult(guards.NOT_APPLICABLE, "arm exposes no deployed-path counters")
        verdict = guards.judge_window(lockstep, throttle, plan.require_nvml)
        verdicts.append(verdict)
        deployed.append(dep)
        windows.append(guards.window_record(log_, sampler, lockstep, throttle, dep, verdict))
    counters_end = session.read_counters()
    status, reason = guards.judge_cell(verdicts, deployed)
    clean_ms = [ms for w in windows if w["clean"] for ms in w["step_ms"]]
    tpot = step_stats(clean_ms, batch)
    traffic = cell_bytes(job.plan, job.geometry, job.context, job.budget, batch, basis, decoded_before + ramp_steps)
    result = {
        "status": status,
        "reason": reason,
        "tpot_ms": tpot,
        "tpot_all_windows_ms": step_stats([ms for w in windows for ms in w["step_ms"]], batch),
        "throughput_tok_s": tpot.get("tokens_per_s"),
        "windows": windows,
        "ramp": ramp_log,
        "settle_ms": settle.step_ms if settle else [],
        "decoded_before_tokens": decoded_before + ramp_steps,
        "bytes_per_step": traffic,
        "floor_ms": traffic["floor_ms"],
        **{key: traffic[key] for key in ("step_floor_ms", "step_floor_basis", "step_floor_why") if key in traffic},
        "path_check": {
            "required": arm.counters is not None,
            "ok": guards.summarize(deployed) in (guards.PASS, guards.NOT_APPLICABLE),
            "status": guards.summarize(deployed),
            "counters": counter_delta(counters_start, counters_end),
        },
        "guards": {
            "lockstep": guards.summarize([guards.GuardResult(**w["guards"]["lockstep"]) for w in windows]),
            "throttle": guards.summarize([guards.GuardResult(**w["guards"]["throttle"]) for w in windows]),
            "deployed": guards.summarize(deployed),
            "clean_windows": sum(v.clean for v in verdicts),
            "windows": len(verdicts),
        },
    }
    steps = ramp_steps + (len(settle.step_ms) if settle else 0) + plan.windows * (plan.lead_steps + plan.steps_per_window)
    return result, steps
