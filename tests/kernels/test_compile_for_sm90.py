"""Every kernel compiles for sm_90 (H200) on a CPU machine, without register spills.

The interpreter tests cannot see GPU-only lowering errors; this compiles through ptxas (bundled
with Triton) in a subprocess without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_kernels_compile_for_sm90_without_spills():
    """Compiled as the JIT specialises production launches (compile_report.PRODUCTION_HINTS). No kernel may touch
    local memory inside its main loop. The scorer's production path contracts the coefficients on the
    tensor cores (one warp, 4-page tiles: 29.3 us against 37.8 with the FMA contraction at 128K bs1 on
    the H200, 2026-11-30), so its loop holds more mma instructions than the FMA variant's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json; from locks_toolkit.harness.lab.compile_report import compile_all; print(json.dumps(compile_all()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    usage = json.loads(done.stdout.strip().splitlines()[-1])
    print(usage)
    assert set(usage) == {"_build_kernel", "_score_kernel", "_keys_kernel", "_gather_kernel", "_resolve_kernel",
                          "_merge_select_kernel", "_sparse_decode_kernel", "_merge_kernel",
                          "_score_kernel[bytes]", "_score_kernel[fma]", "_merge_select_kernel[short]", "_score_t_kernel"}
    spilled = {name: facts for name, facts in usage.items() if facts["loop_spill_accesses"] > 0 or facts["stack_bytes"] > 16}
    assert not spilled, f"register spills on sm_90: {spilled}"
    score, fma = usage["_score_kernel"], usage["_score_kernel[fma]"]
    assert score["loop_mma"] > fma["loop_mma"] > 0, (score, fma)
    # The transposed kernel (2-page tiles, G = 8 in 16 mma rows): the basis dot 4 shifts x 2 k-steps x 2 n-tiles,
    # the centroid dot 8 k-steps, the contraction's two terms 1 k-step x 4 n-tiles each; V^T q never goes
    # through shared memory, so fewer shared stores than the pages kernel's whole tile of 4 pages.
    t = usage["_score_t_kernel"]
    assert t["loop_mma"] == 16 + 8 + 8 and t["loop_spill_accesses"] == 0 and t["stack_bytes"] == 0, t


def test_loop_opcodes_count_the_largest_loop_only():
    from locks_toolkit.harness.lab.compile_report import loop_opcodes, loop_profile

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;",  # before the loop
        "        /*0020*/                   LOP3.LUT R4, R3, 0xf0, RZ, 0xc0, !PT ;",
        "        /*0030*/                   PRMT R5, R4, 0x5410, R2 ;",
        "        /*0040*/               @P0 HMMA.16816.F32.BF16 R8, R4, R6, R8 ;",
        "        /*0050*/              @!P1 LDG.E R9, desc[UR4][R2.64] ;",
        "        /*0060*/                   BRA 0x20 ;",
        "        /*0070*/                   EXIT ;",
    ])
    assert loop_opcodes(sass) == {"LOP3": 1, "PRMT": 1, "HMMA": 1, "LDG": 1, "BRA": 1}
    assert loop_profile(sass) == (5, 0, 1, 1)
    assert loop_opcodes("        /*0000*/                   EXIT ;") == {}


def test_cold_back_branches_after_the_last_exit_are_skipped_on_request():
    """The CUDA scorer's divergent-warp fallbacks sit after its last EXIT and branch back into the body: their
    span is not a loop. A Triton loop can close right after its last EXIT, so only the CUDA report skips them."""
    from locks_toolkit.harness.lab.compile_report import loop_profile

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;",
        "        /*0020*/                   IMMA.16832.S8.U8 R8, R12.ROW, R6.COL, R8 ;",  # the loop: 0x20 .. 0x30
        "        /*0030*/              @P0 BRA 0x20 ;",
        "        /*0040*/                   EXIT ;",
        "        /*0050*/                   WARPSYNC.COLLECTIVE R1, 0x60 ;",  # a cold path back into the body
        "        /*0060*/                   BRA 0x10 ;",
    ])
    assert loop_profile(sass, skip_cold=True) == (2, 0, 0, 1)
    assert loop_profile(sass) == (6, 0, 1, 1)

