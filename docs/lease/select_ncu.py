"""One merge-selection launch at a kernel-bench cell (context tokens, batch), bracketed by cudaProfilerStart/Stop
for ncu (`select-ncu.sh`): the score kernel runs first, three selections warm the compile, the fourth is profiled.
A third argument `flat` scores zero queries: every page gets the same key, as under an engine's dummy weights
(logits ~1e-8), so the threshold searches take no pass and only the selection's fixed work is left."""
import logging
import sys

import torch
from locks_toolkit.harness.lab import kernel_bench as kb
from locks_toolkit.kernels import ops
from locks_toolkit.kernels.build.packing import SummaryLayout
from locks_toolkit.kernels.config import SummaryFormat

logging.basicConfig(level=logging.INFO)
log = logging.getLogger("select_ncu")
context, batch = int(sys.argv[1]), int(sys.argv[2])
flat = sys.argv[3:] == ["flat"]
cfg = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(context,), batch_sizes=(batch,))
geom = kb.resolve_geometry(cfg.preset)
layout = SummaryLayout(SummaryFormat.parse(cfg.summary_format), geom.head_dim)
state = kb._ContextState(geom, layout, context, batch, torch.Generator().manual_seed(0))
q, bt, seq_lens, selected, sws, tuning, k_pages = kb.selection_inputs(cfg, geom, layout, state, batch)
if flat:
    q.zero_()
chunks = ops._launch_score(q, state.rows[0], bt, seq_lens, layout, geom.head_dim**-0.5, geom.num_kv_heads, sws, tuning)
for _ in range(3):
    ops._launch_select(sws, seq_lens, selected, geom.group, chunks, cfg.combine, k_pages, tuning)
torch.cuda.synchronize()
log.info("tuning %s, %d score chunks", tuning, chunks)
torch.cuda.profiler.start()
ops._launch_select(sws, seq_lens, selected, geom.group, chunks, cfg.combine, k_pages, tuning)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
