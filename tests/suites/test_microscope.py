"""The microscope engine on synthetic captured tensors with hand-checkable answers."""

from __future__ import annotations

import math

import pytest
import torch
from locks_toolkit.kernels.build.reference import build_page_summaries
from locks_toolkit.kernels.config import SummaryFormat
from locks_toolkit.kernels.decode.reference import attend_pages
from locks_toolkit.kernels.testing import fresh_seed, generator, low_rank_keys
from locks_toolkit.suites.microscope import (
    Arm,
    CapturedRecord,
    capture_output_error,
    evaluate_record,
    page_view,
    parse_arms,
    summarize,
)
from locks_toolkit.suites.microscope_audit import audit_scores

DEFAULT_ARMS = parse_arms(["oracle", "locks", "quest", "centroid"], ["r8i4", "r8fp"])


def _record(queries, keys, values, seq_lens, carrier=(), layers=None) -> CapturedRecord:
    return CapturedRecord(
        record_id="synthetic",
        layers=tuple(layers or range(queries.shape[0])),
        queries=queries,
        keys=keys,
        values=values,
        seq_lens=torch.as_tensor(seq_lens),
        carrier_pages=tuple(carrier),
    )


def _random_record(seed: int, layers=2, steps=3, kv_heads=1, group=4, dim=64, tokens=16 * 23 + 5, carrier=(9,)):
    gen = generator(seed)
    queries = torch.randn(layers, steps, kv_heads, group, dim, generator=gen)
    keys = torch.randn(layers, kv_heads, tokens, dim, generator=gen) + 2 * torch.randn(dim, generator=gen)
    values = torch.randn(layers, kv_heads, tokens, dim, generator=gen)
    seq_lens = torch.arange(tokens - steps + 1, tokens + 1)
    return _record(queries, keys, values, seq_lens, carrier)


def _cells(cells, label, budget):
    return [c for c in cells if c.arm.label == label and c.budget_tokens == budget]


def test_uniform_attention_gives_hand_computed_gamma():
    # q = 0: every logit is 0, attention is uniform over tokens, all pages tie and ties go to low ids.
    dim, tokens = 8, 150  # 10 pages, the last one holds 6 tokens
    record = _record(torch.zeros(1, 1, 1, 2, dim), torch.randn(1, 1, tokens, dim), torch.randn(1, 1, tokens, dim), [tokens])
    (cell,) = evaluate_record(record, [Arm("oracle")], [64], scale=1.0)  # k = 4: sink, recent, pages 1 and 2
    assert torch.allclose(cell.gamma, torch.full_like(cell.gamma, (16 * 3 + 6) / 150))
    assert torch.allclose(cell.gamma_c, torch.full_like(cell.gamma_c, 2 / 8))  # 2 of 8 contested pages
    assert torch.all(cell.recall == 1)


def _two_candidate_record():
    """Page A: every key has logit 1 (centroid logit 1). Page B: one key at logit 5, the rest at -1/3
    (centroid logit 0). Exact LSE ranks B first (5.07 > 1 + log 16 = 3.77); centroid ranks A first."""
    dim = 4
    e0 = torch.eye(dim)[0]
    sink = torch.zeros(16, dim)
    page_a = e0.expand(16, dim).clone()
    page_b = torch.cat([5 * e0[None], -(5 / 15) * e0.expand(15, dim)])
    low = -10 * e0.expand(16, dim)
    recent = torch.zeros(1, dim)
    keys = torch.cat([sink, page_a, page_b, low, recent])[None, None]  # [L, Hkv, 65, d]
    values = torch.randn_like(keys)
    queries = e0.view(1, 1, 1, 1, dim)
    return _record(queries, keys, values, [65], carrier=(2,))


def test_recall_and_needle_retention_against_the_exact_ranking():
    record = _two_candidate_record()
    arms = parse_arms(["oracle", "centroid", "quest", "locks"], ["r8fp"])
    cells = evaluate_record(record, arms, [48], scale=1.0)  # k = 3: sink, recent, one contested page
    by_label = {c.arm.label: c for c in cells}
    assert by_label["oracle"].recall.item() == 1.0
    assert by_label["centroid"].recall.item() == pytest.approx(2 / 3)
    assert by_label["quest"].recall.item() == 1.0  # the envelope sees B's outlier key
    assert by_label["locks r8fp"].recall.item() == 1.0  # rank-1 pages: exact reconstruction
    assert summarize([by_label["oracle"]])["needle_retention"] == 1.0
    assert summarize([by_label["centroid"]])["needle_retention"] == 0.0
    # Centroid's estimate of B is its centroid logit + log B; the exact LSE is computed by hand.
    exact_b = math.log(math.exp(5) + 15 * math.exp(-5 / 15))
    assert by_label["centroid"].score_abs_err.max().item() >= abs(0 + math.log(16) - exact_b) - 1e-9


def test_planted_needle_page_is_kept_by_oracle_and_locks():
    seed = fresh_seed()
    gen = generator(seed)
    dim, tokens, needle = 64, 16 * 40 + 3, 17
    # The heads' queries share a direction and the needle page's keys point along it, so the
    # page dominates the exact ranking of every head at both steps.
    direction = torch.randn(dim, generator=gen)
    direction = direction / direction.norm()
    queries = 8 * direction + 0.5 * torch.randn(1, 2, 1, 4, dim, generator=gen)
    keys = 0.3 * torch.randn(1, 1, tokens, dim, generator=gen)
    keys[0, 0, needle * 16 : needle * 16 + 16] += 3 * direction
    record = _record(queries, keys, torch.randn_like(keys), [tokens - 1, tokens], carrier=(needle,))
    cells = evaluate_record(record, DEFAULT_ARMS, [64], scale=dim**-0.5)
    for label in ("oracle", "locks r8fp", "locks r8i4"):
        (cell,) = _cells(cells, label, 64)
        assert cell.carrier_eligible.sum() == 2, f"seed {seed}: the exact ranking must keep the planted page"
        assert cell.carrier_kept.sum() == 2, f"seed {seed}: {label} dropped the planted page"


def test_dense_fallback_when_budget_covers_every_page():
    record = _random_record(fresh_seed(), tokens=16 * 7 + 9)  # 8 pages <= k = 16
    cells = evaluate_record(record, DEFAULT_ARMS, [256], scale=0.125)
    for cell in cells:
        assert torch.allclose(cell.gamma, torch.ones_like(cell.gamma)), cell.arm.label
        assert torch.allclose(cell.gamma_c, torch.ones_like(cell.gamma_c)), cell.arm.label
        assert torch.all(cell.recall == 1)


def test_oracle_is_exact_and_every_selection_audit_passes():
    seed = fresh_seed()
    record = _random_record(seed)
    cells = evaluate_record(record, DEFAULT_ARMS, [64, 128], scale=0.125)
    assert len(cells) == len(DEFAULT_ARMS) * 2 * 2  # arms x budgets x layers
    for cell in cells:
        audits = cell.audits.to_json()
        for name in ("identity", "output_bound", "coverage_retention", "oracle_optimal"):
            assert audits[name]["checked"] > 0 and audits[name]["violated"] == 0, f"seed {seed}: {cell.arm.label} {name}"
    oracle = summarize(_cells(cells, "oracle", 64))
    assert oracle["score_err_max"] < 1e-12 and oracle["share_log_err"] < 1e-12 and oracle["recall"] == 1.0
    fp = summarize(_cells(cells, "locks r8fp", 64))
    for name in ("score_bound", "score_bound_loose", "outlier_capture"):
        assert fp["audits"][name]["checked"] > 0 and fp["audits"][name]["violated"] == 0, f"seed {seed}: {name}"
    assert "score_bound" not in summarize(_cells(cells, "locks r8i4", 64))["audits"]  # no spectrum after packing
    assert summarize(_cells(cells, "quest", 64))["audits"]["envelope"]["violated"] == 0
    # Shared metrics (scores) do not depend on the budget; selections do.
    assert summarize(_cells(cells, "centroid", 64))["score_err_p95"] == summarize(_cells(cells, "centroid", 128))["score_err_p95"]
    assert summarize(_cells(cells, "oracle", 128))["gamma"] >= summarize(_cells(cells, "oracle", 64))["gamma"]


def test_score_bound_audit_flags_an_error_above_the_bound():
    gen = generator(fresh_seed())
    keys = torch.randn(1, 5, 16, 32, generator=gen, dtype=torch.float64)
    q = torch.randn(1, 3, 32, generator=gen, dtype=torch.float64)
    summaries = build_page_summaries(keys, 4)
    arm, estimated = Arm("locks", SummaryFormat.parse("r4fp")), torch.zeros(1, 3, 5)  # scores are not audited here
    honest = audit_scores(arm, summaries, q, keys, estimated, torch.zeros(1, 3, 5), 0.2)
    assert honest.violated["score_bound"] == 0
    inflated = audit_scores(arm, summaries, q, keys, estimated, torch.full((1, 3, 5), 1e3), 0.2)
    assert inflated.violated["score_bound"] == 15


def test_envelope_audit_checks_the_envelope_the_selector_scored_with():
    """A Quest scorer that takes min where the envelope takes max scores below the page's logits; the audit
    must see it, which a rebuild of the envelope from the keys never would."""
    from locks_toolkit.kernels.score.selectors import envelope_scores

    gen = generator(fresh_seed())
    keys = torch.randn(1, 5, 16, 32, generator=gen, dtype=torch.float64)
    q = torch.randn(1, 3, 32, generator=gen, dtype=torch.float64)
    arm, upper, lower = Arm("quest", None), keys.amax(-2), keys.amin(-2)
    errors = torch.zeros(1, 3, 5)
    right = audit_scores(arm, (upper, lower), q, keys, envelope_scores(q, upper, lower, 0.2), errors, 0.2)
    assert right.checked["envelope"] == 15 and right.violated["envelope"] == 0
    wrong = torch.minimum(q.unsqueeze(-2) * upper.unsqueeze(-3), q.unsqueeze(-2) * lower.unsqueeze(-3)).sum(-1) * 0.2
    swapped = audit_scores(arm, (upper, lower), q, keys, wrong, errors, 0.2)
    assert swapped.violated["envelope"] == 15  # sum_c min(q_c u_c, q_c l_c) bounds every logit from below


def test_captured_energy_is_one_for_low_rank_pages_and_zero_for_centroids():
    gen = generator(fresh_seed())
    pages, dim = 12, 32
    keys = low_rank_keys(gen, (1, pages, 16, dim), page_rank=3, dtype=torch.float64).reshape(1, 1, pages * 16, dim)
    keys = torch.cat([keys, torch.randn(1, 1, 4, dim, dtype=torch.float64)], dim=2).float()  # + a partial page
    record = _record(torch.randn(1, 1, 1, 2, dim, generator=gen), keys, torch.randn_like(keys), [keys.shape[2]])
    cells = evaluate_record(record, DEFAULT_ARMS, [64], scale=dim**-0.5)
    energy = {c.arm.label: summarize([c])["captured_energy"] for c in cells}
    assert energy["locks r8fp"] == pytest.approx(1.0, abs=1e-6)
    assert energy["oracle"] == 1.0
    assert energy["centroid"] == pytest.approx(0.0, abs=1e-12)
    assert energy["quest"] is None
    assert 0.9 < energy["locks r8i4"] < 1.0
    assert summarize(_cells(cells, "locks r8fp", 64))["score_err_max"] < 1e-4  # r >= rank: exact scores


def test_capture_check_detects_a_wrong_scale():
    record = _random_record(fresh_seed(), layers=1, steps=2)
    outputs = []
    for t, seq_len in enumerate(record.seq_lens.tolist()):
        keys, values = page_view(record.keys[0], seq_len), page_view(record.values[0], seq_len)
        counts = torch.full((keys.shape[1],), 16)
        counts[-1] = seq_len - 16 * (keys.shape[1] - 1)
        out, _ = attend_pages(record.queries[0, t].double(), keys, values, 0.125, token_counts=counts)
        outputs.append(out.float())
    with_outputs = CapturedRecord(**{**record.__dict__, "outputs": torch.stack(outputs)[None]})
    assert capture_output_error(with_outputs, 0.125) < 1e-5
    assert capture_output_error(with_outputs, 0.25) > 1e-2


def test_parse_arms_expands_formats_and_rejects_unknown_names():
    arms = parse_arms(["oracle", "locks", "locks:r4i8", "quest"], ["r8i4", "r8fp"])
    assert [a.label for a in arms] == ["oracle", "locks r8i4", "locks r8fp", "locks r4i8", "quest"]
    with pytest.raises(ValueError, match="unknown arm 'nope'"):
        parse_arms(["nope"], ["r8i4"])
    with pytest.raises(ValueError, match="selects no pages"):
        parse_arms(["fullkv"], ["r8i4"])
    with pytest.raises(ValueError, match="takes no summary format"):
        parse_arms(["quest:r8i4"], [])
    with pytest.raises(ValueError, match="repeat"):
        parse_arms(["locks", "locks:r8i4"], ["r8i4"])
    with pytest.raises(ValueError):
        parse_arms(["locks"], ["r8x4"])


def test_summary_pools_needle_counts_and_reports_none_without_eligible_pages():
    record = _random_record(fresh_seed(), carrier=())
    cells = evaluate_record(record, [Arm("oracle")], [64], scale=0.125)
    summary = summarize(cells)
    assert summary["needle_retention"] is None and summary["needle_eligible"] == 0
    assert summary["samples"] == sum(c.gamma.numel() for c in cells)


def test_geometry_comes_from_the_config_not_from_constants():
    from types import SimpleNamespace

    from locks_toolkit.suites.models import geometry_from_config

    kinds = ["sliding_attention"] * 7
    kinds[2] = kinds[6] = "full_attention"
    config = SimpleNamespace(
        layer_types=kinds, num_hidden_layers=7, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
        hidden_size=640, query_pre_attn_scalar=144, attn_logit_softcapping=None, sliding_window=512,
    )
    geometry = geometry_from_config(config)
    assert geometry.global_layers == (2, 6) and geometry.group_size == 4
    assert geometry.scale == pytest.approx(1 / 12) and geometry.softcap is None
    no_scalar = geometry_from_config(SimpleNamespace(**{**config.__dict__, "query_pre_attn_scalar": None}))
    assert no_scalar.scale == pytest.approx(128**-0.5)
    with pytest.raises(ValueError, match="no full-attention layer"):
        geometry_from_config(SimpleNamespace(**{**config.__dict__, "layer_types": ["sliding_attention"] * 7}))
