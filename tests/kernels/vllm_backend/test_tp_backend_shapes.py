"""The Locks backend's per-rank decode sizes under tensor parallelism, from real vLLM 0.24 configs.

`decode_shape` sizes the workspaces and the selected-page scratch; each rank holds num_heads / tp
query heads and num_kv_heads / tp KV heads, and the GQA group G (query heads per KV head) must not
change, or the score-select kernels would group the wrong query heads with a KV head.
"""

from __future__ import annotations

import pytest
from locks_toolkit.harness.presets import build_config, materialize_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


def _vllm_config(preset: str, tp: int, max_model_len: int, max_num_seqs: int):
    from vllm.engine.arg_utils import EngineArgs

    config, _ = build_config(preset, 2, max_model_len)
    args = EngineArgs(model=str(materialize_model(config)), skip_tokenizer_init=True, load_format="dummy",
                      tensor_parallel_size=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                      distributed_executor_backend="mp" if tp > 1 else None)
    return config, args.create_engine_config()


@pytest.mark.parametrize("preset,tp", [("glm-4-9b-chat-1m", 1), ("glm-4-9b-chat-1m", 2), ("glm-4-9b-chat-1m", 4),
                                       ("tiny-llama", 2)])
def test_decode_shape_holds_this_ranks_heads_and_keeps_the_group(preset, tp):
    from locks_toolkit.kernels.vllm_backend.core import decode_shape

    config, vllm_config = _vllm_config(preset, tp, max_model_len=40_003, max_num_seqs=3)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    shape = decode_shape(vllm_config, head_dim, page_budget=128)
    q_total, kv_total = config["num_attention_heads"], config["num_key_value_heads"]
    assert vllm_config.parallel_config.tensor_parallel_size == tp
    assert (shape.num_q_heads, shape.num_kv_heads) == (q_total // tp, kv_total // tp)
    assert shape.num_q_heads // shape.num_kv_heads == q_total // kv_total  # G unchanged by TP
    assert shape.head_dim == head_dim and shape.page_budget == 128
    # TP leaves the sequence axis alone: every rank's block table covers the whole context
    assert shape.max_pages >= -(-40_003 // 16) and shape.max_pages % 64 == 0
