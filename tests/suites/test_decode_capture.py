"""The transformers decode capture on a small random Gemma-3: what it captures is what the model attended with,
on the host, whatever device decoded (the microscope runs it on a GPU where there is one)."""

from __future__ import annotations

import pytest
import torch
from locks_toolkit.suites.microscope import CapturedRecord, capture_output_error
from locks_toolkit.suites.models import LoadedModel, geometry_from_config, greedy_decode_capture

pytest.importorskip("transformers")
PROMPT, STEPS = 53, 3  # tokens: a partial last page, past the sliding window


def _tiny_gemma3(device: str) -> LoadedModel:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=16,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              max_position_embeddings=128)  # fmt: skip
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval().to(device)
    return LoadedModel(model=model, tokenizer=None, geometry=geometry_from_config(config), source="tiny", load_seconds=0.0)


def _capture(device: str):
    loaded = _tiny_gemma3(device)
    ids = torch.randint(1, 96, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    return loaded, greedy_decode_capture(loaded, ids, STEPS)


def _check(loaded: LoadedModel, capture) -> None:
    geometry = loaded.geometry
    assert capture.layers == (1,)
    assert capture.queries.shape == (1, STEPS, 1, 4, 32) and capture.keys.shape == (1, 1, PROMPT + STEPS, 32)
    assert all(t.device.type == "cpu" for t in (capture.queries, capture.keys, capture.values, capture.outputs))
    assert capture.seq_lens.tolist() == [PROMPT + 1 + t for t in range(STEPS)] and len(capture.generated_ids) == STEPS + 1
    record = CapturedRecord("tiny", capture.layers, capture.queries, capture.keys, capture.values, capture.seq_lens,
                            outputs=capture.outputs)  # fmt: skip
    # dense attention over the captured q, k, v (fp64 reference) gives what the model's attention returned
    assert capture_output_error(record, geometry.scale) < 1e-5


def test_the_capture_is_what_the_model_attended_with():
    _check(*_capture("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_the_capture_comes_back_to_the_host_and_matches_the_cpu_one():
    loaded, gpu = _capture("cuda")
    _check(loaded, gpu)
    _, cpu = _capture("cpu")
    assert gpu.generated_ids == cpu.generated_ids
    for a, b in ((gpu.queries, cpu.queries), (gpu.keys, cpu.keys), (gpu.values, cpu.values)):
        assert (a - b).abs().max() <= 1e-4 * b.abs().max()
