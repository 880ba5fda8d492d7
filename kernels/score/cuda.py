"""The CUDA score kernel (`score_t.cu`): compiled with NVRTC once per process and device, launched on torch's
current stream (so CUDA graphs capture it like any other kernel).

Contract: that of `kernels/score/transposed.py` (same arguments, same scratch outputs) for the formats `fits`
accepts: r8i4 rows (d = 128, 16-token pages), bf16 queries, G <= 16, 16-byte aligned q rows and summary
rows, an sm_90 device. Everything else runs the Triton kernels. Reference: `reference.score.summary_page_scores`.

Why CUDA here: the Triton kernels spend most of their instructions moving int4 words and V^T q between
register layouts (ncu: issue-bound at ~800 SASS per 2-page tile). This kernel reads every operand in the
layout of the mma that takes it, runs V^T q and q . mu on the int8 mma (the codes need one LOP3 a word), and
brings the rows to shared memory by Hopper bulk copies ahead of use (~575 SASS per 4-page tile at G <= 8,
`python -m locks_toolkit.harness.lab.compile_report --cuda`).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import logging
import pathlib
import threading
from dataclasses import dataclass

import torch

from .. import nvrtc
from ..triton_common import RowConstants

log = logging.getLogger(__name__)

SOURCE = pathlib.Path(__file__).with_name("score_t.cu")
KERNEL_NAME = "locks_score_t"
ARCH = "sm_90a"
TILE_PAGES = 4  # pages per tile in the kernel (its TILE)
WARPS = 4  # per program (CTA_WARPS): each warp takes every 4th tile of the program's chunk
MIN_WARPS_PER_SM = 16  # __launch_bounds__ minimum: caps registers at 128 (no spill; tests/kernels/score/test_score_cuda.py)
PROGRAMS_PER_SM = MIN_WARPS_PER_SM // WARPS
MAX_GROUP = 16  # query heads per KV head: the mma's M


@dataclass(frozen=True)
class CompiledScorer:
    """One compiled and loaded kernel (per device and row layout)."""

    function: object  # cuda.bindings.driver.CUfunction
    registers: int


def fits(q: torch.Tensor, summary_rows: torch.Tensor, rc: RowConstants, group: int) -> str | None:
    """None where the CUDA kernel serves this call, else why not (the caller falls back to Triton)."""
    if rc.rank != 8 or rc.basis_bits != 4 or rc.head_dim != 128 or rc.page_size != 16:
        return f"format r{rc.rank}i{rc.basis_bits} d={rc.head_dim} (the CUDA kernel is r8i4, d=128)"
    if q.dtype != torch.bfloat16:
        return f"query dtype {q.dtype} (the CUDA kernel reads bf16)"
    if not 1 <= group <= MAX_GROUP:
        return f"group size {group} > {MAX_GROUP}"
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return "not an sm_90 device"
    if not _has_cuda_bindings():
        return "cuda-bindings is not installed (pip install cuda-bindings)"
    if q.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8:
        return "query rows not 16-byte aligned"
    if summary_rows.data_ptr() % 16 or rc.row_bytes % 16 or rc.basis_offset % 16:
        return "summary rows not 16-byte aligned"
    return None


def lane_rows(group: int) -> int:
    """Heads per lane in the kernel: 1 where G <= 8 (the spare mma rows carry V^T q's lo term), else 2."""
    return 1 if group <= 8 else 2


@functools.cache  # `fits` runs on every eager launch
def _has_cuda_bindings() -> bool:
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:  # no `cuda` package at all
        return False


def compile_options(rc: RowConstants, rows_under_4gib: bool, rows_per_lane: int = 2,
                    defines: tuple[tuple[str, int], ...] = ()) -> list[str]:
    """NVRTC options: the row layout as constants (offsets fold into the loads' immediates); `defines` add
    macros the lab's score probe varies (STAGES, SCORE_PROBE)."""
    return [
        f"--gpu-architecture={ARCH}", "--use_fast_math", "-lineinfo", f"-DLANE_ROWS={rows_per_lane}",
        f"-DROW_BYTES={rc.row_bytes}", f"-DCOEF_OFF={rc.coef_offset}", f"-DBASIS_OFF={rc.basis_offset}",
        f"-DSCALE_OFF={rc.scales_offset}", f"-DCTA_WARPS={WARPS}", f"-DMIN_WARPS_PER_SM={MIN_WARPS_PER_SM}",
        f"-DROW_OFFSET_T={'unsigned int' if rows_under_4gib else 'unsigned long long'}",
        *(f"-D{name}={value}" for name, value in defines),
    ]


def compile_cubin(options: list[str]) -> bytes:
    """NVRTC: score_t.cu -> cubin bytes (no device needed)."""
    return nvrtc.compile_cubin(SOURCE.read_bytes(), SOURCE.name, options)


_CACHE: dict[tuple, CompiledScorer] = {}
_LOCK = threading.Lock()


def load(device: torch.device, rc: RowConstants, rows_under_4gib: bool, rows_per_lane: int,
         defines: tuple[tuple[str, int], ...] = ()) -> CompiledScorer:
    """The kernel for this device, layout and group size, compiled and loaded on first use (torch's context is current)."""
    key = (device.index, rc, rows_under_4gib, rows_per_lane, defines)
    with _LOCK:
        if key not in _CACHE:
            from cuda.bindings import driver

            function = nvrtc.load_function(
                device, compile_cubin(compile_options(rc, rows_under_4gib, rows_per_lane, defines)), KERNEL_NAME)
            regs = nvrtc.driver_ok(driver.cuFuncGetAttribute(
                driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS, function), "cuFuncGetAttribute")
            # All of the unified L1 as shared memory: PROGRAMS_PER_SM programs' row stages (~27 KB each) side by side.
            nvrtc.driver_ok(driver.cuFuncSetAttribute(
                function, driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100),
                "cuFuncSetAttribute")
            _CACHE[key] = CompiledScorer(function, int(regs))
            log.info("CUDA score kernel compiled for device %s (%s): %d registers", device, ARCH, regs)
        return _CACHE[key]


def load_for(summary_rows: torch.Tensor, rc: RowConstants, group: int,
             defines: tuple[tuple[str, int], ...] = ()) -> CompiledScorer:
    """`load` of the variant that serves these rows (offset width) and this group size (heads per lane)."""
    return load(summary_rows.device, rc, summary_rows.numel() < 2**32, lane_rows(group), defines)


def launch(q, summary_rows, block_table, seq_lens, ws, rc: RowConstants, scale: float, num_kv_heads: int,
           chunks: int, max_chunks: int, defines: tuple[tuple[str, int], ...] = ()) -> None:
    """One launch, grid (S * Hkv, chunks), WARPS warps per program (arguments checked by ops.score_select)."""
    num_seqs, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    kernel = load_for(summary_rows, rc, group, defines)
    values = [
        ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(summary_rows.data_ptr()), ctypes.c_void_p(block_table.data_ptr()),
        ctypes.c_void_p(seq_lens.data_ptr()), ctypes.c_void_p(ws.scores.data_ptr()),
        ctypes.c_void_p(ws.chunk_max.data_ptr()), ctypes.c_void_p(ws.chunk_sum.data_ptr()),
        ctypes.c_longlong(q.stride(0)), ctypes.c_longlong(q.stride(1)), ctypes.c_longlong(block_table.stride(0)),
        ctypes.c_int(num_kv_heads), ctypes.c_int(ws.max_pages), ctypes.c_int(chunks), ctypes.c_int(max_chunks),
        ctypes.c_int(group), ctypes.c_int(ws.group_slots), ctypes.c_float(scale * 1.4426950408889634),
    ]
    nvrtc.launch(kernel.function, (num_seqs * num_kv_heads, chunks, 1), 32 * WARPS, q.device, values, "score")
