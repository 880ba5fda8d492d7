"""Ahead-of-time compile of every kernel for sm_90 (H100/H200) without a GPU: catches GPU-only
lowering errors and register spills on a CPU machine, where the tests run the interpreter.

`python -m locks_toolkit.harness.lab.compile_report` prints registers / spill bytes per kernel (it must
run WITHOUT TRITON_INTERPRET=1); `--opcodes _score_kernel` the opcode counts of one kernel's loop; `--cuda`
the CUDA score kernel's tile loop (NVRTC). The Triton constexprs mirror the production launches in `ops.py`
(GLM-4-9B geometry: G=8, d=128, r8i4, k=128; bf16), and so does the specialisation: at launch the
JIT marks every 16-byte-aligned pointer and every integer argument divisible by 16 (and any equal
to 1) as such, which changes vectorisation and register use, so `PRODUCTION_HINTS` lists the integer
arguments that are multiples of 16 (or 1) in vLLM's layouts.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from ...kernels.build import kernel as _build
from ...kernels.build.packing import SummaryLayout
from ...kernels.config import PAGE_SIZE, SummaryFormat
from ...kernels.decode import kernel as _decode
from ...kernels.score import cuda as _cuda_score
from ...kernels.score import pages as _ss
from ...kernels.score import transposed as _score_t
from ...kernels.select import chunked as _topk
from ...kernels.select import merge as _merge_select
from ...kernels.triton_common import FP32_EPS, RowConstants, next_pow2

SM90 = GPUTarget("cuda", 90, 32)
_TRANSPOSED = _ss.ScoreTuning(**_ss.SCORER_KERNELS["transposed"])  # the backend's score kernel

# Integer arguments that production launches pass as multiples of 16 (strides of vLLM's
# [blocks, 16, Hkv, d] caches and of contiguous q/out, block-table width, row bytes, k, chunk
# counts) or as 1 (the unit stride of the key dim). Pointers are always 16-byte aligned.
PRODUCTION_HINTS: dict[str, dict[str, int]] = {
    "_build_kernel": {"s_blk": 16, "s_tok": 16, "s_head": 16, "s_dim": 1, "row_bytes": 16},
    "_score_kernel": {"s_qs": 16, "s_qh": 16, "s_bt": 16, "row_bytes": 16, "max_pages": 16, "num_chunks": 16},
    "_score_t_kernel": {"s_qs": 16, "s_qh": 16, "s_bt": 16, "row_bytes": 16, "max_pages": 16, "num_chunks": 16},
    "_keys_kernel": {"max_pages": 16, "num_chunks": 16, "K": 16, "num_score_chunks": 16},
    "_gather_kernel": {"max_pages": 16, "num_chunks": 16, "K": 16},
    "_resolve_kernel": {"max_pages": 16, "num_chunks": 16, "K": 16},
    "_merge_select_kernel": {"max_pages": 16, "num_chunks": 16, "K": 16, "num_score_chunks": 16},
    "_sparse_decode_kernel": {"s_qs": 16, "s_qh": 16, "s_kb": 16, "s_kt": 16, "s_kh": 16, "s_vb": 16, "s_vt": 16,
                              "s_vh": 16, "s_bt": 16, "K": 16},
    "_merge_kernel": {"s_os": 16, "s_oh": 16},
}


def _specs(group: int = 8, head_dim: int = 128, fmt: str = "r8i4", page_budget: int = 128,
           build_tile: int = _build.PAGES_PER_PROGRAM) -> list[tuple]:
    rc = RowConstants.of(SummaryLayout(SummaryFormat.parse(fmt), head_dim))
    rows = {"rows_u8": "*u8", "rows_i8": "*i8", "rows_f16": "*fp16"}
    gs = g_dot = next_pow2(group)
    select_common = dict(B=PAGE_SIZE, MAXC=_ss.MAX_CHUNKS, NBINS=_topk.HIST_BINS, LOW_BITS=_topk.LOW_BITS)
    pick = _ss.DEFAULT_TUNING.coarse_pick  # production's threshold pick (ops._launch_select passes the tuning's)
    return [
        (_build._build_kernel, {"k_ptr": "*bf16", "block_ids_ptr": "*i32", **rows},
         dict(D=head_dim, DH_PAD=head_dim // 2, DC=min(_build.DIM_CHUNK, head_dim // 2), P=build_tile, B=PAGE_SIZE,
              R=rc.rank, BITS=rc.basis_bits, COEF_OFF=rc.coef_offset, BASIS_OFF=rc.basis_offset,
              SCALE_OFF=rc.scales_offset, USED=rc.used_bytes, MAX_SWEEPS_C=_build.MAX_SWEEPS, EPS=FP32_EPS,
              LAYERED=False, K_DTYPE=None),
         _build.NUM_WARPS),
        (_ss._score_kernel, {"q_ptr": "*bf16", **rows, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                             "scores_ptr": "*fp32", "chunk_max_ptr": "*fp32", "chunk_sum_ptr": "*fp32", "scale": "fp32"},
         dict(G=group, G_DOT=g_dot, GS=gs, MAXC=_ss.MAX_CHUNKS, D=head_dim, D_PAD=head_dim, B=PAGE_SIZE, R=rc.rank,
              BITS=rc.basis_bits, COEF_OFF=rc.coef_offset, BASIS_OFF=rc.basis_offset, SCALE_OFF=rc.scales_offset,
              P=_ss.P_TILE, RP=next_pow2(rc.rank), FP32=rc.basis_bits == 16, STAGES=1, MANTISSA=True,
              WORDS=_ss.DEFAULT_TUNING.word_nibbles, COEF_VEC=_ss.DEFAULT_TUNING.coef_vector,
              COEF_MMA=_ss.DEFAULT_TUNING.coef_mma),
         (_ss.SCORE_WARPS, _ss.SCORE_MAXNREG)),
        (_score_t._score_t_kernel, {"q_ptr": "*bf16", **rows, "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                                    "scores_ptr": "*fp32", "chunk_max_ptr": "*fp32", "chunk_sum_ptr": "*fp32", "scale": "fp32"},
         dict(G=group, G_DOT=g_dot, GS=gs, MAXC=_ss.MAX_CHUNKS, M=max(16, g_dot), D=head_dim, D_PAD=head_dim, B=PAGE_SIZE,
              R=rc.rank, COEF_OFF=rc.coef_offset, BASIS_OFF=rc.basis_offset, SCALE_OFF=rc.scales_offset,
              P=_TRANSPOSED.tile, RP=next_pow2(rc.rank), FP32=False, SPLIT=True, ROWS32=_TRANSPOSED.narrow_offsets),
         (_TRANSPOSED.warps, _TRANSPOSED.maxnreg)),
        (_topk._keys_kernel, {"scores_ptr": "*fp32", "chunk_max_ptr": "*fp32", "chunk_sum_ptr": "*fp32", "keys_ptr": "*i32",
                              "hist_ptr": "*i32", "counts_ptr": "*i32", "seq_lens_ptr": "*i32"},
         dict(G=group, GS=gs, RULE=0, BLOCK=_topk.KEYS_BLOCK, STEPS=_topk.KEY_STEPS_PER_UNIT, WINDOW=_topk.AGG_WINDOW,
              SCP=_ss.DEFAULT_TUNING.max_chunks, COARSE_PICK=pick, **select_common), _topk.KEYS_WARPS),
        (_topk._gather_kernel, {"keys_ptr": "*i32", "low_hist_ptr": "*i32", "counts_ptr": "*i32",
                                "cand_low_ptr": "*i32", "cand_page_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*i32"},
         dict(B=PAGE_SIZE, MAXC=_ss.MAX_CHUNKS, BLOCK=_topk.KEYS_BLOCK, LOW_BITS=_topk.LOW_BITS, WINDOW=_topk.AGG_WINDOW),
         _topk.KEYS_WARPS),
        (_topk._resolve_kernel, {"counts_ptr": "*i32", "cand_low_ptr": "*i32", "cand_page_ptr": "*i32",
                                 "seq_lens_ptr": "*i32", "out_ptr": "*i32"},
         dict(B=PAGE_SIZE, MAXC=_ss.MAX_CHUNKS, BLOCK=_topk.KEYS_BLOCK, K_PAD=next_pow2(page_budget),
              CHUNKS_PAD=next_pow2(_ss.DEFAULT_TUNING.select_chunks)), _topk.FINAL_WARPS),
        # The merge path at 1M bs1 (4 pairs: 32 chunks of up to 4096 pages, a 32 x 128 candidate tile).
        (_merge_select._merge_select_kernel, {"scores_ptr": "*fp32", "chunk_max_ptr": "*fp32", "chunk_sum_ptr": "*fp32",
                                              "keys_ptr": "*i32", "counts_ptr": "*i32", "cand_key_ptr": "*i32", "cand_page_ptr": "*i32",
                                              "seq_lens_ptr": "*i32", "out_ptr": "*i32"},
         dict(G=group, GS=gs, MAXC=_ss.MAX_CHUNKS, B=PAGE_SIZE, RULE=0, STEPS=_topk.KEY_STEPS_PER_UNIT,
              SCP=_ss.DEFAULT_TUNING.max_chunks, SUB=_merge_select.KEYS_SUB_BLOCK, BLOCK=_merge_select.MAX_BLOCK,
              CH_PAD=next_pow2(_ss.DEFAULT_TUNING.select_chunks), KC=next_pow2(page_budget - 2),
              K_PAD=next_pow2(page_budget), KEY_BITS=_merge_select.KEY_BITS), _merge_select.MERGE_WARPS),
        (_decode._sparse_decode_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "block_table_ptr": "*i32",
                                         "seq_lens_ptr": "*i32", "sel_ptr": "*i32", "part_out_ptr": "*fp32",
                                         "part_lse_ptr": "*fp32", "scale": "fp32"},
         dict(G=group, G_DOT=g_dot, D=head_dim, D_PAD=head_dim, B=PAGE_SIZE, PPI=_decode.DEFAULT_DECODE.pages_per_iter, FP32=False), _decode.DEFAULT_DECODE.warps),
        (_decode._merge_kernel, {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16"},
         dict(D=head_dim, D_PAD=head_dim, SPLIT_PAD=_decode.DEFAULT_DECODE.max_splits, EAGER=_decode.DEFAULT_DECODE.merge_eager), 4),
    ]


def _variants(**geometry) -> list[tuple[str, tuple]]:
    """(name, spec): every production kernel, plus the score kernel's byte path (int4 codes decoded per
    byte, one load per coefficient: formats without whole 32-bit words), its FMA coefficient contraction
    (r < 4, or G < 8 on 16-bit dots) and the merge selection on a short table."""
    specs = _specs(**geometry)
    named = [(spec[0].__name__, spec) for spec in specs]
    fn, pointers, constexprs, warps = next(spec for spec in specs if spec[0] is _ss._score_kernel)
    merge = next(spec for spec in specs if spec[0] is _merge_select._merge_select_kernel)
    # The merge path on a short table (16K bs1: chunks of <= 256 pages, 8-trial searches): its chunk and its tile
    # differ in shape, which the compiler must accept (the 1M spec above has both at 4096 lanes).
    short = (merge[0], merge[1], {**merge[2], "BLOCK": 256, "SUB": 256, "CH_PAD": 8, "CHUNK_WAYS": 3, "TILE_WAYS": 3}, merge[3])
    return named + [("_score_kernel[bytes]", (fn, pointers, {**constexprs, "WORDS": False, "COEF_VEC": False}, warps)),
                               ("_score_kernel[fma]", (fn, pointers, {**constexprs, "COEF_MMA": False}, warps)),
                               ("_merge_select_kernel[short]", short)]


def compile_kernel(fn, pointer_types: dict, constexprs: dict, warps, target: GPUTarget = SM90):
    """One kernel compiled as the JIT would specialise it in production (`PRODUCTION_HINTS`); constexpr
    parameters left out take their defaults, as at a launch (else they would compile as runtime ints)."""
    defaults = {p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}
    constexprs = {**defaults, **constexprs}
    signature = {name: "constexpr" if name in constexprs else pointer_types.get(name, "i32") for name in fn.arg_names}
    hints = PRODUCTION_HINTS.get(fn.__name__, {})
    constexprs = {**constexprs, **{name: 1 for name, hint in hints.items() if hint == 1}}
    signature.update({name: "constexpr" for name, hint in hints.items() if hint == 1})
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if signature[name].startswith("*") or hints.get(name) == 16}
    warps, maxnreg = warps if isinstance(warps, tuple) else (warps, None)
    options = {"num_warps": warps} if maxnreg is None else {"num_warps": warps, "maxnreg": maxnreg}
    return triton.compile(triton.compiler.ASTSource(fn, signature, constexprs, attrs), target=target, options=options)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """Triton's bundled cuobjdump on a cubin (no device needed)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return subprocess.run([tool, flag, file.name], capture_output=True, text=True, check=True).stdout


def _loop_span(sass: str, skip_cold: bool = False) -> tuple[list[tuple[int, str]], tuple[int, int] | None]:
    """The kernel's (address, instruction) lines and its largest loop's (first, last) address, None without one."""
    lines = [(int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    last_exit = max((addr for addr, text in lines if re.search(r"\bEXIT\b", text)), default=None)
    loops = [(int(t[1], 16), addr) for addr, text in lines
             if (t := re.search(r"\bBRA\b[^`]*?0x([0-9a-f]+)", text)) and int(t[1], 16) < addr
             and not (skip_cold and last_exit is not None and addr > last_exit)]
    return lines, max(loops, key=lambda span: span[1] - span[0]) if loops else None


def prologue_instructions(sass: str, skip_cold: bool = False) -> int:
    """Instructions before the largest loop: what a thread runs once before its first iteration (the CUDA
    scorer's query conversion and first copies), counted statically."""
    lines, span = _loop_span(sass, skip_cold)
    return sum(addr < span[0] for addr, _ in lines) if span else 0


def _largest_loop(sass: str, skip_cold: bool = False) -> list[str]:
    """The instructions of the kernel's largest loop body (its back-branch span), [] without a loop.

    skip_cold: ignore back-branches after the last EXIT. In the CUDA scorer those are the compiler's cold paths
    (divergent-warp fallbacks of its collective operations) jumping back into the body, and their spans are not
    loops; a Triton kernel's own loop can close right after its last EXIT, so its reports keep them."""
    lines, span = _loop_span(sass, skip_cold)
    return [text for addr, text in lines if span[0] <= addr <= span[1]] if span else []


def loop_opcodes(sass: str, skip_cold: bool = False) -> dict[str, int]:
    """Opcode counts (predicates and modifiers dropped) in the largest loop body, most frequent first:
    which kind of work a tile spends its issue slots on (e.g. the scorer's int4 decode: LOP3, PRMT, HADD2)."""
    counts: dict[str, int] = {}
    for text in _largest_loop(sass, skip_cold):
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))


def loop_profile(sass: str, skip_cold: bool = False) -> tuple[int, int, int, int]:
    """(instructions, local-memory spill accesses, global loads, tensor-core mma) in the body of the kernel's
    largest loop, per thread per iteration: its issue budget and how many memory requests each iteration waits on."""
    body = _largest_loop(sass, skip_cold)
    if not body:
        return 0, 0, 0, 0
    return (len(body), sum(bool(re.search(r"\b(STL|LDL)", text)) for text in body),
            sum(bool(re.search(r"\bLDG", text)) for text in body), sum(bool(re.search(r"\b[HI]MMA", text)) for text in body))


def compile_all(target: GPUTarget = SM90, **geometry) -> dict[str, dict[str, int]]:
    """Compile each kernel for `target`; returns {kernel: {"registers", "stack_bytes", "shared_bytes",
    "loop_instructions", "loop_spill_accesses", "loop_global_loads", "loop_mma"}}."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET to compile for the GPU (the interpreter replaces @triton.jit)")
    usage = {}
    for name, (fn, pointer_types, constexprs, warps) in _variants(**geometry):
        kernel = compile_kernel(fn, pointer_types, constexprs, warps, target)
        found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", _cuobjdump(kernel.asm["cubin"], "--dump-resource-usage"))
        instructions, spills, loads, mma = loop_profile(_cuobjdump(kernel.asm["cubin"], "-sass"))
        usage[name] = {"registers": int(found[1]), "stack_bytes": int(found[2]), "shared_bytes": kernel.metadata.shared,
                       "loop_instructions": instructions, "loop_spill_accesses": spills, "loop_global_loads": loads, "loop_mma": mma}
    return usage


def cuda_score_report(rows_per_lane: int, rows_under_4gib: bool = True, rc: RowConstants | None = None,
                      defines: tuple[tuple[str, int], ...] = ()) -> dict:
    """The CUDA score kernel compiled for sm_90 here (NVRTC): {"registers", "stack_bytes", "loop_instructions",
    "loop_spill_accesses", "loop_global_loads", "loop_mma", "loop_opcodes"} of its tile loop (per thread), and
    "prologue_instructions" before it."""
    rc = rc or RowConstants.of(SummaryLayout(SummaryFormat.parse("r8i4"), 128))
    cubin = _cuda_score.compile_cubin(_cuda_score.compile_options(rc, rows_under_4gib, rows_per_lane, defines))
    usage = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(cubin, "--dump-resource-usage"))
    sass = _cuobjdump(cubin, "-sass")
    instructions, spills, loads, mma = loop_profile(sass, skip_cold=True)
    return {"registers": int(usage[1]), "stack_bytes": int(usage[2]), "loop_instructions": instructions,
            "loop_spill_accesses": spills, "loop_global_loads": loads, "loop_mma": mma,
            "prologue_instructions": prologue_instructions(sass, skip_cold=True),
            "loop_opcodes": loop_opcodes(sass, skip_cold=True)}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    parser = argparse.ArgumentParser(description="Compile every Locks kernel for sm_90 and print its facts.")
    parser.add_argument("--opcodes", metavar="KERNEL", help="print the loop's opcode counts of one variant (e.g. _score_kernel)")
    parser.add_argument("--cuda", action="store_true", help="the CUDA score kernel (NVRTC) instead: its tile loop "
                        "at 1 and 2 rows per lane, with the loop's opcode counts")
    args = parser.parse_args(argv)
    if args.cuda:
        for rows in (1, 2):
            print(json.dumps({"lane_rows": rows, **cuda_score_report(rows)}))
        return 0
    if args.opcodes:
        variants = dict(_variants())
        if args.opcodes not in variants:
            print(f"error: --opcodes {args.opcodes!r} is not one of {sorted(variants)}", file=sys.stderr)
            return 2
        fn, pointer_types, constexprs, warps = variants[args.opcodes]
        for op, n in loop_opcodes(_cuobjdump(compile_kernel(fn, pointer_types, constexprs, warps).asm["cubin"], "-sass")).items():
            print(f"{op:10s} {n}")
        return 0
    for name, facts in compile_all().items():
        print(f"{name:24s} {facts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
