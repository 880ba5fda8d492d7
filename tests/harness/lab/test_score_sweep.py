"""The score sweep's selection audit (top-k of the kernel's own keys) on an interpreted score_select."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.kernels.build.packing import SummaryLayout, pack_summaries
from locks_toolkit.kernels.build.reference import build_page_summaries
from locks_toolkit.kernels.checks import available_devices
from locks_toolkit.kernels.config import PAGE_SIZE, SummaryFormat
from locks_toolkit.kernels.testing import fresh_seed

DEVICES = available_devices() or [pytest.param("none", marks=pytest.mark.skip(reason="needs TRITON_INTERPRET=1 or a GPU"))]


@pytest.mark.parametrize("device", DEVICES)
def test_selection_audit_accepts_the_kernel_and_catches_a_wrong_page(device):
    from locks_toolkit.harness.lab.score_sweep import selection_problems
    from locks_toolkit.kernels import ops

    gen = torch.Generator().manual_seed(fresh_seed())
    seqs, hkv, group, d, k = 2, 2, 4, 64, 6
    seq_len = 16 * 23 + 5
    pages = -(-seq_len // PAGE_SIZE)
    layout = SummaryLayout(SummaryFormat.parse("r8i4"), d)
    keys = torch.randn((seqs, hkv, pages, PAGE_SIZE, d), generator=gen)
    packed = pack_summaries(build_page_summaries(keys, layout.rank), layout.fmt)  # [S, Hkv, P, row]
    rows = packed.permute(0, 2, 1, 3).reshape(seqs * pages, hkv, layout.row_bytes).contiguous().to(device)
    table = torch.arange(seqs * pages, dtype=torch.int32).reshape(seqs, pages).to(device)
    seq_lens = torch.full((seqs,), seq_len, dtype=torch.int32, device=device)
    q = torch.randn((seqs, hkv * group, d), generator=gen).to(device)
    selected = torch.empty((seqs, hkv, k), dtype=torch.int32, device=device)
    ws = ops.score_select_workspace(seqs, hkv, pages, device, group_size=group)
    ops.score_select(q, rows, table, seq_lens, selected, layout, k, d**-0.5, workspace=ws)
    assert selection_problems(selected, ws.keys, seq_len, k) is None
    contested = set(range(1, pages - 1)) - set(selected[1, 0].tolist())
    selected[1, 0, 2] = min(contested)  # a page that was not chosen
    problem = selection_problems(selected, ws.keys, seq_len, k)
    assert problem is not None and "1/4 pairs" in problem


def test_markdown_names_each_variants_selection_path():
    from dataclasses import asdict

    from locks_toolkit.harness.lab.score_sweep import markdown
    from locks_toolkit.kernels.score.pages import ScoreTuning

    def row(tuning):
        return {"tuning": asdict(tuning), "context_tokens": 131072, "batch_size": 1, "status": "ok", "chunks": 128,
                "mean_us": 46.7, "sd_us": 0.2, "select_us": 20.0, "same_selection": True, "selection_problems": None}

    def removed(tuning, **fields):  # a record of a variant the tuning no longer has
        return {**row(tuning), "tuning": {**asdict(tuning), **fields}}

    chunked = ScoreTuning(select_path="chunked")
    table = markdown([row(chunked), row(ScoreTuning(select_path="chunked", coarse_pick=False, select_chunks=16, coef_vector=False)),
                      removed(ScoreTuning(word_nibbles=False), select_path="row"),
                      removed(ScoreTuning(coef_mma=False), select_path="one", tail_block=None),
                      removed(ScoreTuning(), select_path=None, row_select=True),
                      removed(ScoreTuning(coef_vector=False), word_pairs=True, select_path="four"),
                      removed(chunked, select_path="three"),
                      removed(ScoreTuning(), select_path="one", tail_block=4096, select_tail="loops"),
                      removed(ScoreTuning(), select_path="one", select_tail=None, register_select=False),
                      row(ScoreTuning())])
    body = table.splitlines()[2:]
    assert f"| words+vec+mma | 3 launches, ≤ {ScoreTuning().select_chunks} chunks |" in body[0]
    assert "| words+mma | 3 launches, ≤ 16 chunks, full-scan pick |" in body[1]
    assert "| mantissa+vec+mma | row (2 launches) |" in body[2]
    assert f"| words+vec | 1 launch, ≤ {ScoreTuning().select_chunks} chunks, loops tail |" in body[3]
    assert "| words+vec+mma | row (2 launches) |" in body[4]
    assert "| words+pairs+mma | 4 launches," in body[5]  # a record of the removed lean kernel, four launches then
    assert f"| words+vec+mma | 3 launches, ≤ {ScoreTuning().select_chunks} chunks |" in body[6]
    assert "| 1 launch, ≤ 32 chunks, loops tail of 4096 |" in body[7]
    assert "| 1 launch, ≤ 32 chunks, memory tail |" in body[8]
    assert "| words+vec+mma | 1 launch, chunk lists merged |" in body[9]
    assert all("| 46.7 ± 0.2 | 20.0 | — | True (ok) |" in line for line in body)  # rows without a chained time
    chained = markdown([{**row(ScoreTuning()), "chained_us": 61.26}]).splitlines()[2]
    assert "| 46.7 ± 0.2 | 20.0 | 61.3 | True (ok) |" in chained


def test_kernel_profile_averages_each_launch_and_the_table_lists_them():
    from dataclasses import asdict

    from locks_toolkit.harness.lab.score_sweep import markdown, mean_kernel_us
    from locks_toolkit.kernels.score.pages import ScoreTuning

    # two graph replays of a chain of three launches, one of them twice per chain
    seen = [("_keys_kernel", 5.0), ("_gather_kernel", 3.0), ("_keys_kernel", 1.0), ("_keys_kernel", 7.0),
            ("_gather_kernel", 5.0), ("_keys_kernel", 3.0)]
    per_call = mean_kernel_us(seen, calls=2)
    assert list(per_call) == ["_keys_kernel", "_gather_kernel"]
    assert per_call == {"_keys_kernel": 8.0, "_gather_kernel": 4.0}
    row = {"tuning": {**asdict(ScoreTuning(select_path="chunked")), "prefetch": True}, "context_tokens": 131072, "batch_size": 1, "status": "ok",
           "chunks": 512, "mean_us": 20.0, "sd_us": 0.1, "select_us": 12.0, "same_selection": True,
           "selection_problems": None, "kernel_us": per_call}
    table = markdown([row])
    assert "words+vec+mma+prefetch" in table
    assert "| 128k | words+vec+mma+prefetch, 3 launches" in table and "_keys_kernel 8.0, _gather_kernel 4.0 |" in table


def test_pick_names_a_variant_that_does_not_exist(capsys):
    from locks_toolkit.harness.lab.score_sweep import VARIANTS, main

    assert main(["--pick", f"0,{len(VARIANTS)}"]) == 2
    err = capsys.readouterr().err
    assert f"--pick '0,{len(VARIANTS)}' must be comma-separated indices below {len(VARIANTS)}" in err


def test_between_layers_table_shows_the_chain_time_net_of_the_products():
    from dataclasses import asdict

    from locks_toolkit.harness.lab.score_sweep import markdown
    from locks_toolkit.kernels.score.pages import ScoreTuning

    base = {"context_tokens": 131072, "batch_size": 1, "status": "ok", "chunks": 132, "mean_us": 16.0, "sd_us": 0.1,
            "select_us": 18.0, "same_selection": True, "selection_problems": None}
    one = {**base, "tuning": {**asdict(ScoreTuning()), "select_path": "one"}, "mlp_us": 48.3, "in_chain_us": 47.94,
           "chain_kernel_us": {"locks_score_t": 16.1, "_keys_select_kernel": 31.0, "nvjet_sm90_gemv": 48.0}}
    four = {**base, "tuning": asdict(ScoreTuning(select_path="chunked")), "mlp_us": 48.3, "in_chain_us": 36.0, "between": "layer",
            "between_what": "sparse decode + a GLM-4-9B-like decoder layer (ffn 13696)"}
    plain = {**base, "tuning": asdict(ScoreTuning())}
    lines = markdown([one, four, plain]).splitlines()
    chain = [line for line in lines if "(48.3)" in line]
    assert len(chain) == 2  # the row without a chain time has no line there
    assert "1 launch" in chain[0] and "| 47.9 (48.3) |" in chain[0] and "| 36.0 (48.3) |" in chain[1]
    assert "_keys_select_kernel 31.0" in chain[0] and chain[1].endswith("| — |")
    assert "| MLP-sized product |" in chain[0] and "| sparse decode + a GLM-4-9B-like decoder layer (ffn 13696) |" in chain[1]


@pytest.mark.parametrize("kind", ["mlp", "layer"])
def test_between_layers_work_runs_a_decoder_layer_over_the_selected_pages(kind):
    """The engine-like work of `--between-layers layer` (sparse decode over the chain's own selection, then a
    decoder layer's products) runs as written, on the interpreter's CPU device; "mlp" is one product."""
    import os
    from types import SimpleNamespace

    from locks_toolkit.harness.lab.score_sweep import between_layers_work

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the sparse decode kernel needs TRITON_INTERPRET=1 on a CPU machine")
    gen = torch.Generator().manual_seed(7)
    geom = SimpleNamespace(num_q_heads=4, num_kv_heads=2, head_dim=64)
    batch, pages, page = 1, 6, 16
    k = torch.randn((pages, page, 2, 64), generator=gen, dtype=torch.float32).to(torch.bfloat16)
    state = SimpleNamespace(k=[k], v=[k.clone()])
    q = torch.randn((batch, 4, 64), generator=gen).to(torch.bfloat16)
    table = torch.arange(pages, dtype=torch.int32).reshape(1, pages)
    lens = torch.tensor([pages * page - 3], dtype=torch.int32)
    work, what = between_layers_work(kind, geom, batch, q, state, table, lens)
    selected = torch.tensor([[[0, 2, 5], [0, 1, 5]]], dtype=torch.int32)
    out = work(0, selected)
    assert out.shape == ((1, 256 + 2 * 2 * 64) if kind == "layer" else (1, 6 * 256)) and bool(torch.isfinite(out).all())
    assert ("decoder layer" in what) == (kind == "layer") and ("product" in what) == (kind == "mlp")


def test_select_repeats_below_one_is_refused(capsys):
    from locks_toolkit.harness.lab.score_sweep import main

    assert main(["--select-repeats", "0"]) == 2
    assert "--select-repeats must be >= 1, got 0" in capsys.readouterr().err
