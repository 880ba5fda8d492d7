"""TP consistency check: does Locks at tensor parallelism N decode what Locks at TP=1 decodes?

TP changes numerics on its own (all-reduces sum partial products in another order), so the check is
relative: greedy decode of one seeded prompt on a seeded random checkpoint (harness/lab/tp_checkpoint.py)
with the sparse arm (Locks, page budget far below the context) and the dense arm (FA3), each at TP=1
and TP=N, every engine in its own subprocess. For each arm the TP=N run is compared with its TP=1 run
up to and including the first step where the greedy tokens differ (before it the two saw the same
prefix, so their logprobs are comparable).

With `capture_layers` (default (0,)) the Locks engines run eager with decode captures, and the verdict is
theirs (harness/lab/tp_captures.py): every rank's captures pass their check (output = fp32 attention over the
selected pages; sink and recent pages kept; ids valid and distinct), layer 0's pages at the shared-prefix
decode steps overlap TP=1's by at least `min_page_overlap`, and the sparse path ran (backend counters
summed over ranks). The logprob comparison stays in the record as information only: the random model is
chaotic (on the H200, FA3's own TP2-vs-TP1 drift is 0.19-1.1 nats at the prefill token and greedy tokens
part at step 1), so it cannot tell a TP partition bug from chaos. Without captures it decides as before:
Locks' largest |delta logprob| at most FA3's plus `tolerance`, and the sparse path ran.

    python -m locks_toolkit.harness.lab.tp_check --out runs/tp-check.jsonl          # on 2 GPUs
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...kernels.config import ConfigError
from ..arms import SparseKnobs, get_arm
from ..worker import TP_ENVIRONMENT
from .tp_captures import (
    COMPARED_LAYER,
    capture_fault,
    compare_captures,
    first_divergence,
    without_queries,
)
from .tp_checkpoint import CheckpointSpec, write_checkpoint

log = logging.getLogger(__name__)

SCHEMA_TP_CHECK = "locks.bench.tp_check/2"  # /2: with captures on, they decide `passed`
_RESULT_PREFIX = "TP_CHECK_ENGINE "


@dataclass(frozen=True)
class TPCheckConfig:
    """Knobs of one check. Sizes are tokens; `tolerance` is in nats of logprob."""

    tensor_parallel_size: int = 2
    dense_arm: str = "fa3"
    sparse_arm: str = "locks"
    context: int = 16384
    steps: int = 32
    budget: int = 2048
    logprobs: int = 20  # top-k per step: the reference token must stay findable after a divergence
    tolerance: float = 0.1
    graph_mode: str = "full_decode_only"
    gpu_memory_utilization: float = 0.5
    seed: int = 0
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    capture_layers: tuple[int, ...] = (COMPARED_LAYER,)  # () disables captures (verdict by logprobs)
    min_page_overlap: float = 0.95  # layer-0 pages TP=N vs TP=1: near-tie flips only

    def __post_init__(self) -> None:
        from ..plan import GRAPH_MODES

        if get_arm(self.sparse_arm).sparse is False or get_arm(self.dense_arm).sparse:
            raise ConfigError(f"need a dense and a sparse arm; got dense={self.dense_arm}, sparse={self.sparse_arm}")
        if self.tensor_parallel_size < 2:
            raise ConfigError(f"tensor_parallel_size {self.tensor_parallel_size}: the check compares TP>=2 with TP=1")
        spec = self.checkpoint
        for heads in (spec.num_q_heads, spec.num_kv_heads):
            if heads % self.tensor_parallel_size:
                raise ConfigError(f"TP {self.tensor_parallel_size} does not divide the checkpoint's {heads} heads")
        if self.max_model_len > spec.max_position_embeddings:
            raise ConfigError(f"context {self.context} + {self.steps} steps exceeds the checkpoint's "
                              f"max_position_embeddings {spec.max_position_embeddings}")
        if self.budget >= self.context:
            raise ConfigError(f"budget {self.budget} must be below the context {self.context}, or Locks decodes densely")
        if self.graph_mode not in GRAPH_MODES:
            raise ConfigError(f"graph mode {self.graph_mode!r} unknown; use one of {', '.join(GRAPH_MODES)}")
        if self.steps < 2 or self.logprobs < 1 or self.tolerance < 0:
            raise ConfigError("steps must be >= 2, logprobs >= 1 and tolerance >= 0")
        if self.capture_layers:
            if COMPARED_LAYER not in self.capture_layers or not all(0 <= i < spec.num_layers for i in self.capture_layers):
                raise ConfigError(f"capture layers {list(self.capture_layers)} must include {COMPARED_LAYER} (compared "
                                  f"across TP) and lie in 0..{spec.num_layers - 1}; or pass --capture-layers none")
            if get_arm(self.sparse_arm).additional_config is None:
                raise ConfigError(f"arm {self.sparse_arm} is not this toolkit's Locks backend and records no captures; "
                                  "pass --capture-layers none")
        if not 0.0 <= self.min_page_overlap <= 1.0:
            raise ConfigError(f"min_page_overlap {self.min_page_overlap} must lie in [0, 1], e.g. 0.95")

    @property
    def max_model_len(self) -> int:
        return -(-(self.context + self.steps + 16) // 16) * 16


# -- one engine (runs in its own process) ------------------------------------------------------------
def engine_run(config: TPCheckConfig, model_dir: str, arm_name: str, tp: int) -> dict:
    """Greedy decode of the seeded prompt on one engine: tokens, top-k logprobs per step, counters per rank."""
    import numpy as np

    from .. import ranks
    from ..plan import GRAPH_MODES

    arm = get_arm(arm_name)
    knobs = SparseKnobs(config.budget) if arm.sparse else None
    capture = arm.sparse and bool(config.capture_layers)
    graph_mode = "eager" if capture else config.graph_mode  # graph replays run no Python: nothing captured
    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_NO_USAGE_STATS": "1",
                       "VLLM_USE_FLASHINFER_SAMPLER": "0", **TP_ENVIRONMENT, **arm.environment(knobs, None)})
    if arm.device == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # CPU TP would bind one NUMA node per rank
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    compilation_config, enforce_eager = GRAPH_MODES[graph_mode]
    arm_kwargs = arm.engine_kwargs(knobs)
    if capture:
        extra = arm_kwargs["additional_config"]
        locks = {**extra["locks"], "debug_capture_layers": list(config.capture_layers)}
        arm_kwargs["additional_config"] = {**extra, "locks": locks}
    kwargs = dict(model=model_dir, skip_tokenizer_init=True, dtype=config.checkpoint.dtype, seed=config.seed,
                  max_model_len=config.max_model_len, max_num_seqs=1, max_num_batched_tokens=8192,
                  enable_prefix_caching=False, enable_chunked_prefill=True,
                  gpu_memory_utilization=config.gpu_memory_utilization, compilation_config=compilation_config,
                  enforce_eager=enforce_eager, disable_log_stats=True, tensor_parallel_size=tp,
                  **arm_kwargs)
    if tp > 1:
        kwargs["distributed_executor_backend"] = "mp"
    started = time.perf_counter()
    llm = LLM(**kwargs)
    boot_s = time.perf_counter() - started
    read = (lambda: ranks.sum_counters(llm.collective_rpc(ranks.rank_counters, args=(arm.counters,)))) \
        if arm.counters else (lambda: None)
    rng = np.random.default_rng(config.seed)
    prompt = rng.integers(10, config.checkpoint.vocab_size, size=config.context).tolist()
    sampling = SamplingParams(max_tokens=config.steps, temperature=0.0, ignore_eos=True, detokenize=False,
                              logprobs=config.logprobs)
    dropped = llm.collective_rpc(ranks.rank_capture_clear) if capture else None
    before = read()
    started = time.perf_counter()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sampling, use_tqdm=False)
    generate_s = time.perf_counter() - started
    after = read()
    completion = output.outputs[0]
    result = {
        "arm": arm_name,
        "tensor_parallel_size": tp,
        "tokens": list(completion.token_ids),
        "logprobs": [{str(tok): float(lp.logprob) for tok, lp in step.items()} for step in completion.logprobs],
        "counters": None if before is None or after is None else {k: after[k] - before.get(k, 0) for k in after},
        "backend_in_use": (llm.collective_rpc(ranks.rank_backend) or [None])[0],
        "ranks": llm.collective_rpc(ranks.rank_facts),
        "graph_mode": graph_mode,
        "cudagraph_mode": _cudagraph_mode(llm),
        "boot_s": boot_s,
        "generate_s": generate_s,
    }
    if capture:
        result["captures"] = llm.collective_rpc(ranks.rank_capture_check, args=(COMPARED_LAYER,))
        result["warmup_captures_dropped"] = dropped
    try:  # waits for the rank processes to exit, so the next engine finds its GPUs free
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - teardown is best effort
        log.warning("engine shutdown failed: %s", exc)
    return result


def _cudagraph_mode(llm) -> str | None:
    """The CUDA-graph mode the engine settled on (vLLM may override the one asked for)."""
    try:
        return str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)
    except Exception as exc:  # noqa: BLE001 - internal layout differs by version
        log.debug("could not read the engine's cudagraph mode: %s", exc)
        return None


def _run_engine_process(config: TPCheckConfig, model_dir: str, arm: str, tp: int, timeout_s: float) -> dict:
    """engine_run in a fresh interpreter (vLLM globals, plugins and GPU memory die with it)."""
    payload = json.dumps({"config": _config_dict(config), "model_dir": model_dir, "arm": arm, "tp": tp})
    done = subprocess.run([sys.executable, "-m", f"{__package__}.tp_check", "--engine", payload], capture_output=True, text=True,
                          timeout=timeout_s)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(_RESULT_PREFIX):
            return json.loads(line[len(_RESULT_PREFIX):])
    tail = (done.stderr or done.stdout)[-4000:]
    return {"arm": arm, "tensor_parallel_size": tp, "error": f"engine process exited with {done.returncode}",
            "stderr_tail": tail}


# -- comparison --------------------------------------------------------------------------------------
def compare_runs(reference: dict, other: dict) -> dict:
    """Per-step agreement of `other` (TP=N) with `reference` (TP=1) of the same arm.

    Logprobs are compared for steps 0..first divergence inclusive (the prefix is shared up to there):
    |lp_ref(t_ref) - lp_other(t_ref)|, infinite when the reference token left the other's top-k.
    """
    ref_tokens, other_tokens = reference["tokens"], other["tokens"]
    steps = min(len(ref_tokens), len(other_tokens))
    agree = [a == b for a, b in zip(ref_tokens[:steps], other_tokens[:steps])]
    first = first_divergence(ref_tokens[:steps], other_tokens[:steps])
    compared = steps if first is None else first + 1
    deltas = []
    for t in range(compared):
        token = str(ref_tokens[t])
        ref_lp, other_lp = reference["logprobs"][t].get(token), other["logprobs"][t].get(token)
        deltas.append(math.inf if ref_lp is None or other_lp is None else abs(ref_lp - other_lp))
    return {
        "steps": steps,
        "agreeing_steps": sum(agree),
        "agreement": sum(agree) / steps if steps else math.nan,
        "first_divergence": first,
        "compared_steps": compared,
        "max_abs_dlogprob": max(deltas) if deltas else math.nan,
        "abs_dlogprob": deltas,
        "reference_token_lost": [t for t, d in enumerate(deltas) if math.isinf(d)],  # stored JSON turns inf into null
    }


def _sparse_path_fault(sparse_runs: Sequence[dict]) -> str | None:
    """Why the sparse runs' backend counters do not prove the sparse path ran (None: they do)."""
    for run in sparse_runs:
        counters = run.get("counters")
        if counters is None:
            return f"{run['arm']} TP={run['tensor_parallel_size']}: no backend counters, the sparse path is unverified"
        if counters.get("sparse_decode_rows", 0) <= 0 or counters.get("dense_fallback_rows", 0) > 0:
            return f"{run['arm']} TP={run['tensor_parallel_size']}: sparse path did not run ({counters})"
    return None


def judge(sparse: dict, dense: dict, tolerance: float, sparse_runs: Sequence[dict]) -> tuple[bool, str]:
    """(passed, why): sparse TP drift within dense TP drift + tolerance, and the sparse path really ran."""
    fault = _sparse_path_fault(sparse_runs)
    if fault is not None:
        return False, fault
    s, d = sparse["max_abs_dlogprob"], dense["max_abs_dlogprob"]
    limit = d + tolerance
    text = (f"sparse max |dlogprob| {s:.4g} vs dense {d:.4g} + tolerance {tolerance:g}; first divergence "
            f"sparse {sparse['first_divergence']}, dense {dense['first_divergence']} of {sparse['steps']} steps")
    return bool(s <= limit), ("pass: " if s <= limit else "FAIL: ") + text


def judge_captures(sparse_runs: Sequence[dict], per_run_captures: dict, cross: dict, min_overlap: float) -> tuple[bool, str]:
    """(passed, why): the sparse path ran, every rank's capture check passed, layer-0 pages overlap enough."""
    fault = _sparse_path_fault(sparse_runs)
    for name, per_rank in per_run_captures.items():
        fault = fault or capture_fault(name, per_rank)
    if fault is not None:
        return False, "FAIL: " + fault
    if cross.get("error"):
        return False, f"FAIL: layer-{cross['layer']} comparison: {cross['error']}"
    if not cross["compared_steps"]:
        return False, (f"FAIL: no decode step shares its token prefix across TP (first divergence at token "
                       f"{cross['shared_prefix_tokens']}); nothing to compare, try another --seed")
    overlap = cross["mean_page_overlap"]
    worst = max(r["max_abs_error"] for per_rank in per_run_captures.values() for r in per_rank)
    text = (f"layer-{cross['layer']} pages at {len(cross['compared_steps'])} shared-prefix decode step(s): mean overlap "
            f"{overlap:.4f} (min {cross['min_page_overlap']:.4f}, identical {cross['identical_fraction']:.3f} of "
            f"{cross['selections']} selections; need >= {min_overlap:g}), max |dq| {cross['max_abs_dq']:.3g} of "
            f"|q| {cross['q_abs_max']:.3g}; every rank's captures pass (max |out - ref| {worst:.3g})")
    return overlap >= min_overlap, ("pass: " if overlap >= min_overlap else "FAIL: ") + text


def _config_dict(config: TPCheckConfig) -> dict:
    return asdict(config)


def _config_from_dict(data: dict) -> TPCheckConfig:
    return TPCheckConfig(**{**data, "checkpoint": CheckpointSpec(**data["checkpoint"]),
                            "capture_layers": tuple(data.get("capture_layers", ()))})


def run_tp_check(config: TPCheckConfig, out: str | Path | None = None, workdir: str | Path | None = None,
                 engine_timeout_s: float = 600.0) -> dict:
    """Write the checkpoint, run the four engines, compare; appends the record to `out` when given."""
    from ..provenance import collect
    from ..store import append_record

    with tempfile.TemporaryDirectory(prefix="locks-tp-check-", dir=workdir) as scratch:
        started = time.perf_counter()
        model_dir = str(write_checkpoint(config.checkpoint, Path(scratch) / "model"))
        write_s = time.perf_counter() - started
        runs = {}
        for arm in (config.sparse_arm, config.dense_arm):
            for tp in (1, config.tensor_parallel_size):
                log.info("engine %s TP=%d", arm, tp)
                runs[f"{arm}/tp{tp}"] = _run_engine_process(config, model_dir, arm, tp, engine_timeout_s)
    errors = [f"{key}: {run['error']}" for key, run in runs.items() if "error" in run]
    record = {"schema": SCHEMA_TP_CHECK, "kind": "tp_check", "config": _config_dict(config),
              "checkpoint_write_s": write_s, "runs": runs, "provenance": collect(schema=SCHEMA_TP_CHECK)}
    if errors:
        for run in runs.values():  # the queries only serve the comparison; keep the record small
            if "captures" in run:
                run["captures"] = without_queries(run["captures"])
        record.update(status="error", passed=False, reason="; ".join(errors))
    else:
        n = config.tensor_parallel_size
        sparse = compare_runs(runs[f"{config.sparse_arm}/tp1"], runs[f"{config.sparse_arm}/tp{n}"])
        dense = compare_runs(runs[f"{config.dense_arm}/tp1"], runs[f"{config.dense_arm}/tp{n}"])
        sparse_runs = [runs[f"{config.sparse_arm}/tp1"], runs[f"{config.sparse_arm}/tp{n}"]]
        if config.capture_layers:
            cross = compare_captures(sparse_runs[0], sparse_runs[1], config.context)
            captures = {f"{config.sparse_arm}/tp{run['tensor_parallel_size']}": without_queries(run.pop("captures", None))
                        for run in sparse_runs}
            passed, reason = judge_captures(sparse_runs, captures, cross, config.min_page_overlap)
            record.update(captures=captures, capture_comparison=cross, decided_by="captures")
        else:
            passed, reason = judge(sparse, dense, config.tolerance, sparse_runs)
        record.update(status="ok" if passed else "failed", passed=passed, reason=reason,
                      comparisons={config.sparse_arm: sparse, config.dense_arm: dense})
    if out is not None:
        append_record(out, record)
    return record


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2, help="tensor parallel size compared with TP=1")
    parser.add_argument("--arms", default="fa3,locks", help="dense,sparse arm names (CPU: cpu,locks-cpu)")
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--qk-std", type=float, default=None, help="std of q/k projections (peaked attention), default: 0.02")
    parser.add_argument("--tolerance", type=float, default=0.1)
    parser.add_argument("--graph-mode", default="full_decode_only")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capture-layers", default="0",
                        help="layers whose Locks decode captures are checked per rank (must include 0); '' or none: off")
    parser.add_argument("--out", default=None, help="JSONL file the record is appended to")
    parser.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # internal: one engine, JSON payload
    return parser


def parse_capture_layers(text: str) -> tuple[int, ...]:
    """"0,2" -> (0, 2); "" or "none" -> () (captures off)."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--capture-layers {text!r} must be comma-separated layer indices like 0,2, or none") from None


def main(argv: list[str] | None = None, print_record: bool = False) -> int:
    """Command line entry; prints a one-line summary (or the whole record) and returns 0 when it passed."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.engine is not None:
        payload = json.loads(args.engine)
        result = engine_run(_config_from_dict(payload["config"]), payload["model_dir"], payload["arm"], payload["tp"])
        sys.stdout.write(_RESULT_PREFIX + json.dumps(result) + "\n")
        sys.stdout.flush()
        os._exit(0)  # skip vLLM's teardown of worker processes and NCCL (seconds, sometimes hangs)
    dense, _, sparse = args.arms.partition(",")
    config = TPCheckConfig(capture_layers=parse_capture_layers(args.capture_layers),
                           tensor_parallel_size=args.tp, dense_arm=dense, sparse_arm=sparse, context=args.context,
                           steps=args.steps, budget=args.budget, tolerance=args.tolerance, graph_mode=args.graph_mode,
                           seed=args.seed, checkpoint=CheckpointSpec(
                               num_layers=args.layers, dtype=args.dtype, seed=args.seed, qk_std=args.qk_std,
                               max_position_embeddings=max(65536, args.context + args.steps + 64)))
    record = run_tp_check(config, args.out)
    summary = record if print_record else {k: record.get(k) for k in ("status", "passed", "reason", "comparisons")}
    if not print_record and "capture_comparison" in record:
        summary["capture_comparison"] = record["capture_comparison"]
    if not print_record and "comparisons" in summary:
        summary["comparisons"] = {arm: {k: v for k, v in c.items() if k != "abs_dlogprob"}
                                  for arm, c in summary["comparisons"].items()}
    sys.stdout.write(json.dumps(summary, default=str) + "\n")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
