"""Time build_summaries on one GPU: the prompt build of one layer and the decode-time build of one block.

`python -m locks_toolkit.harness.lab.build_bench [--blocks 8192] [--heads 4] [--dim 128] [--format r8i4]`
prints µs per layer for (1) a prompt build of --blocks blocks x --heads KV heads (eager, CUDA events)
and (2) the decode-time build of one block x --heads heads, captured 40 times in one CUDA graph
(one launch per layer, as the engine does) and reported per launch. Keys are Gaussian or
"structured" (a few dominant directions plus an offset, like real keys: Jacobi needs more sweeps).
The build is checked against the reference on the GPU first.
"""

from __future__ import annotations

import argparse
import logging

import torch

from ...kernels import ops
from ...kernels.build import kernel as build
from ...kernels.build.packing import SummaryLayout
from ...kernels.checks import check_build
from ...kernels.config import PAGE_SIZE, SummaryFormat

log = logging.getLogger(__name__)


def _keys(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """bf16 keys [NB, 16, Hkv, d]: 'gaussian' or 'structured' (4 dominant directions per block and head + offset)."""
    if kind == "gaussian":
        return torch.randn(shape, generator=gen).to(torch.bfloat16)
    nb, b, h, d = shape
    weights = torch.randn((nb, b, h, 4), generator=gen) * torch.tensor([8.0, 4.0, 2.0, 1.0])
    directions = torch.randn((nb, h, 4, d), generator=gen)
    keys = torch.einsum("nbhr,nhrd->nbhd", weights, directions) + 0.3 * torch.randn(shape, generator=gen) + 5.0
    return keys.to(torch.bfloat16)


def _time_us(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000.0 * start.elapsed_time(end) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--format", default="r8i4")
    parser.add_argument("--keys", choices=("gaussian", "structured"), default="structured")
    parser.add_argument("--pages-per-program", type=int, default=build.PAGES_PER_PROGRAM,
                        help="prompt-build tile to try (1 or 2 fit in registers at d=128)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = check_build("cuda", args.format, args.dim, torch.bfloat16, 1234)
    if not result.ok:
        raise SystemExit(f"build check failed, not timing: {result}")
    build.PAGES_PER_PROGRAM = args.pages_per_program  # a tuning knob of this tool only
    layout = SummaryLayout(SummaryFormat.parse(args.format), args.dim)
    gen = torch.Generator().manual_seed(0)
    k = _keys(args.keys, (args.blocks, PAGE_SIZE, args.heads, args.dim), gen).cuda()
    rows = torch.zeros((args.blocks, args.heads, layout.row_bytes), dtype=torch.uint8, device="cuda")
    ids = torch.randperm(args.blocks, generator=gen).to(torch.int32).cuda()
    prompt = _time_us(lambda: ops.build_summaries(k, ids, rows, layout), reps=5)
    log.info("prompt build %d blocks x %d heads (P=%d): %.1f us/layer = %.1f ms for 40 layers",
             args.blocks, args.heads, build.build_tile(ids.numel() * args.heads), prompt, 40 * prompt / 1000)
    one = [ids[i : i + 1].clone() for i in range(40)]  # 40 layers, each completing a different block
    ops.build_summaries(k, one[0], rows, layout)  # compiles the one-page variant before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for block in one:
            ops.build_summaries(k, block, rows, layout)
    decode = _time_us(graph.replay, reps=50) / 40
    log.info("decode-time build 1 block x %d heads: %.1f us/layer (40 launches in one graph)", args.heads, decode)
    # What the backend does: one eager launch building the completed block on all 40 layers.
    caches = [k] + [k.clone() for _ in range(3)]  # 4 distinct caches, each reused by 10 layers' rows
    layer_rows = [torch.zeros_like(rows) for _ in range(40)]
    tables = ops.layer_tables([caches[i % 4] for i in range(40)], layer_rows, layout)
    all_layers = _time_us(lambda: ops.build_summaries_layers(tables, one[0], layout), reps=50)
    log.info("decode-time build 1 block x %d heads x 40 layers in one launch: %.1f us", args.heads, all_layers)


if __name__ == "__main__":
    main()
