"""The capture checks (kernels/vllm_backend/capture_check.py) on synthetic captures built on the CPU.

A capture is what debug.record keeps per decode step: q, block table, seq_lens, selected pages, the
kernel's output and the paged KV cache. The checks must pass on a correct capture and fail on a wrong
output of one head, a selection without its sink or recent page, a duplicate or an out-of-range page.
"""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.kernels.decode.reference import paged_decode_reference
from locks_toolkit.kernels.score.reference import exact_page_scores
from locks_toolkit.kernels.select.reference import combine_group, select_pages
from locks_toolkit.kernels.vllm_backend import capture_check as cc
from locks_toolkit.kernels.vllm_backend import debug

PAGE = 16
SEQ_LENS = (213, 77, 30)  # 14 and 5 pages (sparse at k=4), 2 pages (dense fallback)
BUDGET = 4


def make_capture(generator, group: int, num_kv_heads: int = 3, d: int = 19, layer: int = 0, oracle: bool = False) -> dict:
    """A correct capture: random cache and q, a valid selection (oracle or random scores), bf16-rounded output."""
    max_pages = max(-(-n // PAGE) for n in SEQ_LENS) + 3
    num_blocks = len(SEQ_LENS) * max_pages + 5
    k_cache = torch.randn(num_blocks, PAGE, num_kv_heads, d, generator=generator)
    v_cache = torch.randn(num_blocks, PAGE, num_kv_heads, d, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[: len(SEQ_LENS) * max_pages].reshape(len(SEQ_LENS), max_pages)
    q = torch.randn(len(SEQ_LENS), num_kv_heads * group, d, generator=generator)
    scale = d**-0.5
    selected = torch.full((len(SEQ_LENS), num_kv_heads, BUDGET), -1, dtype=torch.int32)
    for row, length in enumerate(SEQ_LENS):
        num_pages, full = -(-length // PAGE), (length - 1) // PAGE
        scores = torch.full((num_kv_heads, group, num_pages), float("-inf"))
        if oracle:
            keys = k_cache[table[row, :full]].permute(2, 0, 1, 3)
            scores[..., :full] = exact_page_scores(q[row].reshape(num_kv_heads, group, d), keys, scale)
        else:
            scores[..., :full] = torch.randn(num_kv_heads, group, full, generator=generator)
        mask = (torch.arange(num_pages) < full).expand(num_kv_heads, num_pages)
        selected[row] = select_pages(combine_group(scores, "share_average", mask), num_pages, BUDGET)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    cap = {"layer": f"model.layers.{layer}.self_attn.attn", "q": q, "block_table": table.to(torch.int32),
           "seq_lens": seq_lens, "selected_pages": selected, "k_cache": k_cache, "v_cache": v_cache, "scale": scale}
    return with_kernel_output(cap)


def with_kernel_output(cap: dict) -> dict:
    """The capture with `out` = attention over its selected pages, rounded to bf16 like the GPU kernel's."""
    ref = paged_decode_reference(cap["q"], cap["k_cache"], cap["v_cache"], cap["block_table"], cap["seq_lens"],
                                 cap["scale"], cap["selected_pages"].long())
    return {**cap, "out": ref.to(torch.bfloat16).float()}


def edited_selection(cap: dict, row: int, head: int, edit) -> dict:
    """The capture with one (row, KV head)'s page list replaced by edit(list), output recomputed to match it."""
    selected = cap["selected_pages"].clone()
    selected[row, head] = torch.tensor(edit(selected[row, head].tolist()), dtype=torch.int32)
    return with_kernel_output({**cap, "selected_pages": selected})


@pytest.mark.parametrize("group", [1, 4])
def test_rank_check_passes_a_correct_capture_and_fails_a_wrong_head(group):
    generator = torch.Generator().manual_seed(100 + group)
    caps = [make_capture(generator, group, layer=layer) for layer in (0, 2, 0)]
    result = cc.check_rank_captures(caps, detail_layer=0)
    assert result["pass"] and result["captures"] == 3 and result["layers"] == [0, 2]
    assert result["max_excess_error"] <= cc.BF16_ATOL and result["selection_faults"] == 0
    # details: the layer-0 captures only, in order, as plain lists with -1 padding removed
    assert [s["index"] for s in result["steps"]] == [0, 1]
    step = result["steps"][1]
    assert step["seq_lens"] == list(SEQ_LENS) and len(step["q"][0]) == 3 * group
    assert step["selected"][0][1] == sorted(p for p in caps[2]["selected_pages"][0, 1].tolist() if p != -1)
    assert step["selected"][2][0] == [0, 1]  # dense fallback row: both pages
    assert step["q_abs_max"] == pytest.approx(caps[2]["q"].abs().max().item())
    # one query head of one sequence off by 0.1: far outside bf16 rounding
    out = caps[1]["out"].clone()
    out[1, group - 1] += 0.1
    bad = cc.check_rank_captures([caps[0], {**caps[1], "out": out}, caps[2]], detail_layer=0)
    assert not bad["pass"] and bad["max_excess_error"] > cc.BF16_ATOL and bad["selection_faults"] == 0
    # the step details name the failing capture (layer 2 here, so not among the layer-0 details)
    assert all(s["excess_error"] <= cc.BF16_ATOL for s in bad["steps"])
    named = cc.check_rank_captures([caps[0], {**caps[2], "out": caps[2]["out"] + 0.1}], detail_layer=0)
    assert [s["excess_error"] > cc.BF16_ATOL for s in named["steps"]] == [False, True]
    nan = caps[0]["out"].clone()
    nan[0, 0, 0] = float("nan")
    assert not cc.check_rank_captures([{**caps[0], "out": nan}])["pass"]
    assert not cc.check_rank_captures([])["pass"]
    # a padded row (seq_len 0, as in a CUDA-graph batch) is neither attended nor checked
    padded_lens, padded_out = caps[0]["seq_lens"].clone(), caps[0]["out"].clone()
    padded_lens[2], padded_out[2] = 0, 7.0
    assert cc.check_rank_captures([{**caps[0], "seq_lens": padded_lens, "out": padded_out}])["pass"]


@pytest.mark.parametrize("group", [1, 4])
def test_rank_check_fails_a_selection_without_sink_or_recent_page_or_with_a_bad_id(group):
    generator = torch.Generator().manual_seed(200 + group)
    cap = make_capture(generator, group)
    num_pages = -(-SEQ_LENS[0] // PAGE)

    def unused(pages):
        return next(p for p in range(num_pages) if p not in pages)

    cases = {
        "sink page 0": lambda pages: [unused(pages) if p == 0 else p for p in pages],
        "recent page": lambda pages: [unused(pages) if p == num_pages - 1 else p for p in pages],
        "duplicate": lambda pages: pages[:2] + [pages[1]] + pages[3:],
        "outside": lambda pages: pages[:2] + [num_pages] + pages[3:],
        "budget": lambda pages: pages[:-2] + [-1, pages[-1]],
    }
    for name, edit in cases.items():
        result = cc.check_rank_captures([edited_selection(cap, 0, 2, edit)])
        assert not result["pass"] and result["selection_faults"] == 1, name
        assert "row 0" in result["faults"][0] and "KV head 2" in result["faults"][0], result["faults"]
        assert result["max_excess_error"] <= cc.BF16_ATOL, name  # the output matches its pages: only the selection is wrong
    # the dense fallback row must attend every page
    dropped = cc.check_rank_captures([edited_selection(cap, 2, 0, lambda pages: [0, -1, -1, -1])])
    assert not dropped["pass"] and "dense fallback" in dropped["faults"][0]


def test_the_oracle_check_catches_a_wrong_selection():
    generator = torch.Generator().manual_seed(3)
    caps = [make_capture(generator, 4, oracle=True) for _ in range(2)]
    good = cc.check_oracle_captures(BUDGET, caps)
    assert good["pass"] and good["captures"] == 2 and good["selection_mismatches"] == 0
    num_pages = -(-SEQ_LENS[0] // PAGE)
    swapped = edited_selection(caps[1], 0, 1, lambda pages: [0, next(p for p in range(num_pages) if p not in pages)]
                               + pages[2:])
    bad = cc.check_oracle_captures(BUDGET, [caps[0], swapped])
    assert not bad["pass"] and bad["selection_mismatches"] == 1
    # a NaN output fails (max(0.0, nan) is 0.0 in Python: the error must not be folded in raw)
    poisoned = dict(caps[1], out=caps[1]["out"].clone())
    poisoned["out"][0, 0, 0] = float("nan")
    nan = cc.check_oracle_captures(BUDGET, [caps[0], poisoned])
    assert not nan["pass"] and nan["max_excess_error"] == float("inf")


def test_debug_record_keeps_copies_of_cpu_buffers_the_next_step_overwrites():
    """On the CPU backend q, out and the selection scratch are live buffers; a capture must not alias them."""
    debug.clear()
    q, out = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    selected, seq_lens, table = torch.zeros(1, 2, 3, dtype=torch.int32), torch.tensor([40]), torch.zeros(1, 3, dtype=torch.int32)
    cache = torch.zeros(5, 16, 2, 8)
    debug.record("model.layers.0.self_attn.attn", q, table, seq_lens, selected, out, cache, cache, 0.3)
    kept = {name: debug.captures[0][name].clone() for name in ("q", "out", "selected_pages", "seq_lens", "block_table")}
    for tensor in (q, out, selected, seq_lens, table):
        tensor.add_(1)
    assert all(torch.equal(debug.captures[0][name], kept[name]) for name in kept)
    assert debug.captures[0]["k_cache"] is cache  # the cache is referenced: pages are append-only
    debug.clear()


def test_rank_capture_clear_drops_warmup_captures_before_the_request():
    from locks_toolkit.harness import ranks

    debug.clear()
    cache = torch.zeros(2, 16, 1, 4)
    for _ in range(3):
        debug.record("model.layers.0.self_attn.attn", torch.zeros(1, 1, 4), torch.zeros(1, 1, dtype=torch.int32),
                     torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, 1, dtype=torch.int32), torch.zeros(1, 1, 4),
                     cache, cache, 0.5)
    assert ranks.rank_capture_clear(worker=None) == 3 and debug.captures == []
    assert ranks.rank_capture_clear(worker=None) == 0
