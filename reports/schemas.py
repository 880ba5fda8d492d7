"""The record fields the report reads, per schema; producers write these names.

Every record is one JSON object per line with the envelope of docs/architecture.md:

    schema      "locks.bench.decode/2" | "locks.bench.kernel/1" | "locks.eval/1" | "locks.microscope/1"
    kind        short name of the schema ("decode", "kernel", "eval", "microscope")
    cell        the knobs that identify the measurement (below, per schema)
    status      "ok" | "refused" | "oom" | "error";  reason: str (why, when not ok)
    provenance  {git_commit, git_dirty, versions{torch, triton, vllm, ...},
                 gpu{name, driver, ...}, host, date (ISO 8601, UTC)}
    command     the command line that reproduces the record

Measurements (absent or null fields render as an em dash; a record that is not `ok` may omit them):

locks.bench.decode/2  (one per (arm, model, context, batch) session; version 1 is read through
                       harness/record_migrations.py)
    cell          {arm, backend, model, num_layers, context_tokens, batch_size, budget_tokens
                   (null for dense arms), graph_mode, async_scheduling (absent: off), batch_prefill (absent:
                   per_batch; "once": the batches of an engine share one prefill), dummy_weights, workload}
    decoded_before_tokens  tokens each request decoded before this cell's settle steps (ramp, earlier cells)
    sparse        whether the arm reads a subset of the pages (the speedup's dense side are the others)
    tpot_ms       {mean, sd, p50, p99, n, cv}    over clean windows (cv = sd/mean)
    windows       [{step_ms[], lockstep_ok, clean, discard_reason,
                    throttle{available, ok, reasons_seen[], sm_clock_min_mhz, sm_clock_max_mhz}}]
    ttft_ms       {steady_mean, steady_sd, n, first_after_decode, steady[], build_counters{} (sparse arms:
                   backend counter deltas around one steady prefill)}
    build_ms      one-time summary build (first prefill after decode - steady mean), null unless above
                  3 sd of the steady samples; build_method says how it was set or why it is null.
                  The ladder shows it when set, else steady TTFT - the lowest dense steady TTFT (Δ TTFT vs dense)
    bytes_per_step {dense, locks, weights, step_bytes, bandwidth_bytes_per_s, bandwidth_source}   bytes read per
                   decode step: attention (KV or Locks) and weights (all but an untied input embedding table);
                   the rate floors divide by, measured as the device's copy bandwidth at engine boot unless the
                   plan pins hbm_bytes_per_s (records before that carry the plan's 4.23e12, the H200's)
    floor_ms      bandwidth floor of this arm's attention bytes alone
    step_floor_ms (weights + attention bytes) / bandwidth; the ladder's Floor = step_floor_ms / tpot mean
    step_floor_basis  "recorded" | "preset" (weights from the model preset) | "kv_only" (attention bytes
                  alone; step_floor_why says what was missing)
    throughput_tok_s
    path_check    {required, ok, counters{}}     the sparse path really ran

locks.bench.kernel/1  (one per (preset, context, batch): harness/lab/kernel_bench.py)
    cell          {preset (or geometry), context_tokens, batch_size, budget_tokens, format, combine, and select,
                   scorer_kernel where they differ from the backend's defaults (older records: pdl)}
    timings_us    {stage: {mean_us, ...}};  bytes, floor_us, floor_fraction: {stage: number}
    kernels       {score: cuda | transposed | pages, select: merge | chunked (older records: one, four; pdl)}: the code paths timed; tuning
    best_dense, speedup_vs_dense
  also read: one record per stage, cell.stage + us_per_layer, bytes, floor_us, floor_fraction

locks.eval/1  (one per (suite, task, arm, budget, record))
    cell          {suite, task, arm, format, budget_tokens (null = dense), context_tokens,
                   record_id, model}
    score         0..1;  generation, reference: text

locks.microscope/1  (one per (selector, format, budget, layer, record))
    cell          {selector, format, budget_tokens, layer, record_id}
    metrics       {gamma, gamma_c, recall, needle_retention, score_err_p50, score_err_p95,
                   score_err_max, share_log_err, captured_energy, bound_violations}
"""

from __future__ import annotations

from ..harness.record_schemas import (
    CURRENT_SCHEMAS as KNOWN_SCHEMAS,
    DECODE,
    EVAL,
    FLOOR_KV_ONLY,
    FLOOR_PRESET,
    FLOOR_RECORDED,
    KERNEL,
    MICROSCOPE,
)

# The report's names for the store layer's schema definitions.
__all__ = ["DECODE", "EVAL", "FLOOR_KV_ONLY", "FLOOR_PRESET", "FLOOR_RECORDED", "KERNEL", "KNOWN_SCHEMAS", "MICROSCOPE"]
