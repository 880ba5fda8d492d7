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
from locks_toolkit.kernels.config import SelectionConfig, SummaryFormat

logging.basicConfig(level=logging.INFO)
log = logging.getLogger("select_ncu")
context, batch = int(sys.argv[1]), int(sys.argv[2])
flat = sys.argv[3:] == ["flat"]
cfg = kb.KernelBenchConfig(preset="glm4-9b-1m", contexts=(context,), batch_sizes=(batch,))
geom = kb.resolve_geometry(cfg.preset)
layout = SummaryLayout(SummaryFormat.parse(cfg.summary_format), geom.head_dim)
state = kb._ContextState(geom, layout, context, batch, torch.Generator().manual_seed(0))
k_pages = SelectionConfig(budget_tokens=cfg.budget_tokens).page_budget
q = torch.randn((batch, geom.num_q_heads, geom.head_dim), device="cuda", dtype=torch.bfloat16) * (0 if flat else 1)
bt = state.block_table[:batch]
seq_lens = torch.full((batch,), state.seq_len, dtype=torch.int32, device="cuda")
selected = torch.empty((batch, geom.num_kv_heads, k_pages), dtype=torch.int32, device="cuda")
sws = ops.score_select_workspace(batch, geom.num_kv_heads, state.pages, "cuda", group_size=geom.group)
tuning = kb.resolve_tuning(cfg)
ops.prepare_score_kernel(state.rows[0], layout, geom.group, tuning)
chunks = ops._launch_score(q, state.rows[0], bt, seq_lens, layout, geom.head_dim**-0.5, geom.num_kv_heads, sws, tuning)
for _ in range(3):
    ops._launch_select(sws, seq_lens, selected, geom.group, chunks, cfg.combine, k_pages, tuning)
torch.cuda.synchronize()
log.info("tuning %s, %d score chunks", tuning, chunks)
torch.cuda.profiler.start()
ops._launch_select(sws, seq_lens, selected, geom.group, chunks, cfg.combine, k_pages, tuning)
torch.cuda.synchronize()
torch.cuda.profiler.stop()
