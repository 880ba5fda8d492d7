"""A small seeded random Llama checkpoint (safetensors) that every tensor-parallel size loads identically.

vLLM's `load_format="dummy"` fills each rank's shard on its own, so a TP=1 and a TP=2 dummy model
are different models and their outputs cannot be compared. A checkpoint on disk is sharded by the
loader instead, so both see the same weights. Default geometry: GLM-4-9B's attention (32 query
heads, 4 KV heads, head_dim 128, hidden 4096) in a Llama architecture with few layers, a small MLP
and vocabulary, so writing it takes seconds.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...kernels.config import ConfigError

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class CheckpointSpec:
    """Geometry, seed and init scale of the random checkpoint (std of every matrix; norms are ones)."""

    num_layers: int = 4
    hidden_size: int = 4096
    num_q_heads: int = 32
    num_kv_heads: int = 4
    head_dim: int = 128
    intermediate_size: int = 1024
    vocab_size: int = 8192
    max_position_embeddings: int = 65536
    std: float = 0.02
    # std of q_proj/k_proj (None: std). Larger makes attention peaked: with std everywhere, attention is
    # near-uniform, pages nearly tie, and TP rounding alone flips which win (H200, 2026-11-29).
    qk_std: float | None = None
    seed: int = 0
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ConfigError(f"checkpoint dtype {self.dtype!r} unknown; use one of {', '.join(_DTYPES)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ConfigError(f"{self.num_q_heads} query heads are not a multiple of {self.num_kv_heads} KV heads")
        if min(self.num_layers, self.hidden_size, self.head_dim, self.intermediate_size, self.vocab_size) < 1:
            raise ConfigError(f"checkpoint sizes must be positive: {self}")
        if not self.std > 0 or (self.qk_std is not None and not self.qk_std > 0):
            raise ConfigError(f"std {self.std} / qk_std {self.qk_std} must be positive, e.g. 0.02 / 0.1")

    def hf_config(self) -> dict:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_q_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_layers,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": self.dtype,
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF Llama parameter names -> shapes, in the order they are drawn from the generator."""
        h, q, kv, inter = self.hidden_size, self.num_q_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes.update({
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            })
        shapes["model.norm.weight"] = (h,)
        shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes


def make_tensors(spec: CheckpointSpec) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: matrices N(0, std) from one seeded CPU generator, norms ones."""
    generator = torch.Generator().manual_seed(spec.seed)
    dtype = _DTYPES[spec.dtype]
    tensors = {}
    for name, shape in spec.tensor_shapes().items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:  # drawn in float32 so the values do not depend on the storage dtype's sampling path
            std = spec.qk_std if spec.qk_std is not None and name.endswith(("q_proj.weight", "k_proj.weight")) else spec.std
            tensors[name] = (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(dtype)
    return tensors


def write_checkpoint(spec: CheckpointSpec, folder: str | Path) -> Path:
    """Write config.json, model.safetensors and spec.json into `folder` (created); returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(make_tensors(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(spec.hf_config(), indent=1, sort_keys=True))
    (folder / "spec.json").write_text(json.dumps(asdict(spec), indent=1, sort_keys=True))
    log.info("wrote a %d-layer random checkpoint (seed %d) to %s", spec.num_layers, spec.seed, folder)
    return folder
