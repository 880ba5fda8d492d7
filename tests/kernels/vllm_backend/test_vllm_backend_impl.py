"""The Locks impl's forward on CPU tensors, through the real CPU_ATTN cache layout: a prefill step
(stock attention + summaries of its full pages) then a decode step (summary of the page that just
filled, score + select, sparse attention), checked against an independent torch computation from
the raw keys/values: Locks scorer -> GQA combine -> select, then softmax over the chosen tokens."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from locks_toolkit.kernels.config import SELECT_PATHS, SummaryFormat, scored_pages  # noqa: E402
from locks_toolkit.kernels.score.selectors import make_scorer  # noqa: E402
from locks_toolkit.kernels.select.reference import combine_group, select_pages  # noqa: E402
from locks_toolkit.kernels.vllm_backend import counters, debug  # noqa: E402
from test_vllm_backend import make_cam, random_block_table  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

HQ, HKV, D, PAGE = 6, 2, 32, 16
GROUP = HQ // HKV
PROMPT_LENS = [75, 160, 47]  # decode 1: 76, 161, 48 (fills page 2 of the last); decode 2: 77, 162, 49
DECODE_STEPS = 2
NUM_BLOCKS = 120


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("impl-llama")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HQ * D, "intermediate_size": 128,
        "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D, "num_hidden_layers": 1,
        "vocab_size": 256, "max_position_embeddings": 1024, "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def run_steps(model_dir, generator, per_request=None, **locks):
    """Prefill PROMPT_LENS, then DECODE_STEPS single-token decodes; returns the keys and values of
    every token and the last decode step's (query, Locks step, output). `per_request`: each sequence's
    `extra_args` (None: the engine's settings), served through the per-request logits processor."""
    from locks_toolkit.kernels.vllm_backend.backend_cpu import LocksCpuBackend, LocksCpuBuilder, LocksCpuImpl
    from locks_toolkit.kernels.vllm_backend.settings import REQUEST_SETTINGS_PROCESSOR

    config = EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", block_size=PAGE, max_model_len=512,
        max_num_seqs=8, dtype="float32", additional_config={"locks": locks},
        logits_processors=[REQUEST_SETTINGS_PROCESSOR] if per_request else None,
    ).create_engine_config()
    if per_request:
        from locks_toolkit.kernels.vllm_backend.request_settings import RequestSettings
        from vllm import SamplingParams
        from vllm.v1.sample.logits_processor import BatchUpdate

        added = [(i, SamplingParams(extra_args=args), [0] * n, []) for i, (args, n) in enumerate(zip(per_request, PROMPT_LENS))]
        RequestSettings(config, torch.device("cpu"), False).update_state(BatchUpdate(len(added), [], added, []))
    scale = D**-0.5
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=HKV, head_size=D, dtype=torch.float32)
    with set_current_vllm_config(config):
        builder = LocksCpuBuilder(spec, ["model.layers.0.self_attn.attn"], config, torch.device("cpu"))
        impl = LocksCpuImpl(HQ, D, scale, HKV, None, None, "auto")
    layer = SimpleNamespace(layer_name="model.layers.0.self_attn.attn", _k_scale_float=1.0, _v_scale_float=1.0)
    kv_cache = torch.zeros(LocksCpuBackend.get_kv_cache_shape(NUM_BLOCKS, PAGE, HKV, D))
    table = random_block_table(generator, len(PROMPT_LENS), width=12, num_blocks=NUM_BLOCKS)
    keys = [torch.randn(n + DECODE_STEPS, HKV, D, generator=generator) * 2 for n in PROMPT_LENS]
    values = [torch.randn(n + DECODE_STEPS, HKV, D, generator=generator) for n in PROMPT_LENS]

    def step(query_lens, seq_lens, token_slices):
        cam = make_cam(query_lens, seq_lens, table)
        metadata = builder.build(0, cam)
        key = torch.cat([k[s] for k, s in zip(keys, token_slices)])
        value = torch.cat([v[s] for v, s in zip(values, token_slices)])
        query = torch.randn(key.shape[0], HQ, D, generator=generator)
        output = torch.full((key.shape[0], HQ * D), float("nan"))
        impl.do_kv_cache_update(layer, key, value, kv_cache, cam.slot_mapping)
        impl.forward(layer, query, key, value, kv_cache, metadata, output)
        return query, metadata.locks, output.view(-1, HQ, D)

    step(PROMPT_LENS, PROMPT_LENS, [slice(0, n) for n in PROMPT_LENS])
    for t in range(DECODE_STEPS):
        decode_lens = [n + t + 1 for n in PROMPT_LENS]
        query, locks_step, output = step([1] * len(PROMPT_LENS), decode_lens, [slice(n + t, n + t + 1) for n in PROMPT_LENS])
    return keys, values, query, locks_step, output, (impl, table)


def expected_selection_and_output(keys, values, query, budget, fmt="r8i4"):
    """Independent of the cache: Locks scores of full pages -> share-average -> select -> attend."""
    scorer = make_scorer("locks", fmt=fmt)
    page_budget = budget // PAGE
    selections, outputs = [], []
    for row, (k_seq, v_seq) in enumerate(zip(keys, values)):
        length = k_seq.shape[0]
        num_pages, full = math.ceil(length / PAGE), scored_pages(length)
        grouped_q = query[row].reshape(HKV, GROUP, D)
        pages = k_seq[: full * PAGE].reshape(full, PAGE, HKV, D).permute(2, 0, 1, 3)  # [Hkv, full, 16, d]
        scores = torch.full((HKV, GROUP, num_pages), float("-inf"))
        if full:
            scores[..., :full] = scorer.scores(scorer.prepare(pages), grouped_q, D**-0.5)
        mask = (torch.arange(num_pages) < full).expand(HKV, num_pages)
        chosen = select_pages(combine_group(scores, "share_average", mask), num_pages, page_budget)  # [Hkv, k]
        selections.append(chosen)
        token_page = torch.arange(length) // PAGE
        out = torch.empty(HQ, D)
        for h in range(HKV):
            keep = torch.isin(token_page, chosen[h][chosen[h] >= 0])
            logits = grouped_q[h].double() @ k_seq[keep, h].double().T * D**-0.5
            out[h * GROUP : (h + 1) * GROUP] = (torch.softmax(logits, -1) @ v_seq[keep, h].double()).float()
        outputs.append(out)
    return torch.stack(selections), torch.stack(outputs)


@pytest.mark.parametrize("budget", [48, 2048])
def test_decode_rows_match_sparse_attention_over_the_reference_selection(model_dir, budget):
    counters.reset()
    keys, values, query, step, output, (impl, table) = run_steps(model_dir, torch.Generator().manual_seed(budget), budget=budget)
    want_pages, want_out = expected_selection_and_output(keys, values, query, budget)
    assert torch.equal(step.selected_pages.long(), want_pages)
    torch.testing.assert_close(output, want_out, rtol=1e-4, atol=1e-5)
    # Summaries: every full prompt page at prefill (4 + 10 + 2); page 2 of the third sequence, completed
    # by the first decode step and built at the start of the second (which scores it: 4 pages > k=3);
    # and page 9 of the second again at its first decode step (its prompt ended on a page boundary: the
    # builder cannot tell a page completed by the prompt from one completed by a decode; rebuilding is idempotent).
    assert counters.snapshot()["summaries_built"] == 4 + 10 + 2 + 1 + 1
    # Exactly the blocks of full pages carry a summary (a missing decode-time build shows up here).
    has_row = impl._summary_rows.flatten(1).ne(0).any(-1)
    full_blocks = {int(table[r, p]) for r, n in enumerate(PROMPT_LENS) for p in range((n + DECODE_STEPS) // PAGE)}
    assert {int(b) for b in torch.nonzero(has_row).flatten()} == full_blocks
    if budget >= max(PROMPT_LENS) + DECODE_STEPS:  # every page fits: the Locks path is exact dense attention
        assert all((step.selected_pages[row] >= 0).sum(-1).tolist() == [math.ceil((n + DECODE_STEPS) / PAGE)] * HKV
                   for row, n in enumerate(PROMPT_LENS))


def test_per_request_rows_each_get_their_own_selection_in_one_step(model_dir):
    """One decode step, three settings: Locks b=48, exact attention, Locks b=32 (the engine's budget is 2048)."""
    counters.reset()
    settings = [{"locks": {"budget": 48}}, {"locks": {"scorer": "dense"}}, {"locks": {"scorer": "locks", "budget": 32}}]
    keys, values, query, step, output, _ = run_steps(model_dir, torch.Generator().manual_seed(7), per_request=settings,
                                                     budget=2048)  # fmt: skip
    assert sorted(g.selection.label() for g in step.groups) == ["dense", "locks b=32", "locks b=48"]
    for row, budget in ((0, 48), (1, 4096), (2, 32)):
        _, want = expected_selection_and_output(keys, values, query, budget)
        torch.testing.assert_close(output[row], want[row], rtol=1e-4, atol=1e-5)
    _, engine_default = expected_selection_and_output(keys, values, query, 2048)
    assert not torch.allclose(output[0], engine_default[0], atol=1e-3)  # b=48 really selected fewer pages
    counts = counters.snapshot()  # 2 decode steps x 1 layer: row 1 exact, rows 0 and 2 sparse (more pages than k)
    assert counts["full_kv_rows"] == DECODE_STEPS and counts["sparse_decode_rows"] == 2 * DECODE_STEPS


def test_sparse_selection_really_differs_from_dense(model_dir):
    keys, values, query, step, output, (impl, table) = run_steps(model_dir, torch.Generator().manual_seed(5), budget=32)
    _, dense_out = expected_selection_and_output(keys, values, query, 4096)
    assert not torch.allclose(output[:2], dense_out[:2], atol=1e-3)  # sequences with > 2 pages


def test_oracle_scorer_and_debug_capture(model_dir):
    debug.clear()
    keys, values, query, step, output, (impl, table) = run_steps(
        model_dir, torch.Generator().manual_seed(11), budget=48, scorer="oracle", debug_capture_layers=[0]
    )
    oracle = make_scorer("oracle")
    for row, k_seq in enumerate(keys):
        length = k_seq.shape[0]
        num_pages, full = math.ceil(length / PAGE), scored_pages(length)
        pages = k_seq[: full * PAGE].reshape(full, PAGE, HKV, D).permute(2, 0, 1, 3)
        scores = torch.full((HKV, GROUP, num_pages), float("-inf"))
        if full:
            scores[..., :full] = oracle.scores(oracle.prepare(pages), query[row].reshape(HKV, GROUP, D), D**-0.5)
        mask = (torch.arange(num_pages) < full).expand(HKV, num_pages)
        assert torch.equal(step.selected_pages[row].long(), select_pages(combine_group(scores, "share_average", mask), num_pages, 3))
    assert len(debug.captures) == DECODE_STEPS and torch.equal(debug.captures[-1]["out"], output)


def _triton_devices():
    from locks_toolkit.kernels.checks import available_devices

    return available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]


@pytest.mark.parametrize("device", _triton_devices())
def test_triton_adapter_runs_the_decode_sequence_like_the_reference_adapter(device):
    """The backend's TritonOps (workspaces sized from DecodeShape, argument order, a CUDA-graph
    padding row with seq_len 0) against ReferenceOps on the same FA-layout cache."""
    from locks_toolkit.kernels.build.packing import SummaryLayout
    from locks_toolkit.kernels.vllm_backend.kernel_ops import DecodeShape, ReferenceOps, TritonOps

    generator = torch.Generator().manual_seed(2024)
    num_blocks, hq, hkv, d, page_budget = 30, 8, 2, 32, 4
    seq_lens = torch.tensor([16 * 6 + 3, 16 * 4, 16 * 2 + 7, 0], dtype=torch.int32)  # last row: graph padding
    table = (torch.randperm(num_blocks - 1, generator=generator)[: 4 * 7] + 1).reshape(4, 7).to(torch.int32)
    k_cache = torch.randn(num_blocks, PAGE, hkv, d, generator=generator) * 2
    v_cache = torch.randn(num_blocks, PAGE, hkv, d, generator=generator)
    q = torch.randn(4, hq, d, generator=generator)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), d)
    shape = DecodeShape(max_seqs=4, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, max_pages=7, page_budget=page_budget)
    to = lambda t: t.to(device)  # noqa: E731
    results = {}
    for label, ops in (("reference", ReferenceOps()), ("chunked", TritonOps("chunked")), ("merge", TritonOps("merge")), ("auto", TritonOps())):
        rows = to(torch.zeros(num_blocks, hkv, layout.row_bytes, dtype=torch.uint8))
        selected = to(torch.full((4, hkv, page_budget), 7, dtype=torch.int32))
        out = to(torch.full((4, hq, d), float("nan")))
        workspace = ops.workspace(shape, layout, torch.device(device))
        full_blocks = torch.cat([table[r, : int(n) // PAGE] for r, n in enumerate(seq_lens.tolist())])
        ops.build_summaries(to(k_cache), to(full_blocks), rows, layout)
        ops.score_select(to(q), rows, to(table), to(seq_lens), selected, layout, page_budget, d**-0.5,
                         "share_average", hkv, workspace)
        ops.sparse_paged_decode(to(q), to(k_cache), to(v_cache), to(table), to(seq_lens), selected, d**-0.5, out, workspace)
        results[label] = (selected.cpu(), out.cpu())
    ref_sel, ref_out = results["reference"]
    for path in ("chunked", "merge", "auto"):  # the backend's `select` setting: same pages, other launches
        tri_sel, tri_out = results[path]
        assert torch.equal(tri_sel[:3], ref_sel[:3]), path
        torch.testing.assert_close(tri_out[:3], ref_out[:3], rtol=1e-4, atol=1e-4)
        assert torch.isfinite(tri_out[3]).all()  # the padding row must not poison the output buffer


@pytest.mark.parametrize("device", _triton_devices())
def test_auto_select_runs_the_merge_path(device):
    """select="auto" (the default) launches the merge selection; a pinned path stays."""
    from locks_toolkit.kernels.vllm_backend.kernel_ops import TritonOps

    assert TritonOps().tuning.select_path == "merge"
    assert [TritonOps(path).tuning.select_path for path in ("merge", "chunked")] == ["merge", "chunked"]


@pytest.mark.parametrize("device", _triton_devices())
def test_selection_replay_reproduces_the_engines_pages(model_dir, device):
    """A decode capture replayed through the Triton score kernel and every selection path
    (harness/lab/selection_replay.py) selects the pages the backend selected, and its key statistics
    describe the threshold search: nothing contested above the threshold's bin when k - 2 = 1."""
    from locks_toolkit.harness.lab.selection_replay import path_tunings, replay_capture

    debug.clear()
    run_steps(model_dir, torch.Generator().manual_seed(13), budget=48, scorer="locks", debug_capture_layers=[0])
    try:
        records = [r for cap in debug.captures for r in replay_capture(cap, path_tunings())]
    finally:
        debug.clear()
    assert len(records) == DECODE_STEPS * len(SELECT_PATHS)
    assert all(r["same_pages_as_engine"] for r in records), [(r["tuning"]["select_path"], r["seq_lens"]) for r in records]
    last = records[-1]
    lens = [n + DECODE_STEPS for n in PROMPT_LENS]
    assert last["seq_lens"] == lens
    stats = last["key_stats"]
    assert {(st["seq"], st["head"]) for st in stats} == {(s, h) for s, n in enumerate(lens) if math.ceil(n / PAGE) > 3
                                                         for h in range(HKV)}
    for st in stats:
        assert st["contested"] == math.ceil(lens[st["seq"]] / PAGE) - 2 and st["above_bin"] == 0
        assert 1 <= st["tied_at_threshold"] <= st["in_threshold_bin"] <= st["contested"]
        assert 1 <= st["distinct_low_in_bin"] <= st["in_threshold_bin"]
