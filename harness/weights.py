"""Weight bytes a decode step reads: counted from the engine's model, or computed from the HF config.

At batch 1 a decode step streams every weight matrix once, which dwarfs the attention KV at short
contexts (GLM-4-9B at 40 layers: ~18 GB of bf16 weights against 2.7 GB of KV at 32K), so the byte
floor of a step is weights + KV (or Locks) bytes. The input embedding table is the exception: a
step gathers only `batch` rows of it, so it is left out unless tied to the LM head (which reads it
whole). The config formula covers dense decoders of the Llama family (Llama, GLM, Qwen3); the engine
count, when the model is reachable, is the ground truth and wins.
"""

from __future__ import annotations

import logging

from .presets import _DTYPE_BYTES

log = logging.getLogger(__name__)


def dtype_bytes(config: dict, dtype: str = "auto") -> int:
    name = config.get("torch_dtype", "bfloat16") if dtype == "auto" else dtype
    return _DTYPE_BYTES.get(str(name), 2)


def config_parameter_counts(config: dict) -> dict[str, int] | None:
    """Parameter counts {embedding, lm_head, attention, mlp, norms, total} of a dense Llama-family decoder.

    None for a config the formula does not cover (mixture of experts), so no wrong number is recorded.
    """
    if any(key in config for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        return None
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    q_heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or q_heads)
    head_dim = int(config.get("head_dim") or hidden // q_heads)
    inter, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    q_width, kv_width = q_heads * head_dim, kv_heads * head_dim
    attention = hidden * (q_width + 2 * kv_width) + q_width * hidden
    if config.get("attention_bias"):
        attention += q_width + 2 * kv_width
        if config.get("model_type") != "glm":  # vLLM's GLM drops the o_proj bias (HF GLM has none)
            attention += hidden
    if config.get("model_type") == "qwen3":
        attention += 2 * head_dim  # per-head RMSNorm of q and k
    mlp = 3 * hidden * inter + (2 * inter + hidden if config.get("mlp_bias") else 0)
    tied = bool(config.get("tie_word_embeddings", False))
    counts = {
        "embedding": vocab * hidden,
        "lm_head": 0 if tied else vocab * hidden,
        "attention": layers * attention,
        "mlp": layers * mlp,
        "norms": (2 * layers + 1) * hidden,
    }
    counts["total"] = sum(counts.values())
    return counts


def step_weight_bytes(total_bytes: int, embedding_bytes: int, tied: bool) -> int:
    """Weight bytes one decode step reads: all of them but an untied input embedding table."""
    return int(total_bytes) - (0 if tied else int(embedding_bytes))


def weights_from_config(config: dict, dtype: str = "auto") -> dict | None:
    """{read_per_step, total, parameters, source} from the config formula, or None when it does not apply."""
    counts = config_parameter_counts(config)
    if counts is None:
        return None
    size = dtype_bytes(config, dtype)
    tied = bool(config.get("tie_word_embeddings", False))
    return {
        "read_per_step": step_weight_bytes(counts["total"] * size, counts["embedding"] * size, tied),
        "total": counts["total"] * size,
        "parameters": counts["total"],
        "tied_embeddings": tied,
        "source": "config formula (embedding, lm_head, attention and MLP matrices, norms)",
    }


def weights_from_model(model, tied: bool) -> dict | None:
    """The same dict counted from a torch module's parameters (shared tensors once), or None if empty."""
    total = embedding = count = 0
    for name, param in model.named_parameters():  # named_parameters() yields a tied tensor once
        size = param.numel() * param.element_size()
        total += size
        count += param.numel()
        if "embed_tokens" in name:
            embedding += size
    if count == 0:
        return None
    return {
        "read_per_step": step_weight_bytes(total, embedding, tied),
        "total": total,
        "parameters": count,
        "tied_embeddings": tied,
        "source": "engine model parameters",
    }


def choose_weights(engine: dict | None, config: dict | None, tolerance: float = 0.01) -> dict | None:
    """The engine's count when it agrees with the config formula (within `tolerance`) or is all there is.

    A platform may hold weights outside `named_parameters()` (vLLM's CPU linear layers are repacked for
    oneDNN, leaving a third of tiny-llama's parameters visible), so a disagreeing engine count is
    noted and the config formula used.
    """
    if engine is None or config is None:
        return engine or config
    if abs(engine["parameters"] - config["parameters"]) <= tolerance * config["parameters"]:
        return engine
    log.info("engine exposes %d parameters, the config formula counts %d; using the formula",
             engine["parameters"], config["parameters"])
    return {**config, "engine_parameters": engine["parameters"],
            "source": f"{config['source']}; the engine's model exposes {engine['parameters']} parameters"}
