"""The Locks vLLM backend against the real vLLM 0.24 package (CPU build): registration, config,
metadata building and the impl's decode path (engine end to end: test_vllm_backend_engine.py)."""

from __future__ import annotations

import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from locks_toolkit.kernels.config import ConfigError, SummaryFormat  # noqa: E402
from locks_toolkit.kernels.vllm_backend import counters, plugin  # noqa: E402
from locks_toolkit.kernels.vllm_backend.settings import parse_settings, settings_from_vllm_config  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE = 6, 2, 32, 16
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": NUM_Q_HEADS * HEAD_DIM,
        "intermediate_size": 256, "num_attention_heads": NUM_Q_HEADS, "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM, "num_hidden_layers": 2, "vocab_size": 512, "max_position_embeddings": 2048,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def make_vllm_config(model_dir, **locks):
    return EngineArgs(
        model=str(model_dir), skip_tokenizer_init=True, load_format="dummy", block_size=PAGE, max_model_len=512,
        max_num_seqs=8, dtype="float32", additional_config={"locks": locks},
    ).create_engine_config()


# -- registration -----------------------------------------------------------------------------
@pytest.fixture
def clean_registry():
    yield
    AttentionBackendEnum.CUSTOM.clear_override()
    AttentionBackendEnum.CPU_ATTN.clear_override()


def test_register_is_idempotent_and_puts_the_locks_class_under_custom(clean_registry, monkeypatch):
    monkeypatch.delenv(plugin.CPU_OPT_IN_ENV, raising=False)
    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_path() == plugin.CUDA_BACKEND_PATH
    backend = AttentionBackendEnum.CUSTOM.get_class()
    # vLLM's Attention looks the backend's name up in the enum; it must be the slot we occupy.
    assert AttentionBackendEnum[backend.get_name()] is AttentionBackendEnum.CUSTOM
    assert not AttentionBackendEnum.CPU_ATTN.is_overridden()


def test_cpu_attn_is_overridden_only_with_the_opt_in_variable(clean_registry, monkeypatch):
    monkeypatch.setenv(plugin.CPU_OPT_IN_ENV, "1")
    plugin.register()
    assert AttentionBackendEnum.CPU_ATTN.get_path() == plugin.CPU_BACKEND_PATH
    assert AttentionBackendEnum.CPU_ATTN.get_class().get_name() == "CPU_ATTN"


def test_locks_backend_passes_vllm_validation_for_decoder_layers_only():
    from locks_toolkit.kernels.vllm_backend.backend_cuda import LocksBackend
    from vllm.platforms.interface import DeviceCapability

    common = dict(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=PAGE, use_mla=False, has_sink=False,
        use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False, device_capability=DeviceCapability(9, 0),
        use_non_causal=False, use_batch_invariant=False, use_kv_connector=False,
    )
    assert LocksBackend.validate_configuration(attn_type="decoder", **common) == []
    assert LocksBackend.validate_configuration(attn_type="encoder_only", **common) != []
    assert LocksBackend.get_supported_kernel_block_sizes() == [PAGE]


# -- configuration ----------------------------------------------------------------------------
def test_settings_parse_every_key():
    settings = parse_settings({"format": "R4I8", "budget": 1024, "combine": "group_max", "scorer": "quest",
                               "debug_capture_layers": [0, 3]})
    assert settings.locks.summary == SummaryFormat(rank=4, basis_bits=8)
    assert settings.locks.selection.page_budget == 64 and settings.locks.selection.combine == "group_max"
    assert settings.reads_keys and settings.debug_capture_layers == (0, 3)
    assert "budget=1024" in settings.describe() and "r4i8" in settings.describe()
    assert settings.select == "auto" and parse_settings({"select": "chunked"}).select == "chunked"
    assert "select=chunked" in parse_settings({"select": "chunked"}).describe()
    assert settings.scorer_kernel == "cuda" and parse_settings({"scorer_kernel": "pages"}).scorer_kernel == "pages"
    assert "scorer_kernel=pages" in parse_settings({"scorer_kernel": "pages"}).describe()


def test_scorer_kernel_setting_reaches_the_triton_tuning():
    """The backend's `scorer_kernel` picks the score kernel's code path: the Triton ops' tuning carries its
    fields; every other field stays the default's."""
    from dataclasses import replace

    from locks_toolkit.kernels.score.pages import DEFAULT_TUNING, SCORER_KERNELS
    from locks_toolkit.kernels.vllm_backend.kernel_ops import TritonOps

    for name, fields in SCORER_KERNELS.items():
        ops = TritonOps("chunked", name)
        assert ops.tuning == replace(DEFAULT_TUNING, select_path="chunked", **fields)  # the tuning launches use
    assert TritonOps(scorer_kernel="pages").tuning.transposed is False and TritonOps().tuning.transposed
    assert TritonOps().tuning.cuda and not TritonOps(scorer_kernel="transposed").tuning.cuda
    with pytest.raises(ConfigError, match="use one of cuda, transposed, pages"):
        parse_settings({"scorer_kernel": "lean"})  # removed: not offered


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"budgett": 2048}, "unknown key(s) ['budgett']"),
        ({"format": "r8x4"}, "not rNiM or rNfp"),
        ({"format": "r16i4"}, "rank 16"),
        ({"budget": 1000}, "not a multiple of the page size"),
        ({"budget": "2048"}, "budget must be an integer"),
        ({"combine": "mean"}, "combine rule 'mean' unknown"),
        ({"scorer": "moment"}, "not served by the vLLM backend"),
        ({"debug_capture_layers": [-1]}, "debug_capture_layers"),
        ({"select": "two"}, "select 'two' unknown; use one of auto, merge, chunked"),
        ({"pdl": True}, "unknown key(s) ['pdl']"),
        ({"scorer_kernel": "fast"}, "scorer_kernel 'fast' unknown; use one of cuda, transposed, pages"),
        ([1, 2], "must be a dict"),
    ],
)
def test_settings_reject_bad_values_with_a_fix(raw, fragment):
    with pytest.raises(ConfigError) as error:
        parse_settings(raw)
    assert fragment in str(error.value)


def test_settings_are_read_from_vllm_additional_config(model_dir):
    config = make_vllm_config(model_dir, budget=96, scorer="oracle")
    settings = settings_from_vllm_config(config)
    assert settings.locks.selection.budget_tokens == 96 and settings.locks.scorer == "oracle"
    assert settings_from_vllm_config(SimpleNamespace(additional_config={})).locks.scorer == "locks"


# -- metadata builder -------------------------------------------------------------------------
def make_cam(query_lens, seq_lens, block_table, num_actual_tokens=None):
    query_lens_t = torch.tensor(query_lens, dtype=torch.int32)
    qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(query_lens_t, 0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    slots = []
    for row, (q_len, s_len) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s_len - q_len, s_len):
            slots.append(int(block_table[row, pos // PAGE]) * PAGE + pos % PAGE)
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=seq, num_reqs=len(query_lens),
        num_actual_tokens=num_actual_tokens or int(qsl[-1]), max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=block_table, slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=seq.clone(),
    )


def random_block_table(generator, num_rows, width=32, num_blocks=200):
    # Distinct physical blocks, never the null block 0, in a deliberately scrambled order.
    return (torch.randperm(num_blocks - 1, generator=generator)[: num_rows * width] + 1).reshape(num_rows, width).to(torch.int32)


@pytest.mark.parametrize("builder_kind", ["cpu", "cuda_class"])
def test_builder_splits_rows_and_finds_the_pages_that_complete(model_dir, builder_kind):
    from locks_toolkit.kernels.vllm_backend.backend_cpu import LocksCpuBuilder
    from locks_toolkit.kernels.vllm_backend.backend_cuda import LocksBuilder

    config = make_vllm_config(model_dir, budget=64)
    spec = FullAttentionSpec(block_size=PAGE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    builder_cls = LocksCpuBuilder if builder_kind == "cpu" else LocksBuilder
    with set_current_vllm_config(config):
        builder = builder_cls(spec, LAYERS, config, torch.device("cpu"))
    assert builder.reorder_batch_threshold == 1
    table = random_block_table(torch.Generator().manual_seed(7), 5)
    # Every layer registered with its own keys; summary rows poisoned.
    from locks_toolkit.kernels.build.packing import pack_summaries
    from locks_toolkit.kernels.build.reference import build_page_summaries
    from locks_toolkit.kernels.vllm_backend.summary_store import STORE

    layout = builder._locks_layout
    gen = torch.Generator().manual_seed(11)
    caches = {name: torch.randn((200, PAGE, NUM_KV_HEADS, HEAD_DIM), generator=gen) for name in LAYERS}
    rows = {name: torch.full((200, NUM_KV_HEADS, layout.row_bytes), 0xEE, dtype=torch.uint8) for name in LAYERS}
    for name in LAYERS:
        STORE.register(name, caches[name], rows[name])
    # Rows: decode whose previous token completed page 1 (seq 33), decode completing page 2 right now
    # (seq 48: built next step), decode with 5 pages > k=4 (seq 77), padded graph row (query 0, seq 0),
    # then a chunked prefill: context 10 -> 51 tokens.
    query_lens, seq_lens = [1, 1, 1, 0, 41], [33, 48, 77, 0, 51]
    counters.reset()
    metadata = builder.build(0, make_cam(query_lens, seq_lens, table))
    step = metadata.locks
    assert (step.num_decodes, step.num_reqs) == (4, 5)
    block = int(table[0, 1])
    for name in LAYERS:  # page 1 of row 0 was built on every layer, nothing else was written
        keys = caches[name][block].permute(1, 0, 2)[:, None, None]  # [Hkv, 1, 1, 16, d]
        expected = pack_summaries(build_page_summaries(keys, layout.rank), layout.fmt)[:, 0, 0]
        assert torch.equal(rows[name][block], expected)
        assert int((rows[name] != 0xEE).any(dim=(1, 2)).sum()) == 1
    # Pages [10 // 16, 51 // 16) = 0, 1, 2 of the prefill row completed in this step.
    assert step.prefill_summary_blocks.tolist() == [int(table[4, p]) for p in (0, 1, 2)]
    assert step.selected_pages.shape == (4, NUM_KV_HEADS, 4)
    counts = counters.snapshot()
    layers = len(LAYERS)
    assert counts["sparse_decode_rows"] == layers * 1 and counts["dense_fallback_rows"] == layers * 2
    assert counts["prefill_rows"] == layers * 1 and counts["summaries_built"] == layers * (1 + 3)


def test_row_plan_matches_a_row_by_row_count_on_random_batches():
    import random

    from locks_toolkit.kernels.vllm_backend.core import RowPlan

    rng = random.Random(5)
    for _ in range(200):
        decodes, prefills, budget = rng.randint(0, 6), rng.randint(0, 3), rng.choice([2, 4, 64])
        query_lens = [rng.choice([0, 1, 1, 1]) for _ in range(decodes)] + [rng.randint(2, 40) for _ in range(prefills)]
        seq_lens = [0 if q == 0 else rng.choice([rng.randint(q, 2000), 16 * rng.randint(1, 9) + 1]) for q in query_lens]
        if not query_lens:
            continue
        starts = torch.tensor([0] + list(itertools.accumulate(query_lens)), dtype=torch.int32)
        plan = RowPlan.of(starts, torch.tensor(seq_lens, dtype=torch.int32), len(query_lens), budget)
        live = [n for q, n in zip(query_lens[:decodes], seq_lens[:decodes]) if q > 0]
        assert plan.num_decodes == decodes and plan.live_decodes == len(live)
        assert plan.dense == sum(math.ceil(n / PAGE) <= budget for n in live)
        assert plan.completed_before == sum(n > PAGE and (n - 1) % PAGE == 0 for n in live)
        assert plan.query_lens.tolist() == query_lens and plan.seq_lens.tolist() == seq_lens
    # the CPU tensors may be longer than the batch (vLLM's persistent buffers): only num_reqs rows count
    padded = RowPlan.of(torch.tensor([0, 1, 2, 50, 60], dtype=torch.int32), torch.tensor([33, 17, 900, 5], dtype=torch.int32), 2, 4)
    assert (padded.num_decodes, padded.live_decodes, padded.completed_before, padded.dense) == (2, 2, 2, 2)


def test_builder_for_a_sliding_window_group_runs_stock_attention_and_counts_it(model_dir):
    from locks_toolkit.kernels.vllm_backend.backend_cpu import LocksCpuBuilder

    config = make_vllm_config(model_dir)
    spec = SlidingWindowSpec(block_size=PAGE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_DIM, dtype=torch.float32, sliding_window=64)
    with set_current_vllm_config(config):
        builder = LocksCpuBuilder(spec, LAYERS[:1], config, torch.device("cpu"))
    counters.reset()
    step = builder.build(0, make_cam([1, 1], [40, 90], random_block_table(torch.Generator().manual_seed(3), 2))).locks
    assert step.stock_only
    counts = counters.snapshot()
    assert counts["stock_decode_rows"] == 2 and counts["sparse_decode_rows"] == 0
    assert counts["stock_layer_calls"] == counts["sliding_window_calls"] == 1


# -- memory accounting ------------------------------------------------------------------------
def test_summary_fraction_and_exact_workspace_bytes_on_the_meta_device():
    from locks_toolkit.kernels.build.packing import SummaryLayout
    from locks_toolkit.kernels.vllm_backend import memory
    from locks_toolkit.kernels.vllm_backend.kernel_ops import DecodeShape, TritonOps

    layout = SummaryLayout(SummaryFormat.parse("r8i4"), 128)
    assert memory.summary_fraction(layout.row_bytes, 128, 2) == layout.row_bytes / (2 * 16 * 128 * 2)
    shape = DecodeShape(max_seqs=3, num_q_heads=32, num_kv_heads=4, head_dim=128, max_pages=257, page_budget=128)
    workspace = TritonOps().workspace(shape, layout, torch.device("meta"))
    tensors = [t for part in workspace for t in vars(part).values() if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "meta" for t in tensors)
    # The score buffer alone is [S*Hkv, max_pages, next_pow2(G)] fp32; the total must include it.
    assert memory.tensor_bytes(workspace) == sum(t.numel() * t.element_size() for t in tensors)
    assert memory.tensor_bytes(workspace) >= 3 * 4 * 257 * 8 * 4


def test_layers_locks_cannot_serve_are_named_with_a_reason():
    from locks_toolkit.kernels.vllm_backend.core import unsupported_reason

    plain = dict(sliding_window=(-1, -1), attn_type="decoder", alibi_slopes=None, sinks=None, logits_soft_cap=0)
    assert unsupported_reason(SimpleNamespace(**plain)) is None
    assert unsupported_reason(SimpleNamespace(**plain | {"sliding_window": -1})) is None  # CPU_ATTN's "none"
    assert unsupported_reason(SimpleNamespace(**plain | {"sliding_window": (511, 0)})) == "sliding window"
    assert unsupported_reason(SimpleNamespace(**plain | {"logits_soft_cap": 50.0})) == "logit soft-capping"
    assert unsupported_reason(SimpleNamespace(**plain | {"sinks": torch.zeros(4)})) == "attention sinks"
    assert unsupported_reason(SimpleNamespace(**plain | {"attn_type": "encoder_only"})).startswith("attention type")


def test_exact_check_accepts_a_bf16_near_tie_and_rejects_a_real_divergence():
    from locks_toolkit.harness.lab.backend_check import LOGPROB_TOL, compare_exact

    def run(tokens, table):
        return {"tokens": tokens, "logprobs": [{t: SimpleNamespace(logprob=lp) for t, lp in row.items()} for row in table]}

    fa = run([5, 7, 9], [{5: -0.5, 6: -1.5}, {7: -0.70, 8: -0.72}, {9: -0.1}])
    assert compare_exact(fa, run([5, 7, 9], [{5: -0.51}, {7: -0.69}, {9: -0.1}]))["pass"]
    near_tie = compare_exact(fa, run([5, 8, 3], [{5: -0.5}, {8: -0.70}, {3: -0.2}]))
    assert near_tie["pass"] and near_tie["tokens_agree_prefix"] == 1
    assert not compare_exact(fa, run([6, 7, 9], [{6: -0.4}, {7: -0.7}, {9: -0.1}]))["pass"]  # gap 1.0 at step 0
    assert not compare_exact(fa, run([5, 7, 9], [{5: -0.5 - 2 * LOGPROB_TOL}, {7: -0.7}, {9: -0.1}]))["pass"]


def test_backend_check_engines_never_overlap_and_each_is_shut_down(monkeypatch):
    """backend_check's three in-process engines run one at a time: each is shut down (and its memory
    handed back) before the next is made, also when its use raises."""
    from types import SimpleNamespace

    from locks_toolkit.harness.lab import backend_check

    events = []

    def make_engine(model_dir, backend, utilization, max_len, **kwargs):
        name = f"{backend}:{(kwargs.get('locks') or {}).get('scorer', 'dense')}"
        events.append(("make", name))
        core = SimpleNamespace(shutdown=lambda: events.append(("shutdown", name)))
        return SimpleNamespace(name=name, llm_engine=SimpleNamespace(engine_core=core))

    def greedy(llm, ids, steps, logprobs=None, on_first_token=None):
        events.append(("use", llm.name))
        return {"tokens": [1, 2], "logprobs": []}

    monkeypatch.setattr(backend_check, "make_engine", make_engine)
    monkeypatch.setattr(backend_check, "greedy", greedy)
    monkeypatch.setattr(backend_check, "compare_exact", lambda a, b: {"pass": True})
    monkeypatch.setattr(backend_check, "check_oracle_captures", lambda k: {"pass": True, "k": k})
    result = backend_check.run_checks("/nowhere", context=1024)
    assert result["oracle_b2048"] == {"pass": True, "k": backend_check.ORACLE_BUDGET // 16}
    names = ["FLASH_ATTN:dense", "CUSTOM:locks", "CUSTOM:oracle"]
    assert events == [step for name in names for step in (("make", name), ("use", name), ("shutdown", name))]

    events.clear()
    with pytest.raises(RuntimeError, match="boom"):
        backend_check.with_engine("/nowhere", "CUSTOM", 0.1, 2048, lambda llm: (_ for _ in ()).throw(RuntimeError("boom")))
    assert events == [("make", "CUSTOM:dense"), ("shutdown", "CUSTOM:dense")]
