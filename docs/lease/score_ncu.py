"""One CUDA score-kernel launch at a kernel-bench cell (context tokens, batch), bracketed by cudaProfilerStart/Stop
for ncu (`score-probe.sh`): three warm launches, the fourth profiled. A third argument names a probe variant of
`harness/lab/score_probe.py` (default: the deployed launch)."""
import logging
import sys

import torch
from locks_toolkit.harness.lab import kernel_bench as kb
from locks_toolkit.harness.lab import score_probe as sp
from locks_toolkit.kernels.build.packing import SummaryLayout
from locks_toolkit.kernels.config import SummaryFormat
from locks_toolkit.kernels.score import cuda as cuda_score
from locks_toolkit.kernels.score.pages import MAX_CHUNKS
from locks_toolkit.kernels.triton_common import RowConstants

logging.basicConfig(level=logging.INFO)
context, batch = int(sys.argv[1]), int(sys.argv[2])
variant = {v.name: v for v in sp.VARIANTS}[sys.argv[3] if len(sys.argv) > 3 else "deployed"]
cfg = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(context,), batch_sizes=(batch,))
geom = kb.resolve_geometry(cfg.preset)
layout = SummaryLayout(SummaryFormat.parse(cfg.summary_format), geom.head_dim)
state = kb._ContextState(geom, layout, context, batch, torch.Generator().manual_seed(0))
q, bt, seq_lens, _sel, ws, _tuning, _k = kb.selection_inputs(cfg, geom, layout, state, batch)
bt = variant.table(bt)
chunks = variant.programs(sp.deployed_chunks(batch * geom.num_kv_heads, bt.shape[1]))
rc = RowConstants.of(layout)


def launch():
    cuda_score.launch(q, state.rows[0], bt, seq_lens, ws, rc, geom.head_dim**-0.5, geom.num_kv_heads, chunks,
                      MAX_CHUNKS, variant.defines)


for _ in range(3):
    launch()
torch.cuda.synchronize()
logging.info("variant %s, %d programs per pair", variant.name, chunks)
torch.cuda.profiler.start()
launch()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
