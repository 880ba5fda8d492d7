"""Engine captures (kernels/vllm_backend/debug.py records) read as the microscope's DecodeCapture tensors."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.suites.capture_vllm import capture_budget, captures_from_engine

PAGE = 16


def _engine_records(gen, prompt_len, steps, layers, hkv=2, group=3, d=8, blocks=12):
    """What the backend records for one prompt decoded alone: per step and layer, q [1, Hq, d], the block
    table and seq_lens of that step, and the (final, shared) paged cache [NB, 16, Hkv, d] in scattered blocks."""
    total = prompt_len + steps
    order = torch.randperm(blocks, generator=gen)[: -(-total // PAGE)]
    caches, tokens = {}, {}
    for layer in layers:
        k, v = torch.randn(blocks, PAGE, hkv, d, generator=gen), torch.randn(blocks, PAGE, hkv, d, generator=gen)
        caches[layer] = (k, v)
        tokens[layer] = (k[order].reshape(-1, hkv, d)[:total], v[order].reshape(-1, hkv, d)[:total])
    table = torch.full((1, blocks), -1, dtype=torch.int32)
    table[0, : len(order)] = order.to(torch.int32)
    records, queries = [], {layer: [] for layer in layers}
    for step in range(steps):
        for layer in layers:
            q = torch.randn(1, hkv * group, d, generator=gen)
            queries[layer].append(q[0].view(hkv, group, d))
            records.append({"layer": f"model.layers.{layer}.self_attn.attn", "q": q, "out": torch.randn(1, hkv * group, d, generator=gen),
                            "block_table": table.clone(), "seq_lens": torch.tensor([prompt_len + step + 1]),
                            "k_cache": caches[layer][0], "v_cache": caches[layer][1]})
    return records, tokens, queries


def test_captures_read_every_token_through_the_block_table_and_keep_the_step_order(gen):
    layers, prompt_len, steps = (1, 4), 37, 3
    records, tokens, queries = _engine_records(gen, prompt_len, steps, layers)
    records.append({**records[0], "layer": "model.layers.2.self_attn.attn"})  # a layer not asked for is ignored
    got = captures_from_engine(records, layers, prompt_len, steps, group=3)
    assert got["seq_lens"].tolist() == [38, 39, 40]
    for i, layer in enumerate(layers):
        assert torch.equal(got["keys"][i], tokens[layer][0].permute(1, 0, 2))  # [Hkv, N, d], N = prompt + steps
        assert torch.equal(got["values"][i], tokens[layer][1].permute(1, 0, 2))
        assert torch.equal(got["queries"][i], torch.stack(queries[layer]))  # [T, Hkv, G, d]
    assert got["outputs"].shape == got["queries"].shape


def test_missing_steps_a_batch_or_wrong_lengths_are_refused(gen):
    records, _, _ = _engine_records(gen, 20, 2, (0,))
    with pytest.raises(RuntimeError, match="1 decode captures, expected 2"):
        captures_from_engine(records[:1], (0,), 20, 2, group=3)
    batched = [{**r, "q": torch.cat([r["q"], r["q"]])} for r in records]
    with pytest.raises(RuntimeError, match="more than one sequence"):
        captures_from_engine(batched, (0,), 20, 2, group=3)
    with pytest.raises(RuntimeError, match="are not"):
        captures_from_engine(records, (0,), 21, 2, group=3)


def test_the_capture_budget_holds_every_page_of_the_longest_prompt():
    budget = capture_budget([[0] * 100, [0] * 600], steps=8)
    assert budget % PAGE == 0 and budget >= 600 + 8 + 1 and budget - (600 + 9) <= 2 * PAGE
