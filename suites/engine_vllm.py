"""Engine (b): vLLM with the Locks attention backend (GPU only; plumbing for the same runner).

One `LLM` per (arm, budget): sparse arms run under `attention_backend="CUSTOM"` with
`additional_config={"locks": {"budget", "format", "scorer", "combine"}}` (kernels/vllm_backend),
FullKV under vLLM's default backend. All pending instances of a task are generated as one batch
per (arm, budget), greedy (temperature 0). With `dummy_weights` the model's weights are random
(`load_format="dummy"`): the records then test the plumbing only, and say so.

`model` is a local model folder (its tokenizer is used) or a harness preset name (`tiny-llama`,
`qwen3-4b`, ...: harness/presets): a preset has a config only, so it runs with dummy weights and a
byte-level stand-in tokenizer, and needs no download at all.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from .engine_hf import Generation, StopRule

logger = logging.getLogger(__name__)

# Scorers the backend serves in one engine (kernels/vllm_backend/settings.py BACKEND_SCORERS).
_BACKEND_SCORERS = ("locks", "oracle", "quest", "centroid")


class VllmUnavailableError(RuntimeError):
    """vLLM or a CUDA GPU is missing; the message says what to use instead."""


def require_cuda_vllm() -> Any:
    """The vllm module, or one clear error on a machine without it or without a CUDA GPU."""
    import torch

    if not torch.cuda.is_available():
        raise VllmUnavailableError(
            "the vLLM engine needs a CUDA GPU and this machine has none; "
            "use --engine transformers here, or run on the GPU host"
        )
    try:
        return importlib.import_module("vllm")
    except ImportError as error:
        raise VllmUnavailableError(f"vLLM is not installed ({error}); install with: pip install 'locks-toolkit[gpu]'") from None


def check_backend_arms(arms: Sequence[Any]) -> None:
    """Raise one ValueError naming the first sparse arm the backend does not serve (checked before any run)."""
    for arm in arms:
        if arm.sparse and arm.scorer not in _BACKEND_SCORERS:
            raise ValueError(f"arm {arm.label} is not served by the vLLM backend; use one of {', '.join(_BACKEND_SCORERS)} "
                             "or --engine transformers")  # fmt: skip


class ByteTokenizer:
    """Stand-in tokenizer for config-only (dummy-weight) models: one token per UTF-8 byte, id = 16 + byte."""

    offset = 16
    newline_id = offset + ord("\n")

    def encode(self, text: str) -> list[int]:
        return [self.offset + byte for byte in text.encode()]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256).decode(errors="replace")


class VllmEngine:
    """Batch greedy generation under each (arm, budget) with the Locks backend."""

    name = "vllm"

    def __init__(self, model: str, combine: str = "share_average", dummy_weights: bool = False,
                 max_model_len: int | None = None, gpu_memory_utilization: float = 0.85) -> None:  # fmt: skip
        from ..harness.presets import preset_names

        self.vllm = require_cuda_vllm()
        self.preset = model in preset_names()
        self.model_name = model
        self.combine = combine
        self.dummy_weights = dummy_weights or self.preset
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        if self.preset:
            self.tokenizer: Any = ByteTokenizer()
        else:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(model)
        note = ", dummy weights: plumbing only" if self.dummy_weights else ""
        note += ", byte tokenizer" if self.preset else ""
        self.source = f"{model} (vllm {self.vllm.__version__}{note})"

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def _llm_kwargs(self, request: Any, max_len: int) -> dict:
        arm = request.arm
        max_len = self.max_model_len or max_len
        kwargs: dict[str, Any] = {
            "model": self.model_name,
            "max_model_len": max_len,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "block_size": 16,
            "seed": 0,
        }
        if self.dummy_weights:
            kwargs["load_format"] = "dummy"
        if self.preset:
            from ..harness.presets import build_config, materialize_model

            kwargs["model"] = str(materialize_model(build_config(self.model_name, None, max_len)[0]))
            kwargs["skip_tokenizer_init"] = True
        if arm.sparse:
            check_backend_arms([arm])
            kwargs["attention_backend"] = "CUSTOM"
            kwargs["additional_config"] = {"locks": {
                "budget": request.budget_tokens, "format": arm.fmt.name if arm.fmt else "r8i4",
                "scorer": arm.scorer, "combine": self.combine,
            }}  # fmt: skip
            if arm.scorer != "locks":  # key-reading scorers run eager only (not CUDA-graph safe)
                kwargs["enforce_eager"] = True
        return kwargs

    def run(self, instances: Sequence[Any], requests: Mapping[str, Sequence[Any]],
            stop: StopRule) -> Iterator[tuple[Any, Any, Generation, float]]:  # fmt: skip
        """Regroup the pending cells by (arm, budget) and generate each group as one batch."""
        by_request: dict[Any, list[Any]] = {}
        for instance in instances:
            for request in requests[instance.instance_id]:
                by_request.setdefault(request, []).append(instance)
        if self.preset:  # no detokenizer in the engine: stop on the newline byte's id
            newline = {"stop_token_ids": [ByteTokenizer.newline_id]} if stop.newline else {}
            params = self.vllm.SamplingParams(temperature=0.0, max_tokens=stop.max_new_tokens, detokenize=False, **newline)
        else:
            params = self.vllm.SamplingParams(temperature=0.0, max_tokens=stop.max_new_tokens,
                                              stop=["\n"] if stop.newline else None)  # fmt: skip
        for request, group in by_request.items():
            ids = [self.tokenizer.encode(instance.prompt) for instance in group]
            if self.preset:
                from vllm.inputs import TokensPrompt

                prompts: list[Any] = [TokensPrompt(prompt_token_ids=i) for i in ids]
            else:
                prompts = [instance.prompt for instance in group]
            max_len = max(len(i) for i in ids) + stop.max_new_tokens + 16
            spawn_engine_processes()
            llm = self.vllm.LLM(**self._llm_kwargs(request, max_len))
            try:
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                seconds = (time.perf_counter() - start) / len(prompts)
            finally:
                del llm
                _free_gpu()
            for instance, output in zip(group, outputs):
                completion = output.outputs[0]
                token_ids = list(completion.token_ids)
                text = self.tokenizer.decode(token_ids) if self.preset else completion.text
                newline = completion.stop_reason in ("\n", ByteTokenizer.newline_id)
                reason = "max_new_tokens" if completion.finish_reason == "length" else ("newline" if newline else "eos")
                generation = Generation(token_ids, text, reason, seconds)
                yield instance, request, generation, 0.0


def spawn_engine_processes() -> None:
    """Start vLLM's engine processes by spawn unless the user chose otherwise.

    This process has touched CUDA before the engine starts (device checks, provenance), and a
    forked engine core then fails with "Cannot re-initialize CUDA in forked subprocess" (H200,
    2026-11-29); in-process engines instead keep each arm's memory until the next one starts.
    """
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _free_gpu() -> None:
    import torch

    gc.collect()
    torch.cuda.empty_cache()


def load_vllm_engine(model: str, combine: str = "share_average", dummy_weights: bool = False) -> VllmEngine:
    """The vLLM engine for a local model folder or hub id (weights random with dummy_weights)."""
    return VllmEngine(model, combine=combine, dummy_weights=dummy_weights)
