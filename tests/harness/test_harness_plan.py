"""Plans (YAML + overrides, validation that names the fix), presets, arms and the bytes model."""

import json
import re

import pytest
from locks_toolkit.harness.arms import ARMS, SparseKnobs, get_arm
from locks_toolkit.harness.plan import DecodePlan, default_plan_path, load_plan
from locks_toolkit.harness.presets import (
    ModelGeometry,
    build_config,
    load_preset_config,
    materialize_model,
    preset_names,
)
from locks_toolkit.harness.traffic import (
    dense_bytes_per_step,
    floor_ms,
    locks_bytes_per_step,
    row_bytes_formula,
    step_stats,
    summary_row_bytes,
)
from locks_toolkit.kernels.config import ConfigError, SummaryFormat
from locks_toolkit.kernels.vllm_backend.settings import parse_settings


def test_default_plan_is_the_protocol():
    plan = load_plan()
    assert plan.hbm_bytes_per_s is None  # byte floors use the copy bandwidth each engine measures at boot
    assert (plan.windows, plan.steps_per_window, plan.ttft_repeats) == (3, 64, 3)
    assert plan.arms == ("fa3", "flashinfer", "locks") and plan.graph_mode == "full_decode_only" and plan.async_scheduling is False
    assert plan.contexts == (16384, 32768, 65536, 131072)
    assert plan.effective_max_model_len >= 131072 + plan.decode_tokens_per_request
    assert plan.effective_max_model_len % 16 == 0


def test_a_pinned_copy_bandwidth_is_coerced_and_a_bad_one_names_the_fix(tmp_path):
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text("hbm_bytes_per_s: 3.03e12\n")  # YAML 1.1 reads this as a string
    assert load_plan(plan_file).hbm_bytes_per_s == 3.03e12
    for bad in ("fast", "-1", "0"):
        plan_file.write_text(f"hbm_bytes_per_s: {bad}\n")
        with pytest.raises(ConfigError, match="positive rate in bytes/s.*null to measure"):
            load_plan(plan_file)


def test_overrides_take_sizes_and_comma_lists():
    plan = load_plan(None, {"arms": "fa3,flashinfer", "contexts": "16k,32k,128k", "num_layers": 40,
                            "batch_sizes": "1,4", "budgets": "1k,2048", "output": "x.jsonl", "windows": None})
    assert plan.contexts == (16384, 32768, 131072)
    assert plan.batch_sizes == (1, 4) and plan.budgets == (1024, 2048) and plan.num_layers == 40
    assert plan.windows == 3  # None means "not given"


def test_yaml_plan_file(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text("model: llama-3.1-8b\narms: [fa3]\ncontexts: [8k]\nmax_model_len: 10k\nbatch_sizes: [2, 1]\n")
    plan = load_plan(path, {"seed": 7})
    assert (plan.model, plan.contexts, plan.max_model_len, plan.batch_sizes, plan.seed) == (
        "llama-3.1-8b", (8192,), 10240, (2, 1), 7)


@pytest.mark.parametrize("overrides,message", [
    ({"contexts": "300k", "max_model_len": 262144}, "exceeds max_model_len 262144; pass --max-model-len"),
    ({"budgets": "2000,2001"}, "not a multiple of the page size 16; pass e.g. 2016"),
    ({"arms": "fa3,fa4"}, "arm 'fa4' unknown; use one of"),
    ({"arms": "fa3,fa3"}, "repeat"),
    ({"graph_mode": "piecewise"}, "graph mode 'piecewise' unknown"),
    ({"model": "no-such-model"}, "neither a preset"),
    ({"gpu_memory_utilization": 1.5}, "must be in (0, 1]"),
    ({"windows": 0}, "windows is 0"),
    ({"summary_format": "r8i3"}, "not rNiM"),
    ({"batch_sizes": "0"}, "must be positive"),
    ({"windows": "three"}, "windows = 'three' is not a int"),
    ({"require_nvml": "yes"}, "require_nvml = 'yes' is not a bool"),
])
def test_validation_names_the_fix(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_plan(None, overrides)
    assert message in str(info.value)


def test_model_dir_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        load_plan(None, {"model": str(tmp_path)})
    (tmp_path / "config.json").write_text(json.dumps(load_preset_config("tiny-llama")))
    assert load_plan(None, {"model": str(tmp_path), "contexts": "1k"}).model == str(tmp_path)
    with pytest.raises(ConfigError, match="presets only"):
        load_plan(None, {"model": str(tmp_path), "contexts": "1k", "num_layers": 2})


def test_unknown_yaml_knob(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("contexts: [1k]\nstep_per_window: 8\n")
    with pytest.raises(ConfigError, match="unknown knob.*step_per_window"):
        load_plan(path)
    with pytest.raises(ConfigError, match="not found"):
        load_plan(tmp_path / "missing.yaml")


def test_packaged_plans_load():
    for plan_file in default_plan_path().parent.iterdir():
        if plan_file.name.endswith(".yaml"):
            assert isinstance(load_plan(plan_file), DecodePlan)


def test_presets_have_the_published_geometry():
    expected = {"glm-4-9b-chat-1m": (40, 32, 4, 128), "llama-3.1-8b": (32, 32, 8, 128),
                "qwen3-4b": (36, 32, 8, 128), "tiny-llama": (2, 4, 2, 64)}
    assert set(expected) <= set(preset_names())
    for name, geometry in expected.items():
        g = ModelGeometry.from_config(load_preset_config(name))
        assert (g.num_layers, g.num_q_heads, g.num_kv_heads, g.head_dim) == geometry


def test_build_and_materialize_config(tmp_path):
    config, changes = build_config("qwen3-4b", num_layers=8, max_model_len=131072 + 272)
    assert config["num_hidden_layers"] == 8 and config["max_position_embeddings"] == 131344
    assert changes == {"num_hidden_layers": {"preset": 36, "used": 8},
                       "max_position_embeddings": {"preset": 40960, "used": 131344}}
    folder = materialize_model(config, tmp_path)
    assert json.loads((folder / "config.json").read_text()) == config
    assert materialize_model(config, tmp_path) == folder  # content-addressed: same config, same dir
    other, _ = build_config("qwen3-4b", num_layers=9, max_model_len=1024)
    assert materialize_model(other, tmp_path) != folder


def test_arms_come_from_the_registry():
    assert {"fa3", "flashinfer", "locks", "locks-kv", "cpu"} <= set(ARMS)
    assert get_arm("fa3").engine_kwargs(None) == {"attention_config": {"backend": "FLASH_ATTN"}, "block_size": 16}
    locks = get_arm("locks").engine_kwargs(SparseKnobs(2048, "r8i4", "locks", "share_average"))
    assert locks["attention_config"] == {"backend": "CUSTOM"}
    assert locks["additional_config"] == {"locks": {"budget": 2048, "format": "r8i4", "scorer": "locks",
                                                    "combine": "share_average"}}
    # locks[select=chunked]: the same backend and knobs, with the three-launch selection kernels; the backend accepts it
    chunked = get_arm("locks[select=chunked]").engine_kwargs(SparseKnobs(2048, "r8i4", "locks", "share_average"))
    assert chunked["additional_config"]["locks"] == {**locks["additional_config"]["locks"], "select": "chunked"}
    assert parse_settings(chunked["additional_config"]["locks"]).select == "chunked"
    pages = get_arm("locks[scorer_kernel=pages]").engine_kwargs(SparseKnobs(1024, "r4i8", "locks", "group_max"))
    assert pages["additional_config"]["locks"] == {"budget": 1024, "format": "r4i8", "scorer": "locks", "combine": "group_max",
                                                   "scorer_kernel": "pages"}
    both = parse_settings(get_arm("locks[select=chunked, scorer_kernel=PAGES]").engine_kwargs(SparseKnobs(2048))["additional_config"]["locks"])
    assert both.scorer_kernel == "pages" and both.select == "chunked" and both.locks.selection.page_budget == 128
    for kernel in ("pages", "cuda", "transposed"):  # other scorers, same pages
        arm = get_arm(f"locks[scorer_kernel={kernel}]")
        other = parse_settings(arm.engine_kwargs(SparseKnobs(2048))["additional_config"]["locks"])
        assert other.scorer_kernel == kernel and other.select == "auto"
        assert arm.sparse and arm.counters == get_arm("locks").counters and kernel in arm.description
    cpu_one = get_arm("locks-cpu[select=chunked]")
    assert cpu_one.device == "cpu" and cpu_one.environment(SparseKnobs(1024), None)["LOCKS_VLLM_CPU"] == "1"
    peer = get_arm("locks-kv")
    assert peer.plugin_distribution == "locks-kv"
    assert peer.engine_kwargs(SparseKnobs(2048))["attention_config"] == {"backend": "FLASH_ATTN"}
    # The peer's budget_pages excludes its sink and recent page: b=2048 and b=2040 both attend k=128 pages.
    for budget in (2048, 2040):
        peer_config = json.loads(peer.environment(SparseKnobs(budget), None)["LOCKS_CONFIG"])
        assert peer_config == {"variant": "fast", "budget_pages": 126, "sink_pages": 1, "window_pages": 1}
    assert peer.environment(SparseKnobs(1024), '{"x": 1}') == {"LOCKS_CONFIG": '{"x": 1}', "VLLM_PLUGINS": "locks"}
    # each engine loads only its arm's plugin: the peer's never sits in the FA3 / FlashInfer / Locks engines
    for name in ("fa3", "flashinfer", "locks", "locks[select=chunked]", "locks[scorer_kernel=pages]", "cpu", "locks-cpu"):
        assert get_arm(name).environment(SparseKnobs(1024), None)["VLLM_PLUGINS"] == "locks_toolkit"
    with pytest.raises(ConfigError, match="unknown"):
        get_arm("sdpa")


@pytest.mark.parametrize("name, message", [
    ("locks[select=three]", "select='three' unknown; use one of auto, merge, chunked"),
    ("locks[scorer_kernel=lean]", "scorer_kernel='lean' unknown; use one of cuda, transposed, pages"),
    ("locks[pdl=true]", "'pdl=true' is not KEY=VALUE with KEY one of select, scorer_kernel"),
    ("locks[budget=64]", "'budget=64' is not KEY=VALUE with KEY one of select, scorer_kernel"),
    ("locks[select]", "'select' is not KEY=VALUE"),
    ("locks[select=merge,select=chunked]", "sets select twice"),
    ("locks[]", "sets nothing"),
    ("fa3[select=chunked]", "is not of the form locks[select=chunked,scorer_kernel=pages]"),
    ("locks[select=chunked", "is not of the form"),
])
def test_a_parametric_arm_names_what_is_wrong(name, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        get_arm(name)


def test_arm_lists_keep_commas_inside_brackets():
    from locks_toolkit.harness.arms import split_arm_list

    assert split_arm_list("fa3, locks[select=chunked,scorer_kernel=pages],flashinfer") == [
        "fa3", "locks[select=chunked,scorer_kernel=pages]", "flashinfer"]
    from locks_toolkit.harness.plan import _coerce

    plan = DecodePlan(arms=_coerce("arms", "fa3,locks[select=chunked,scorer_kernel=pages]"))
    assert plan.arms == ("fa3", "locks[select=chunked,scorer_kernel=pages]")


def test_dense_bytes_match_a_hand_count():
    glm = ModelGeometry.from_config(load_preset_config("glm-4-9b-chat-1m"))
    assert glm.kv_bytes_per_token == 2 * 40 * 4 * 128 * 2
    assert dense_bytes_per_step(glm, [131072, 1000]) == 132072 * 81920
    assert floor_ms(4.23e12, 4.23e12) == pytest.approx(1000.0)


def test_locks_bytes_read_summaries_plus_the_budget():
    glm = ModelGeometry.from_config(load_preset_config("glm-4-9b-chat-1m"))
    fmt = SummaryFormat.parse("r8i4")
    row = summary_row_bytes(fmt, 128)
    assert row % 64 == 0 and row >= 768  # r8i4 payload is 768 B (locks.md 1.4) plus scales
    tokens = 131072 + 37
    parts = locks_bytes_per_step(glm, [tokens], 2048, fmt)
    heads = 40 * 4
    assert parts["summary_bytes"] == (tokens // 16) * row * heads
    assert parts["selected_kv_bytes"] == 128 * (2 * 16 * 128 * 2) * heads
    assert parts["total"] < dense_bytes_per_step(glm, [tokens]) / 5
    short = locks_bytes_per_step(glm, [1000], 2048, fmt)  # fewer pages than the budget: all of them
    assert short["selected_kv_bytes"] == 63 * (2 * 16 * 128 * 2) * heads


@pytest.mark.parametrize("name", ["r8i4", "r8i8", "r4i4", "r2i8", "r8fp", "r3i4"])
@pytest.mark.parametrize("head_dim", [64, 128, 96])
def test_row_bytes_formula_matches_the_packing_layout(name, head_dim):
    from locks_toolkit.kernels.build import packing
    fmt = SummaryFormat.parse(name)
    assert row_bytes_formula(fmt, head_dim) == packing.SummaryLayout(fmt, head_dim).row_bytes


def test_step_stats():
    stats = step_stats([1.0, 2.0, 3.0, 4.0], batch=2)
    assert stats["n"] == 4 and stats["mean"] == 2.5 and stats["p50"] == 2.5
    assert stats["sd"] == pytest.approx(1.2909944, rel=1e-6)
    assert stats["tokens_per_s"] == pytest.approx(800.0)
    assert step_stats([], batch=1) == {"n": 0}


def test_a_context_past_the_models_trained_positions_is_refused_unless_a_preset_opts_in(tmp_path):
    """1M + decode room passes GLM-4-9B-Chat-1M's 1048576 positions: refused with the fix; with the opt-in the
    plan runs and every cell says so. A model dir (real weights) cannot opt in."""
    from locks_toolkit.harness.runner import plan_cells

    with pytest.raises(ConfigError, match=r"context 1m needs max_model_len 1049040 .* beyond the 1048576 positions "
                                          r"glm-4-9b-chat-1m was trained for; pass --extend-positions"):
        load_plan(None, {"arms": "fa3", "contexts": "1m"})
    plan = load_plan(None, {"arms": "fa3", "contexts": "512k,1m", "extend_positions": True})
    assert all(c["positions_extended"] for g in plan_cells(plan) for c in g.cells.values())
    assert "positions_extended" not in next(iter(plan_cells(load_plan(None, {"arms": "fa3"}))[0].cells.values()))
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    with pytest.raises(ConfigError, match="pass contexts up to 3838 tokens"):
        load_plan(None, {"model": str(tmp_path), "arms": "fa3", "contexts": "4k"})
    with pytest.raises(ConfigError, match="presets \\(dummy weights\\) only"):
        load_plan(None, {"model": str(tmp_path), "arms": "fa3", "contexts": "1k", "extend_positions": True})


def test_batch_prefill_mode_is_checked_and_sizes_the_engine_for_the_survivors():
    with pytest.raises(ConfigError, match="batch_prefill 'shared' unknown; use one of per_batch, once"):
        load_plan(None, {"batch_prefill": "shared"})
    per_batch = load_plan(None, {"contexts": "32k", "batch_sizes": "1,2,4"})
    once = load_plan(None, {"contexts": "32k", "batch_sizes": "1,2,4", "batch_prefill": "once"})
    # the batch-1 survivor decodes through three cells; per_batch requests through one
    assert once.decode_tokens_for(32768) == 3 * once.cell_decode_steps + 2
    assert once.decode_tokens_held(32768, 2, 1) == 3 * once.cell_decode_steps + 2
    # a cell's first request also decodes a token a step while the others' prefill chunks run: 31 x 32K tokens
    # in chunks of 2048 are 496 steps, more than a cell's decode, so the largest batch sets the room
    wide = load_plan(None, {"contexts": "32k", "batch_sizes": "1,32", "batch_prefill": "once", "max_num_batched_tokens": 2048})
    assert wide.decode_tokens_held(32768, 0, 32) == wide.cell_decode_steps + 2 + 496 + 1
    assert wide.decode_tokens_for(32768) == wide.decode_tokens_held(32768, 0, 32) > wide.decode_tokens_held(32768, 1, 1)
    assert per_batch.decode_tokens_for(32768) == max(per_batch.ramp_max_steps, per_batch.cell_decode_steps) + 2
    assert once.max_model_len_for(32768) > per_batch.max_model_len_for(32768)


def test_a_parametric_arm_gives_plain_file_names():
    from locks_toolkit.harness.arms import arm_file_stem

    assert arm_file_stem("locks[select=chunked,scorer_kernel=pages]") == "locks-select-chunked-scorer_kernel-pages"
    assert arm_file_stem("locks-cpu") == "locks-cpu"


def test_prefill_attention_skip_is_refused_where_the_harness_cannot_check_it(tmp_path):
    with pytest.raises(ConfigError, match="prefill_attention 'none' unknown; use one of exact, skip"):
        load_plan(None, {"prefill_attention": "none"})
    with pytest.raises(ConfigError, match="arms locks-kv prefill in their own kernels.*--prefill-attention exact"):
        load_plan(None, {"prefill_attention": "skip", "arms": "flashinfer,locks,locks-kv"})
    with pytest.raises(ConfigError, match="tensor parallel 1.*drop --tp"):
        load_plan(None, {"prefill_attention": "skip", "tensor_parallel_size": 2})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}')
    with pytest.raises(ConfigError, match="for presets \\(dummy weights\\).*drop --prefill-attention skip"):
        load_plan(None, {"prefill_attention": "skip", "model": str(model), "contexts": "1k"})
    plan = load_plan(None, {"prefill_attention": "skip", "arms": "fa3,flashinfer,locks"})
    assert plan.prefill_attention == "skip" and load_plan(None).prefill_attention == "exact"
