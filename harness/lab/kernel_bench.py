"""`locks bench kernel`: per-layer timing of the Locks kernels and the dense baselines on one GPU.

For each (context, batch) cell of a geometry: build (all prompt pages of one layer, all KV heads;
also extrapolated to every layer), score, select, sparse decode (its split-K kernel `decode_pages` and the
`merge` of the splits, each alone, and the two as `decode`), the whole Locks step (score + select + decode),
and the dense baselines that are importable (vLLM FA3 through
`flash_attn_varlen_func`, FlashInfer's paged decode wrapper; torch SDPA over pre-gathered KV when
neither is; our own kernel attending every page, always). Steps are captured in CUDA graphs and
timed with CUDA events over a rotation of layer copies large enough to defeat the 60 MB L2 (a real
model sweeps 40 layers' data). Each stage carries its bytes moved, the byte floor (bytes / the copy
bandwidth measured on this GPU at the start of the run, read + write: ~4.2 TB/s on an H200, ~3.0 on an
H100) and the fraction of the floor achieved.
The kernels' correctness check runs on the GPU first; a red check records `status: error` and
no speedup is ever printed.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from ...kernels import ops
from ...kernels.build.packing import SummaryLayout
from ...kernels.checks import gpu_smoke_checks
from ...kernels.config import (
    PAGE_SIZE,
    SCORER_KERNELS,
    SELECT_CHOICES,
    ConfigError,
    SelectionConfig,
    SummaryFormat,
    cdiv,
)
from ...kernels.score.pages import ScoreTuning
from ...kernels.testing import fresh_seed
from ...kernels.vllm_backend.kernel_ops import TritonOps
from ...kernels.vllm_backend.settings import BackendSettings
from ..bandwidth import copy_bandwidth_bytes_per_s
from ..record_schemas import KERNEL
from ..workload import format_size
from .graph_timing import time_eager, time_graph

log = logging.getLogger(__name__)

SCHEMA = KERNEL
L2_BYTES = 60 * 2**20  # H200 L2 as PyTorch reports it
ALIASES = {"glm4-9b-1m": "glm-4-9b-chat-1m", "glm-4-9b-1m": "glm-4-9b-chat-1m", "llama3.1-8b": "llama-3.1-8b"}


@dataclass(frozen=True)
class KernelGeometry:
    """Attention geometry of one layer: query/KV heads, head dim, layer count (for extrapolation)."""

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads


# Geometries without an engine preset (Gemma-3 text configs: 4B and 27B).
_EXTRA = {
    "gemma-3-4b": KernelGeometry("gemma-3-4b", 34, 8, 4, 256),
    "gemma-3-27b": KernelGeometry("gemma-3-27b", 62, 32, 16, 128),
}


def resolve_geometry(name: str) -> KernelGeometry:
    """A harness preset name (or alias), or one of the extra Gemma-3 geometries."""
    from ..presets import ModelGeometry, load_preset_config, preset_names

    name = ALIASES.get(name, name)
    if name in _EXTRA:
        return _EXTRA[name]
    if name not in preset_names():
        known = ", ".join(sorted({*preset_names(), *_EXTRA, *ALIASES}))
        raise ConfigError(f"geometry preset {name!r} unknown; use one of {known}")
    g = ModelGeometry.from_config(load_preset_config(name))
    return KernelGeometry(name, g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim)


@dataclass(frozen=True)
class KernelBenchConfig:
    """One kernel-bench run: geometry, the context x batch grid, budget, summary format, replays."""

    preset: str
    contexts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    budget_tokens: int = 2048
    summary_format: str = "r8i4"
    combine: str = "share_average"
    replays: int = 20
    seed: int | None = None
    # The backend's kernel settings (kernels/vllm_backend/settings.py), resolved exactly as the backend does
    # (`resolve_tuning`): by default the kernels a deployed engine runs.
    select: str = BackendSettings.select
    scorer_kernel: str = BackendSettings.scorer_kernel

    def __post_init__(self) -> None:
        SelectionConfig(budget_tokens=self.budget_tokens, combine=self.combine)  # validates
        SummaryFormat.parse(self.summary_format)
        if self.replays < 3:
            raise ConfigError(f"replays {self.replays} < 3 gives no spread; pass --replays 20")
        if self.select not in SELECT_CHOICES:
            raise ConfigError(f"select {self.select!r} unknown; use one of {', '.join(SELECT_CHOICES)}")
        if self.scorer_kernel not in SCORER_KERNELS:
            raise ConfigError(f"scorer kernel {self.scorer_kernel!r} unknown; use one of {', '.join(SCORER_KERNELS)}")


def kernel_settings(cfg: KernelBenchConfig) -> dict:
    """The backend kernel settings of a cell that differ from the deployed defaults (a cell names only those)."""
    chosen = {"select": cfg.select, "scorer_kernel": cfg.scorer_kernel}
    return {key: value for key, value in chosen.items() if value != getattr(BackendSettings, key)}


def resolve_tuning(cfg: KernelBenchConfig) -> ScoreTuning:
    """The score + selection tuning the backend runs with these settings (kernels/vllm_backend/kernel_ops.TritonOps,
    the one resolution)."""
    return TritonOps(cfg.select, cfg.scorer_kernel).tuning


def kernels_that_run(q: torch.Tensor, rows: torch.Tensor, layout: SummaryLayout, group: int, tuning: ScoreTuning) -> dict:
    """Which code paths a cell times: the score kernel that takes the call and the selection path."""
    return {"score": ops.score_kernel_name(q, rows, layout, group, tuning), "select": tuning.select_path}


def stage_bytes(geom: KernelGeometry, layout: SummaryLayout, seq_len: int, batch: int, page_budget: int,
                splits: int, kv_bytes: int = 2) -> dict[str, int]:
    """Bytes each stage moves per layer (reads + writes), the model behind the byte floor."""
    pairs = batch * geom.num_kv_heads
    full = seq_len // PAGE_SIZE
    pages = cdiv(seq_len, PAGE_SIZE)
    contested = max(pages - 2, 0)
    q_bytes = batch * geom.num_q_heads * geom.head_dim * kv_bytes
    page_kv = 2 * PAGE_SIZE * geom.head_dim * kv_bytes  # K + V of one page, one KV head
    build = pairs * full * (page_kv // 2 + layout.row_bytes)
    score = pairs * full * (layout.row_bytes + 4 * geom.group) + q_bytes
    select = pairs * contested * (4 * geom.group + 4 * 5)  # scores read; keys written + read 4 times
    attended = min(pages, page_budget)
    partials = batch * geom.num_q_heads * splits * (geom.head_dim + 1) * 4  # written by the split kernel, read by the merge
    decode_pages = pairs * attended * page_kv + partials + q_bytes
    merge = partials + q_bytes  # the output, in q's dtype
    dense = pairs * seq_len * page_kv // PAGE_SIZE + 2 * q_bytes
    return {"build": build, "score": score, "select": select, "decode_pages": decode_pages, "merge": merge,
            "decode": decode_pages + merge, "locks_step": score + select + decode_pages + merge, "dense": dense}


class _ContextState:
    """Device buffers of one context for the largest batch, in `copies` layer copies (L2 defeat)."""

    def __init__(self, geom: KernelGeometry, layout: SummaryLayout, context: int, max_batch: int, gen: torch.Generator):
        self.seq_len = context + 1  # a decode step: the prompt's full pages plus one token on a fresh page
        self.pages = -(-self.seq_len // PAGE_SIZE)
        num_blocks = max_batch * self.pages + 1
        dev = "cuda"
        per_copy = 2 * num_blocks * PAGE_SIZE * geom.num_kv_heads * geom.head_dim * 2
        per_copy += num_blocks * geom.num_kv_heads * layout.row_bytes
        touched = geom.num_kv_heads * (self.pages * layout.row_bytes + 256 * PAGE_SIZE * geom.head_dim * 4)
        free, _ = torch.cuda.mem_get_info()
        self.copies = max(1, min(16, math.ceil(4 * L2_BYTES / touched), int(0.5 * free // per_copy)))
        if per_copy > 0.7 * free:
            raise MemoryError(f"{per_copy / 2**30:.1f} GiB per layer copy exceeds free memory {free / 2**30:.1f} GiB")
        shape = (num_blocks, PAGE_SIZE, geom.num_kv_heads, geom.head_dim)
        self.k = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(self.copies)]
        self.v = [torch.randn(shape, device=dev, dtype=torch.bfloat16) for _ in range(self.copies)]
        self.rows = [torch.zeros((num_blocks, geom.num_kv_heads, layout.row_bytes), dtype=torch.uint8, device=dev)
                     for _ in range(self.copies)]
        order = torch.randperm(num_blocks - 1, generator=gen)[: max_batch * self.pages].to(torch.int32)
        self.block_table = order.reshape(max_batch, self.pages).to(dev)
        self.full = self.seq_len // PAGE_SIZE
        ids = self.block_table[:, : self.full].reshape(-1).contiguous()
        ops.build_summaries(self.k[0], ids, self.rows[0], layout)
        for rows in self.rows[1:]:
            rows.copy_(self.rows[0])


def sweep_contexts(geom: KernelGeometry, layout: SummaryLayout, contexts, batches, provenance: dict, out: str | None,
                   measure) -> list[dict]:
    """The rows of measure(state, batch) over every (context, batch), for the sweeps: one `_ContextState` per
    context (for the largest batch, freed before the next), each cell's rows appended to `out` (JSONL, with
    `provenance`) as soon as they are measured, so a cut run keeps what it finished."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for context in contexts:
        state = _ContextState(geom, layout, context, max(batches), gen)
        for batch in batches:
            cell = measure(state, batch)
            rows.extend(cell)
            if out:
                with open(out, "a") as f:
                    for r in cell:
                        f.write(json.dumps({**r, "provenance": provenance}) + "\n")
        del state
        torch.cuda.empty_cache()
    return rows


def add_sweep_arguments(parser, contexts: str, batch: str) -> None:
    """The options every kernel sweep takes: geometry preset, contexts, batches, token budget, graph replays
    and the JSONL file to append records to."""
    parser.add_argument("--preset", default="glm4-9b-1m")
    parser.add_argument("--contexts", default=contexts)
    parser.add_argument("--batch", default=batch)
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", default=None)


def variant_error(variant, exc: Exception) -> dict:
    """A sweep variant that failed to compile or run: logged, and reported in its row, never fatal."""
    log.warning("variant %s failed: %s", variant, exc)
    return {"status": "error", "reason": f"{type(exc).__name__}: {str(exc)[:200]}"}


def pick_variants(pick: str | None, variants) -> list:
    """The variants a sweep's `--pick` names (comma-separated indices; None: all); ValueError naming the range."""
    if not pick:
        return list(variants)
    try:
        return [variants[int(i)] for i in pick.split(",")]
    except (ValueError, IndexError):
        raise ValueError(f"--pick {pick!r} must be comma-separated indices below {len(variants)}") from None


def _dense_baselines(geom, state, batch, q, scale, out) -> dict:
    """Callables (looping over layer copies) for each importable dense baseline."""
    fns: dict = {}
    bt = state.block_table[:batch]
    seq_lens = torch.full((batch,), state.seq_len, dtype=torch.int32, device="cuda")
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        cu_q = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

        def fa3():
            for k, v in zip(state.k, state.v):
                flash_attn_varlen_func(q, k, v, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=state.seq_len,
                                       seqused_k=seq_lens, softmax_scale=scale, causal=True, block_table=bt,
                                       out=out, fa_version=3)
        fa3()
        fns["fa3"] = fa3
    except Exception as exc:  # noqa: BLE001 - a missing/incompatible baseline is reported, not fatal
        log.info("FA3 baseline unavailable: %s", exc)
    try:
        import flashinfer

        indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * state.pages
        last = torch.full((batch,), state.seq_len - (state.pages - 1) * PAGE_SIZE, dtype=torch.int32, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"), "NHD", use_cuda_graph=True,
            use_tensor_cores=geom.group >= 4, paged_kv_indptr_buffer=indptr,
            paged_kv_indices_buffer=bt.reshape(-1).contiguous(), paged_kv_last_page_len_buffer=last)
        wrapper.plan(indptr, bt.reshape(-1).contiguous(), last, geom.num_q_heads, geom.num_kv_heads, geom.head_dim,
                     PAGE_SIZE, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=scale)

        def flashinfer_decode():
            for k, v in zip(state.k, state.v):
                wrapper.run(q, (k, v), out=out)
        flashinfer_decode()
        fns["flashinfer"] = flashinfer_decode
    except Exception as exc:  # noqa: BLE001
        log.info("FlashInfer baseline unavailable: %s", exc)
    if not fns:
        # Neither engine kernel: SDPA over KV already gathered contiguous (gather cost excluded).
        try:
            idx = bt.long()
            keys = [k[idx].permute(0, 3, 1, 2, 4).flatten(2, 3)[:, :, : state.seq_len] for k in state.k]
            values = [v[idx].permute(0, 3, 1, 2, 4).flatten(2, 3)[:, :, : state.seq_len] for v in state.v]
        except torch.cuda.OutOfMemoryError:
            log.info("SDPA baseline skipped: no memory for a gathered copy of the KV cache")
            return fns
        q4 = q.unsqueeze(2)

        def sdpa():
            for k, v in zip(keys, values):
                torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)
        fns["sdpa"] = sdpa
    return fns


class SelectionInputs(NamedTuple):
    """One cell's score and selection operands, as the backend would launch them."""

    q: torch.Tensor  # [batch, Hq, d] bf16
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    selected: torch.Tensor  # [batch, Hkv, k] int32, the selection's output
    workspace: ops.ScoreSelectWorkspace
    tuning: ScoreTuning
    page_budget: int


def selection_inputs(cfg: KernelBenchConfig, geom: KernelGeometry, layout: SummaryLayout, state: _ContextState,
                     batch: int) -> SelectionInputs:
    """The score + selection operands of a (context, batch) cell on random queries, the tuning resolved as the
    backend resolves it and its CUDA score kernel compiled (before any graph capture). `measure_cell` times them;
    `docs/lease/select_ncu.py` profiles one selection launch on them."""
    k_pages = SelectionConfig(budget_tokens=cfg.budget_tokens).page_budget
    dev = "cuda"
    q = torch.randn((batch, geom.num_q_heads, geom.head_dim), device=dev, dtype=torch.bfloat16)
    bt = state.block_table[:batch]
    seq_lens = torch.full((batch,), state.seq_len, dtype=torch.int32, device=dev)
    selected = torch.empty((batch, geom.num_kv_heads, k_pages), dtype=torch.int32, device=dev)
    sws = ops.score_select_workspace(batch, geom.num_kv_heads, state.pages, dev, group_size=geom.group)
    tuning = resolve_tuning(cfg)
    ops.prepare_score_kernel(state.rows[0], layout, geom.group, tuning)
    return SelectionInputs(q, bt, seq_lens, selected, sws, tuning, k_pages)


def measure_cell(cfg: KernelBenchConfig, geom: KernelGeometry, layout: SummaryLayout, state: _ContextState,
                 batch: int, bandwidth_bytes_per_s: float) -> dict:
    """Time every stage of one (context, batch) cell; returns the measurement part of the record (floors at
    `bandwidth_bytes_per_s`)."""
    q, bt, seq_lens, selected, sws, tuning, k_pages = selection_inputs(cfg, geom, layout, state, batch)
    scale = geom.head_dim**-0.5
    dev = "cuda"
    out = torch.empty_like(q)
    dws = ops.decode_workspace(batch, geom.num_q_heads, geom.head_dim, dev)
    ids = bt[:, : state.full].reshape(-1).contiguous()
    chunks = [0]

    def score():
        for rows in state.rows:
            chunks[0] = ops._launch_score(q, rows, bt, seq_lens, layout, scale, geom.num_kv_heads, sws, tuning)

    def select():
        for _ in state.rows:
            ops._launch_select(sws, seq_lens, selected, geom.group, chunks[0], cfg.combine, k_pages, tuning)

    def decode():
        for k, v in zip(state.k, state.v):
            ops.sparse_paged_decode(q, k, v, bt, seq_lens, selected, scale, out, dws)

    splits_run = [0]

    def decode_pages():  # the split-K kernel alone (decode = it + merge)
        for k, v in zip(state.k, state.v):
            splits_run[0] = ops._launch_decode(q, k, v, bt, seq_lens, selected, scale, dws)

    def merge():
        for _ in state.k:
            ops._launch_merge(dws, out, geom.num_q_heads, splits_run[0])

    def step():
        for rows, k, v in zip(state.rows, state.k, state.v):
            ops.score_select(q, rows, bt, seq_lens, selected, layout, k_pages, scale, cfg.combine, workspace=sws,
                             tuning=tuning)
            ops.sparse_paged_decode(q, k, v, bt, seq_lens, selected, scale, out, dws)

    all_pages = torch.arange(state.pages, dtype=torch.int32, device=dev).expand(batch, geom.num_kv_heads, -1).contiguous()
    dense_ws = ops.decode_workspace(batch, geom.num_q_heads, geom.head_dim, dev)

    def triton_dense():
        for k, v in zip(state.k, state.v):
            ops.sparse_paged_decode(q, k, v, bt, seq_lens, all_pages, scale, out, dense_ws)

    n = state.copies
    timings = {"build": time_eager(lambda: ops.build_summaries(state.k[0], ids, state.rows[0], layout), reps=3)}
    score()  # fills the scores the select stage reads
    select()  # fills the pages the decode stages read (torch.empty until then: an illegal read at 512K bs1)
    decode_pages()  # fills the partials (and the split count) the merge stage reads
    for name, fn in (("score", score), ("select", select), ("decode_pages", decode_pages), ("merge", merge),
                     ("decode", decode), ("locks_step", step), ("triton_dense", triton_dense)):
        timings[name] = time_graph(fn, cfg.replays, n)
    # Zero queries give every page one key (flat attention, as an engine's dummy weights do): every page ties, no
    # threshold search runs, so this is the selection's fixed work and what the dummy-weight pairs pay.
    ops._launch_score(torch.zeros_like(q), state.rows[0], bt, seq_lens, layout, scale, geom.num_kv_heads, sws, tuning)
    timings["select_flat"] = time_graph(select, cfg.replays, n)
    for name, fn in _dense_baselines(geom, state, batch, q, scale, out).items():
        try:
            timings[name] = time_graph(fn, cfg.replays, n)
        except Exception as exc:  # noqa: BLE001 - e.g. a baseline that cannot be captured
            log.info("%s not capturable (%s); timing eagerly", name, exc)
            timings[name] = time_eager(fn, cfg.replays)
            timings[name]["mean_us"] /= n
            timings[name]["min_us"] /= n
    splits = ops.decode_splits(batch, geom.num_kv_heads, k_pages, dws, torch.cuda.current_device())
    nbytes = stage_bytes(geom, layout, state.seq_len, batch, k_pages, splits)
    nbytes.update({"triton_dense": nbytes["dense"], "fa3": nbytes["dense"], "flashinfer": nbytes["dense"],
                   "sdpa": nbytes["dense"], "select_flat": nbytes["select"]})
    floor = {name: 1e6 * nbytes[name] / bandwidth_bytes_per_s for name in timings}
    dense_names = [name for name in ("fa3", "flashinfer", "sdpa") if name in timings]
    best_dense = min(timings[name]["mean_us"] for name in dense_names) if dense_names else None
    return {
        "timings_us": timings,
        "bytes": {name: nbytes[name] for name in timings},
        "floor_us": floor,
        "copy_bandwidth_bytes_per_s": bandwidth_bytes_per_s,
        "floor_fraction": {name: floor[name] / timings[name]["mean_us"] for name in timings},
        "build_all_layers_ms": timings["build"]["mean_us"] * geom.num_layers / 1000.0,
        "best_dense": min(dense_names, key=lambda name: timings[name]["mean_us"]) if dense_names else None,
        "speedup_vs_dense": best_dense / timings["locks_step"]["mean_us"] if best_dense else None,
        "layer_copies": n,
        "score_chunks": chunks[0],
        "decode_splits": splits,
        "kernels": kernels_that_run(q, state.rows[0], layout, geom.group, tuning),
        "tuning": asdict(tuning),
    }


def run_kernel_bench(cfg: KernelBenchConfig, command: str, sink=None) -> list[dict]:
    """Run the grid; `sink(record)` is called per record (e.g. the JSONL store). Returns the records."""
    from ..provenance import collect

    if not torch.cuda.is_available():
        raise ConfigError("`locks bench kernel` needs a CUDA GPU; run it on the H200 machine")
    geom = resolve_geometry(cfg.preset)
    layout = SummaryLayout(SummaryFormat.parse(cfg.summary_format), geom.head_dim)
    seed = cfg.seed if cfg.seed is not None else fresh_seed()
    provenance = collect(command, schema=SCHEMA)
    checks = gpu_smoke_checks("cuda", seed)
    check_summary = [{"name": c.name, "ok": c.ok, "seed": c.seed, "max_error": c.max_error, "problems": c.problems}
                     for c in checks]
    checks_ok = all(c.ok for c in checks)
    bandwidth = copy_bandwidth_bytes_per_s()
    log.info("copy bandwidth %.2f TB/s: every byte floor of this run divides by it", bandwidth / 1e12)
    gen = torch.Generator().manual_seed(seed)
    records = []
    for context in cfg.contexts:
        state, reason = None, None
        if checks_ok:
            try:
                state = _ContextState(geom, layout, context, max(cfg.batch_sizes), gen)
            except (MemoryError, torch.cuda.OutOfMemoryError) as exc:
                reason = f"does not fit: {exc}"
                torch.cuda.empty_cache()
        for batch in cfg.batch_sizes:
            cell = {"preset": geom.name, "context_tokens": context, "batch_size": batch, "workload": f"{batch}q1s{format_size(context)}",
                    "budget_tokens": cfg.budget_tokens, "format": cfg.summary_format, "combine": cfg.combine,
                    **kernel_settings(cfg)}
            record = {"schema": SCHEMA, "kind": "kernel", "cell": cell, "status": "ok", "reason": None,
                      "provenance": provenance, "command": command, "geometry": asdict(geom), "checks": check_summary,
                      "seed": seed}
            if not checks_ok:
                record.update(status="error", reason="kernel correctness check failed on the GPU; no timing taken")
            elif state is None:
                record.update(status="oom", reason=reason)
            else:
                try:
                    record.update(measure_cell(cfg, geom, layout, state, batch, bandwidth))
                except torch.cuda.OutOfMemoryError as exc:
                    record.update(status="oom", reason=str(exc).splitlines()[0])
                    torch.cuda.empty_cache()
                except Exception as exc:  # noqa: BLE001 - record the failure, keep the other cells
                    log.exception("cell %s failed", cell["workload"])
                    record.update(status="error", reason=f"{type(exc).__name__}: {str(exc)[:300]}")
            records.append(record)
            if sink is not None:
                sink(record)
        del state
        torch.cuda.empty_cache()
    return records


def markdown_table(records: list[dict]) -> str:
    """Records -> a markdown table of µs per layer (and % of the byte floor)."""
    head = ("| context | bs | build µs/layer (all layers ms) | score µs (%floor) | select µs (flat keys) | decode µs (%floor; merge µs) "
            "| Locks step µs (floor µs, %floor) | triton dense µs | FA3 µs | FlashInfer µs | SDPA µs | speedup vs best dense |")
    lines = [head, "|" + "---|" * 12]
    for r in records:
        c = r["cell"]
        if r["status"] != "ok":
            lines.append(f"| {format_size(c['context_tokens'])} | {c['batch_size']} | {r['status']}: {r['reason']} |" + " |" * 9)
            continue
        t, f, fl = r["timings_us"], r["floor_fraction"], r["floor_us"]

        def us(name: str) -> str:
            return f"{t[name]['mean_us']:.1f}" if name in t else "—"

        speed = f"{r['speedup_vs_dense']:.2f}x ({r['best_dense']})" if r.get("speedup_vs_dense") else "—"
        lines.append(
            f"| {format_size(c['context_tokens'])} | {c['batch_size']} | {us('build')} ({r['build_all_layers_ms']:.1f}) "
            f"| {us('score')} ({100 * f['score']:.0f}%) | {us('select')} ({us('select_flat')}) | {us('decode')} ({100 * f['decode']:.0f}%; {us('merge')}) "
            f"| {us('locks_step')} ({fl['locks_step']:.1f}, {100 * f['locks_step']:.0f}%) | {us('triton_dense')} "
            f"| {us('fa3')} | {us('flashinfer')} | {us('sdpa')} | {speed} |")
    failed = [c for c in (records[0]["checks"] if records else []) if not c["ok"]]
    if failed:
        lines.append("")
        lines.append("correctness check FAILED (no speedups reported): " + "; ".join(
            f"{c['name']} seed {c['seed']}: {', '.join(c['problems'][:2])}" for c in failed))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m locks_toolkit.harness.lab.kernel_bench` for machines without typer/rich (plain torch + triton)."""
    import argparse
    import json
    import sys

    from ..provenance import reproduce_command
    from ..store import append_record
    from ..workload import parse_size_list

    parser = argparse.ArgumentParser(description="Locks kernel profile per layer (same as `locks bench kernel`).")
    parser.add_argument("--preset", default="glm4-9b-1m")
    parser.add_argument("--contexts", default="16k,32k,128k,1m")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--format", dest="summary_format", default="r8i4")
    parser.add_argument("--combine", default="share_average")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--select", default=BackendSettings.select, help="the backend's `select` setting")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        cfg = KernelBenchConfig(preset=args.preset, contexts=parse_size_list(args.contexts),
                                batch_sizes=parse_size_list(args.batch), budget_tokens=args.budget,
                                summary_format=args.summary_format, combine=args.combine, replays=args.replays,
                                seed=args.seed, select=args.select)
        sink = (lambda record: append_record(args.out, record)) if args.out else None
        records = run_kernel_bench(cfg, reproduce_command(), sink=sink)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(records, allow_nan=False, default=str) if args.json else markdown_table(records))
    return 1 if any(r["status"] == "error" for r in records) else 0


if __name__ == "__main__":
    raise SystemExit(main())
