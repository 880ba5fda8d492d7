"""What the CUDA and CPU Locks backends share: the per-step plan (builder) and the forward (impl).

Builder (host, every step, before any graph replay): splits decodes from prefills, counts rows,
and builds the summaries of the pages that decode rows completed at the previous step, on every
layer of its group in one eager launch (summary_store.py says why this waits one step).
Impl (forward): stock attention for prefill rows (and the summaries of the pages they complete);
for decode rows score + select pages per (sequence, KV head) and attend over them. Every decode-path
launch has a fixed shape, reads only device tensors, and writes into preallocated buffers, so the
same sequence is recorded once in a full CUDA graph and replayed (padded rows have seq_len 0).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..build.packing import SummaryLayout
from ..config import PAGE_SIZE, ConfigError
from . import counters, debug, memory
from .kernel_ops import DecodeShape, key_score_select, ops_for_device, timed_host_ms
from .settings import BackendSettings, per_request_enabled, settings_from_vllm_config
from .summary_store import STORE

logger = logging.getLogger(__name__)
# The ACTIVE line goes through a child of vLLM's logger so it appears in vLLM's own log stream
# (vLLM configures handlers for the "vllm" namespace only).
_banner_logger = logging.getLogger("vllm.locks")
_banners_logged: set[str] = set()


@dataclass
class LocksStep:
    """The Locks part of one step's metadata (shared by every layer of a builder's group)."""

    num_decodes: int  # rows [0, num_decodes) are single-token decodes (padded rows included)
    num_reqs: int
    prefill_summary_blocks: torch.Tensor | None  # int32 [N]: pages completed by prefill rows
    selected_pages: torch.Tensor  # int32 [num_decodes, Hkv, k], persistent scratch
    workspace: Any
    stock_only: bool  # sliding-window group: every row runs stock attention
    # Per-request selection (request_settings.py): the decode rows grouped by selection; None = every row
    # runs the engine's settings.
    groups: list[Any] | None = None
    crossover_dense: bool = False  # the step's decode rows run exact dense attention: cheaper there (crossover.py)

    @property
    def needs_exact_pass(self) -> bool:
        """Stock attention over the whole batch first: prefill rows, decode rows that asked for it, or a step
        that the crossover runs dense."""
        return (self.num_decodes < self.num_reqs or self.crossover_dense
                or any(g.selection.dense for g in self.groups or ()))


def log_active_banner(settings: BackendSettings, backend: str, ops_name: str) -> None:
    """The ACTIVE line with the full configuration, once per process and configuration."""
    line = f"({backend}, kernels={ops_name}): {settings.describe()}"
    if line not in _banners_logged:
        _banners_logged.add(line)
        _banner_logger.info("Locks attention backend ACTIVE %s", line)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_BLOCK_TABLE_ALIGN = 64


def decode_shape(vllm_config, head_dim: int, page_budget: int) -> DecodeShape:
    """Static decode sizes of an engine (workspaces and persistent buffers are allocated for them)."""
    model_config, parallel = vllm_config.model_config, vllm_config.parallel_config
    return DecodeShape(
        max_seqs=max(vllm_config.scheduler_config.max_num_seqs, vllm_config.compilation_config.max_cudagraph_capture_size or 0),
        num_q_heads=model_config.get_num_attention_heads(parallel),
        num_kv_heads=model_config.get_num_kv_heads(parallel),
        head_dim=head_dim,
        # The runner's block table can be wider than cdiv(max_model_len, 16) (seen on the H200:
        # 8216 columns for 8209 pages); the kernels check the workspace against the table's width.
        max_pages=_cdiv(_cdiv(model_config.max_model_len, PAGE_SIZE), _BLOCK_TABLE_ALIGN) * _BLOCK_TABLE_ALIGN,
        page_budget=page_budget,
    )


@dataclass(frozen=True)
class RowPlan:
    """The host facts of one step's batch that the builder needs, from its CPU metadata.

    Computed with numpy on the CPU tensors' memory: the builder runs before every decode step, which
    pays its host time in full when vLLM schedules synchronously. The torch version of these facts was
    ~70 tiny host ops per step in torch.profiler on the H200 host; this one is 3-4x faster side by side
    on the CI machine (2026-11-29).
    """

    num_decodes: int  # rows [0, num_decodes) have query length <= 1 (vLLM orders decodes first)
    live_decodes: int  # of those, rows with a token (CUDA-graph padding rows have query length 0)
    dense: int  # live decode rows whose pages all fit the page budget (exact dense fallback)
    completed_before: int  # live decode rows whose previous token completed a page (seq_len 16 m + 1, m >= 1)
    query_lens: np.ndarray  # int64 [num_reqs]
    seq_lens: np.ndarray  # int64 [num_reqs] (the host upper bound: exact except under async speculative decoding)

    @property
    def live_decode_lens(self) -> np.ndarray:
        """seq_lens of the decode rows that hold a token (padding rows left out)."""
        return self.seq_lens[: self.num_decodes][self.query_lens[: self.num_decodes] > 0]

    @classmethod
    def of(cls, query_start_loc_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, num_reqs: int, page_budget: int) -> RowPlan:
        query_lens = np.diff(query_start_loc_cpu.numpy()[: num_reqs + 1].astype(np.int64))
        seq_lens = seq_lens_cpu.numpy()[:num_reqs].astype(np.int64)
        prefills = np.flatnonzero(query_lens > 1)
        num_decodes = int(prefills[0]) if prefills.size else num_reqs
        decode = seq_lens[:num_decodes][query_lens[:num_decodes] > 0]
        return cls(
            num_decodes=num_decodes,
            live_decodes=int(decode.size),
            dense=int(np.count_nonzero(-(-decode // PAGE_SIZE) <= page_budget)),
            completed_before=int(np.count_nonzero(((decode - 1) % PAGE_SIZE == 0) & (decode > PAGE_SIZE))),
            query_lens=query_lens,
            seq_lens=seq_lens,
        )


class LocksBuilderMixin:
    """Mixed into a vLLM metadata builder subclass; call _locks_init after the base __init__."""

    locks_metadata_cls: type  # the subclass's metadata type: the base metadata plus `.locks`

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        metadata = self.locks_metadata_cls.__new__(self.locks_metadata_cls)
        metadata.__dict__.update(base.__dict__)
        metadata.locks = self._locks_step(common_attn_metadata)
        return metadata

    def _locks_init(self, kv_cache_spec, layer_names, vllm_config, device, backend_label: str) -> None:
        self.locks_settings = settings_from_vllm_config(vllm_config)
        self._init_reorder_batch_threshold(1)
        self._sliding_group = getattr(kv_cache_spec, "sliding_window", None) is not None
        stock_reasons = _stock_layer_reasons(vllm_config, layer_names)
        if self._sliding_group:
            stock_reasons = {name: "sliding window" for name in layer_names}
        if stock_reasons:
            logger.warning("Locks: %d layer(s) run stock attention for decode: %s", len(stock_reasons), stock_reasons)
        self._stock_layers = len(stock_reasons)
        self._locks_layer_names = [name for name in layer_names if name not in stock_reasons]
        STORE.forget(layer_names)  # registrations of an earlier engine in this process
        self._locks_layers = len(layer_names) - self._stock_layers
        self._locks_stock_only = self._locks_layers == 0
        memory.release(vllm_config)  # profiling is over: the KV budget is fixed
        shape = self._locks_shape = decode_shape(vllm_config, kv_cache_spec.head_size, self.locks_settings.locks.selection.page_budget)
        self._locks_ops = ops_for_device(device, self.locks_settings.select, self.locks_settings.scorer_kernel)
        self._locks_layout = SummaryLayout(self.locks_settings.locks.summary, kv_cache_spec.head_size)
        # Persistent buffers: decode graphs hold their addresses, build() refreshes their contents.
        self._decode_blocks = torch.full((shape.max_seqs,), -1, dtype=torch.int32, device=device)
        self._selected = torch.full((shape.max_seqs, shape.num_kv_heads, shape.page_budget), -1, dtype=torch.int32, device=device)
        self._workspace = self._locks_ops.workspace(shape, self._locks_layout, device)
        self._per_request = per_request_enabled(vllm_config)
        self._crossover = self.locks_settings.crossover
        if self._crossover.enabled and torch.device(device).type == "cuda":
            # a captured decode graph runs one path; a branch inside it costs more than the crossover saves
            # (docs/decisions.md), so CUDA needs a graph per path picked on the host: not wired yet
            raise ConfigError("crossover runs on the CPU engine only for now (the CUDA decode graphs do not branch "
                              "yet); remove 'crossover' from additional_config['locks']")
        self._kv_element_bytes = kv_cache_spec.dtype.itemsize
        log_active_banner(self.locks_settings, backend_label + (", per-request selection" if self._per_request else ""),
                          self._locks_ops.name)  # fmt: skip

    def _locks_step(self, cam) -> LocksStep:
        num_reqs = cam.num_reqs
        seq_bound = cam.seq_lens_cpu_upper_bound
        rows = RowPlan.of(cam.query_start_loc_cpu, seq_bound if seq_bound is not None else cam.seq_lens.cpu(),
                          num_reqs, self._locks_shape.page_budget)
        num_decodes, live = rows.num_decodes, rows.live_decodes
        layers, stock_layers = self._locks_layers, self._stock_layers
        prefill_rows = (layers + stock_layers) * (num_reqs - num_decodes)
        if self._locks_stock_only:
            counters.add(prefill_rows=prefill_rows, stock_decode_rows=stock_layers * live,
                         stock_layer_calls=stock_layers, sliding_window_calls=stock_layers if self._sliding_group else 0)
            return LocksStep(num_decodes, num_reqs, None, self._selected[:0], None, True)
        groups = self._request_groups(cam, rows) if self._per_request else None
        shape = self._locks_shape
        crossover_dense = groups is None and self._crossover.runs_dense(rows.live_decode_lens, shape.num_kv_heads,
                                                                        shape.head_dim, self._kv_element_bytes)
        if crossover_dense:
            sparse, fallback, full_kv = 0, 0, 0
        elif groups is None:
            sparse, fallback, full_kv = live - rows.dense, rows.dense, 0
        else:
            sparse, fallback, full_kv = _group_counts(groups, rows.seq_lens)
        counters.add(prefill_rows=prefill_rows, stock_decode_rows=stock_layers * live, stock_layer_calls=stock_layers,
                     sparse_decode_rows=layers * sparse, dense_fallback_rows=layers * fallback,
                     full_kv_rows=layers * full_kv, crossover_dense_rows=layers * live if crossover_dense else 0)
        # A decode row whose previous token completed a page (seq_len = 16 m + 1, m >= 1) scores that
        # page from this step on: build it now. The host bound only decides whether to launch; the
        # block ids come from the device seq_lens (exact).
        if rows.completed_before and not _capturing(self._decode_blocks):
            seq_lens = cam.seq_lens[:num_decodes]
            page = ((seq_lens - 1).clamp(min=PAGE_SIZE) // PAGE_SIZE - 1).long().unsqueeze(1)
            blocks = cam.block_table_tensor[:num_decodes].gather(1, page).squeeze(1)
            completed = ((seq_lens - 1) % PAGE_SIZE == 0) & (seq_lens > PAGE_SIZE)
            self._decode_blocks[:num_decodes] = torch.where(completed, blocks, torch.full_like(blocks, -1))
            built = STORE.build(self._locks_layer_names, self._decode_blocks[:num_decodes], self._locks_layout, self._locks_ops)
            counters.add(summaries_built=built * rows.completed_before)
        return LocksStep(
            num_decodes=num_decodes,
            num_reqs=num_reqs,
            prefill_summary_blocks=self._prefill_blocks(cam, rows) if num_decodes < num_reqs else None,
            selected_pages=self._selected[:num_decodes],
            workspace=self._workspace,
            stock_only=False,
            groups=groups,
            crossover_dense=crossover_dense,
        )

    def _request_groups(self, cam, rows: RowPlan) -> list[Any] | None:
        from .request_settings import RequestSelection, row_groups  # noqa: PLC0415 - imports vLLM's logits API

        settings = self.locks_settings.locks
        default = RequestSelection(settings.scorer, settings.selection.budget_tokens)
        return row_groups(rows.num_decodes, rows.seq_lens, default, cam.seq_lens.device)

    def _prefill_blocks(self, cam, plan: RowPlan) -> torch.Tensor | None:
        """Physical blocks of pages [context // 16, seq_len // 16) of each prefill row (eager steps)."""
        rows, pages = [], []
        for row in range(plan.num_decodes, cam.num_reqs):
            seq_len = int(plan.seq_lens[row])
            first = (seq_len - int(plan.query_lens[row])) // PAGE_SIZE
            for page in range(first, seq_len // PAGE_SIZE):
                rows.append(row)
                pages.append(page)
        if not rows:
            return None
        counters.add(summaries_built=self._locks_layers * len(rows))
        table = cam.block_table_tensor
        row_ids = torch.tensor(rows, dtype=torch.long).to(table.device, non_blocking=True)
        page_ids = torch.tensor(pages, dtype=torch.long).to(table.device, non_blocking=True)
        return table[row_ids, page_ids].to(torch.int32)


def _group_counts(groups, seq_lens) -> tuple[int, int, int]:
    """(sparse rows, rows whose pages fit their budget, rows that asked for exact attention) of a grouped step."""
    sparse = fallback = full_kv = 0
    for group in groups:
        if group.selection.dense:
            full_kv += group.count
            continue
        pages = -(-seq_lens[group.host_rows] // PAGE_SIZE)
        fits = int(np.count_nonzero(pages <= group.selection.page_budget))
        fallback += fits
        sparse += group.count - fits
    return sparse, fallback, full_kv


def unsupported_reason(impl) -> str | None:
    """Why this layer's decode must run stock attention (None: Locks serves it)."""
    from vllm.v1.attention.backend import AttentionType  # noqa: PLC0415

    window = getattr(impl, "sliding_window", None)
    if window not in (None, -1, (-1, -1)):
        return "sliding window"
    if getattr(impl, "attn_type", AttentionType.DECODER) != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    if getattr(impl, "alibi_slopes", None) is not None:
        return "ALiBi"
    if getattr(impl, "sinks", None) is not None:
        return "attention sinks"
    if getattr(impl, "logits_soft_cap", 0):
        return "logit soft-capping"
    return None


def _stock_layer_reasons(vllm_config, layer_names) -> dict[str, str]:
    """{layer name: reason} for this group's layers that Locks cannot serve (layers built already)."""
    from vllm.config import get_layers_from_vllm_config  # noqa: PLC0415
    from vllm.model_executor.layers.attention.attention import Attention  # noqa: PLC0415

    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    reasons = {name: unsupported_reason(layer.impl) for name, layer in layers.items()}
    return {name: reason for name, reason in reasons.items() if reason is not None}


class LocksImplMixin:
    """Mixed into a vLLM attention impl subclass; the subclass supplies _kv_views and _stock_forward."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._locks_init()

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        return self._locks_forward(
            layer, query, key, value, kv_cache, attn_metadata, output,
            output_scale=output_scale, output_block_scale=output_block_scale,
        )

    def _locks_init(self) -> None:
        from vllm.config import get_current_vllm_config  # noqa: PLC0415 - keep imports lazy

        self._vllm_config = get_current_vllm_config()
        self.locks_settings = settings_from_vllm_config(self._vllm_config)
        self._locks_stock_reason = unsupported_reason(self)
        self._summary_rows: torch.Tensor | None = None
        self._summary_key: tuple[int, int] | None = None
        self._layout: SummaryLayout | None = None
        self._ops = None

    # -- subclass hooks -------------------------------------------------------------------------
    def _kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_cache -> (k_cache, v_cache), each viewed as [num_blocks, 16, Hkv, d] (no copy)."""
        raise NotImplementedError

    def _stock_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs) -> torch.Tensor:
        raise NotImplementedError

    # -- forward --------------------------------------------------------------------------------
    def _locks_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, **kwargs) -> torch.Tensor:
        if attn_metadata is None:  # profiling / warm-up without attention
            if kv_cache.numel() == 0:
                self._reserve_summary_memory(query.device)
            return self._stock_forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
        step: LocksStep | None = getattr(attn_metadata, "locks", None)
        if step is None or step.stock_only or self._locks_stock_reason is not None:
            return self._stock_forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)

        memory.release(self._vllm_config)
        k_cache, v_cache = self._kv_views(kv_cache)
        summary_rows = self._summaries_for(layer, kv_cache, k_cache)
        if step.needs_exact_pass:
            # Prefill rows (and decode rows that asked for exact attention) exactly as stock, over the whole
            # batch: the sparse decode rows are overwritten below.
            self._stock_forward(layer, query, key, value, kv_cache, attn_metadata, output, **kwargs)
            if step.prefill_summary_blocks is not None:
                self._build(k_cache, step.prefill_summary_blocks, summary_rows, timed=True)
        if step.groups is not None:
            self._decode_groups(query, k_cache, v_cache, summary_rows, attn_metadata, step, output)
        elif step.num_decodes and not step.crossover_dense:
            self._decode(layer, query, k_cache, v_cache, summary_rows, attn_metadata, step, output)
        return output

    def _decode_groups(self, query, k_cache, v_cache, summary_rows, md, step: LocksStep, output) -> None:
        """Per-request selection (eager): each group of decode rows with its own scorer and page budget."""
        n = step.num_decodes
        out = output[:n].view(n, self.num_heads, self.head_size)
        combine = self.locks_settings.locks.selection.combine
        for group in step.groups:
            if group.selection.dense:
                continue  # the exact pass wrote these rows
            rows, k = group.rows, group.selection.page_budget
            q, block_table, seq_lens = query[:n][rows], md.block_table[:n][rows], md.seq_lens[:n][rows]
            selected = torch.full((group.count, self.num_kv_heads, k), -1, dtype=torch.int32, device=q.device)
            if group.selection.scorer == "locks":
                self._ops.score_select(q, summary_rows, block_table, seq_lens, selected, self._layout, k, self.scale,
                                       combine, self.num_kv_heads, step.workspace)  # fmt: skip
            else:
                key_score_select(group.selection.scorer, q, k_cache, block_table, seq_lens, selected, k, self.scale,
                                 combine, self.num_kv_heads, host_lens=group.host_seq_lens)  # fmt: skip
            result = torch.empty_like(q)
            self._ops.sparse_paged_decode(q, k_cache, v_cache, block_table, seq_lens, selected, self.scale, result,
                                          step.workspace)  # fmt: skip
            out[rows] = result.view(group.count, self.num_heads, self.head_size)

    def _decode(self, layer, query, k_cache, v_cache, summary_rows, md, step: LocksStep, output) -> None:
        n = step.num_decodes
        q = query[:n]
        out = output[:n].view(n, self.num_heads, self.head_size)
        block_table, seq_lens = md.block_table[:n], md.seq_lens[:n]
        selection = self.locks_settings.locks.selection
        if self.locks_settings.reads_keys:
            key_score_select(
                self.locks_settings.locks.scorer, q, k_cache, block_table, seq_lens, step.selected_pages,
                selection.page_budget, self.scale, selection.combine, self.num_kv_heads,
            )
        else:
            self._ops.score_select(
                q, summary_rows, block_table, seq_lens, step.selected_pages, self._layout,
                selection.page_budget, self.scale, selection.combine, self.num_kv_heads, step.workspace,
            )
        self._ops.sparse_paged_decode(
            q, k_cache, v_cache, block_table, seq_lens, step.selected_pages, self.scale, out, step.workspace
        )
        if self.locks_settings.debug_capture_layers and not _capturing(q):
            name = getattr(layer, "layer_name", "")
            if debug.layer_index(name) in self.locks_settings.debug_capture_layers:
                debug.record(name, q, block_table, seq_lens, step.selected_pages, out, k_cache, v_cache, self.scale,
                             summary_rows=summary_rows,
                             selection={"layout": self._layout, "num_kv_heads": self.num_kv_heads,
                                        "page_budget": selection.page_budget, "combine": selection.combine,
                                        "select": self.locks_settings.select, "scorer": self.locks_settings.locks.scorer})

    def _build(self, k_cache, block_ids, summary_rows, timed: bool) -> None:
        if k_cache.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self._ops.build_summaries(k_cache, block_ids, summary_rows, self._layout)
            end.record()
            counters.add_build_events(start, end)
        else:
            counters.add_build_time_ms(timed_host_ms(self._ops.build_summaries, k_cache, block_ids, summary_rows, self._layout))
        counters.add(eager_build_calls=1)

    # -- summary memory -------------------------------------------------------------------------
    def _summaries_for(self, layer, kv_cache: torch.Tensor, k_cache: torch.Tensor) -> torch.Tensor:
        """This layer's uint8 [num_blocks, Hkv, row_bytes] rows, (re)allocated when the KV tensor changes
        and registered (with the key cache) for the builder's one-launch decode-time builds."""
        key = (kv_cache.data_ptr(), k_cache.shape[0])
        if self._summary_key != key:
            if _capturing(k_cache):
                raise RuntimeError("Locks summaries must exist before CUDA-graph capture (an eager warm-up allocates them)")
            if self._layout is None:
                self._layout = SummaryLayout(self.locks_settings.locks.summary, self.head_size)
                self._ops = ops_for_device(k_cache.device, self.locks_settings.select, self.locks_settings.scorer_kernel)
            self._summary_rows = None
            self._summary_rows = torch.zeros(
                (k_cache.shape[0], self.num_kv_heads, self._layout.row_bytes), dtype=torch.uint8, device=k_cache.device
            )
            self._summary_key = key
            self._ops.prepare(self._summary_rows, self._layout, self.num_heads // self.num_kv_heads)
        STORE.register(getattr(layer, "layer_name", f"layer@{id(self)}"), k_cache, self._summary_rows)
        return self._summary_rows

    def _reserve_summary_memory(self, device: torch.device) -> None:
        layout = SummaryLayout(self.locks_settings.locks.summary, self.head_size)
        element_bytes = 1 if "fp8" in str(getattr(self, "kv_cache_dtype", "auto")) else 2
        fraction = memory.summary_fraction(layout.row_bytes, self.head_size, element_bytes)
        shape = decode_shape(self._vllm_config, self.head_size, self.locks_settings.locks.selection.page_budget)
        workspace = ops_for_device(device).workspace(shape, layout, torch.device("meta"))
        memory.reserve_during_profiling(self._vllm_config, fraction, memory.tensor_bytes(workspace), device)


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
