"""Weight bytes per decode step: the config formula against published parameter counts and a torch model."""

import pytest
import torch
from locks_toolkit.harness.presets import build_config, load_preset_config
from locks_toolkit.harness.weights import (
    choose_weights,
    config_parameter_counts,
    weights_from_config,
    weights_from_model,
)


def test_config_formula_matches_published_parameter_counts():
    # Llama-3.1-8B: 8,030,261,248 parameters; Qwen3-4B (tied embeddings): 4.02B on its model card.
    assert config_parameter_counts(load_preset_config("llama-3.1-8b"))["total"] == 8_030_261_248
    assert config_parameter_counts(load_preset_config("qwen3-4b"))["total"] == pytest.approx(4.02e9, abs=5e6)


def test_a_step_reads_all_weights_but_an_untied_embedding_table():
    glm = weights_from_config(load_preset_config("glm-4-9b-chat-1m"))
    embedding = 151552 * 4096 * 2
    assert glm["read_per_step"] == glm["total"] - embedding and not glm["tied_embeddings"]
    qwen = weights_from_config(load_preset_config("qwen3-4b"))
    assert qwen["tied_embeddings"] and qwen["read_per_step"] == qwen["total"]  # the LM head reads the table whole
    fewer, _ = build_config("glm-4-9b-chat-1m", 7, 1 << 20)  # the layer override changes the count
    per_layer = (glm["total"] - weights_from_config(fewer)["total"]) / (40 - 7)
    assert per_layer == 2 * (4096 * (4096 + 2 * 512) + 4096 + 2 * 512 + 4096 * 4096 + 3 * 4096 * 13696 + 2 * 4096)


def test_mixture_of_experts_is_not_guessed():
    config = dict(load_preset_config("qwen3-4b"), num_experts=128)
    assert config_parameter_counts(config) is None and weights_from_config(config) is None


class _Tiny(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int, tied: bool):
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.proj = torch.nn.Linear(hidden, 3 * hidden, bias=True)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


@pytest.mark.parametrize("tied", [False, True])
def test_model_count_counts_a_shared_table_once(tied):
    vocab, hidden = 37, 11
    weights = weights_from_model(_Tiny(vocab, hidden, tied).to(torch.bfloat16), tied)
    table, proj = vocab * hidden, 3 * hidden * hidden + 3 * hidden
    assert weights["parameters"] == proj + table * (1 if tied else 2)
    assert weights["total"] == 2 * weights["parameters"]
    assert weights["read_per_step"] == 2 * (proj + table)  # LM head whole; an untied input table not at all
    assert weights["source"] == "engine model parameters"


def test_an_engine_count_is_used_only_when_it_agrees_with_the_formula():
    config = weights_from_config(load_preset_config("glm-4-9b-chat-1m"))
    close = {**config, "parameters": config["parameters"] + 1000, "source": "engine model parameters"}
    assert choose_weights(close, config) is close and choose_weights(close, None) is close
    assert choose_weights(None, config) is config
    hidden = {**config, "parameters": config["parameters"] // 3, "source": "engine model parameters"}
    chosen = choose_weights(hidden, config)
    assert chosen["read_per_step"] == config["read_per_step"] and chosen["engine_parameters"] == config["parameters"] // 3
