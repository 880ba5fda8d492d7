"""The microscope suite: needle prompts -> Gemma-3-270M greedy decode (captured) -> fidelity cells.

The model runs once per prompt; every arm and budget is then evaluated on the captured tensors
(the engine in `microscope.py`), so adding selectors or budgets costs no model time. The captures come
from the transformers engine, or (`engine="vllm"`) from the deployed vLLM engine with the Locks backend
(`capture_vllm.py`); then the transformers capture of the same prompt is taken too, and each record says
how far the two engines' queries, keys and values lie apart.
"""

from __future__ import annotations

import logging
import math
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..kernels.config import ConfigError, SelectionConfig, check_combine_rule
from .microscope import Arm, CapturedRecord, CellResult, capture_output_error, evaluate_record, parse_arms, summarize
from .model_source import load_transformers, resolve_model_source
from .models import AttentionGeometry, DecodeCapture, greedy_decode_capture
from .niah import NiahPrompt, build_niah_suite

logger = logging.getLogger(__name__)

DEFAULT_SELECTORS = ("oracle", "locks", "quest", "centroid")
DEFAULT_FORMATS = ("r8i4", "r8fp")
DEFAULT_BUDGETS = (256, 512)
MIN_CONTEXT_TOKENS = 256
ENGINES = ("transformers", "vllm")

# on_progress(stage, completed, total): stages "load model", ("vllm capture",) "prefill + decode", "microscope".
ProgressCallback = Callable[[str, int, int], None]


@dataclass(frozen=True)
class MicroscopeConfig:
    """What one `locks eval microscope` run measures; validated at construction."""

    prompts: int = 2
    context_tokens: int = 3072
    decode_steps: int = 8
    seed: int = 0
    arms: tuple[Arm, ...] = field(default_factory=lambda: tuple(parse_arms(DEFAULT_SELECTORS, DEFAULT_FORMATS)))
    budgets_tokens: tuple[int, ...] = DEFAULT_BUDGETS
    combine: str = "share_average"
    model: str = "gemma3-270m"  # what `--model` names (suites/model_source.py); real weights through transformers
    engine: str = "transformers"  # where the decode steps are captured (ENGINES)

    def __post_init__(self) -> None:
        from .model_source import resolve_model_source

        try:
            source = resolve_model_source(self.model)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        if not source.real_weights:
            raise ConfigError(f"--model {self.model} is a preset (dummy weights); the microscope captures a real model's "
                              "queries and keys: pass gemma3-270m, a .gguf file or a model folder")
        if self.prompts < 1:
            raise ConfigError(f"--prompts {self.prompts}: need at least one prompt")
        if self.decode_steps < 1:
            raise ConfigError(f"--steps {self.decode_steps}: need at least one decode step to measure")
        if self.context_tokens < MIN_CONTEXT_TOKENS:
            raise ConfigError(f"--context-tokens {self.context_tokens} is too short; pass at least {MIN_CONTEXT_TOKENS}")
        if not self.arms:
            raise ConfigError("no selectors to evaluate; pass e.g. --selectors oracle,locks")
        if not self.budgets_tokens:
            raise ConfigError("no budgets to evaluate; pass e.g. --budgets 256,512")
        if len(set(self.budgets_tokens)) != len(self.budgets_tokens):
            raise ConfigError(f"budgets repeat: {self.budgets_tokens}")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} unknown; use one of {', '.join(ENGINES)}")
        check_combine_rule(self.combine)
        for budget in self.budgets_tokens:
            SelectionConfig(budget_tokens=budget, combine=self.combine)  # raises ConfigError naming the fix

    def reproduce_command(self) -> str:
        """The `locks eval microscope` command that reruns exactly this configuration, every setting explicit."""
        arms = ",".join(arm.scorer if arm.fmt is None else f"{arm.scorer}:{arm.fmt}" for arm in self.arms)
        return shlex.join([
            "locks", "eval", "microscope", "--prompts", str(self.prompts), "--context-tokens", str(self.context_tokens),
            "--steps", str(self.decode_steps), "--seed", str(self.seed), "--selectors", arms,
            "--budgets", ",".join(map(str, self.budgets_tokens)), "--combine", self.combine, "--model", self.model,
            *(["--engine", self.engine] if self.engine != "transformers" else []),
        ])


@dataclass
class RecordInfo:
    """One prompt as run: the needle, the FullKV answer and the capture check."""

    prompt: NiahPrompt
    generated_text: str
    fullkv_correct: bool
    capture_output_max_err: float | None
    prefill_seconds: float
    decode_seconds: float
    # engine="vllm": {"same_tokens", "query_rel_err", "key_rel_err", "value_rel_err", "counters"} against the
    # transformers capture of the same prompt (max |vllm - transformers| / max |transformers|)
    engine_agreement: dict | None = None

    def to_json(self) -> dict:
        return {
            "record": self.prompt.record_id,
            "seed": self.prompt.seed,
            "depth": round(self.prompt.depth, 4),
            "prompt_tokens": self.prompt.num_tokens,
            "needle_span": list(self.prompt.needle_span),
            "needle_pages": list(self.prompt.carrier_pages()),
            "answer": self.prompt.answer,
            "generated": self.generated_text,
            "fullkv_correct": self.fullkv_correct,
            "capture_output_max_err": self.capture_output_max_err,
            "prefill_s": None if math.isnan(self.prefill_seconds) else round(self.prefill_seconds, 3),
            "decode_s": round(self.decode_seconds, 3),
            **({"engine_agreement": self.engine_agreement} if self.engine_agreement is not None else {}),
        }


@dataclass
class MicroscopeRun:
    config: MicroscopeConfig
    model_source: str
    geometry: AttentionGeometry
    records: list[RecordInfo]
    cells: list[CellResult]
    seconds: dict[str, float]

    def summary(self) -> list[dict]:
        """One row per (budget, arm), pooled over records, in config order."""
        rows = []
        for budget in self.config.budgets_tokens:
            for arm in self.config.arms:
                cells = [c for c in self.cells if c.arm == arm and c.budget_tokens == budget]
                rows.append(
                    {
                        "selector": arm.scorer,
                        "format": arm.fmt.name if arm.fmt else None,
                        "label": arm.label,
                        "budget_tokens": budget,
                        "page_budget": cells[0].page_budget,
                        "records": len(cells),
                        **summarize(cells),
                    }
                )
        return rows


def run_microscope(config: MicroscopeConfig, on_progress: ProgressCallback | None = None) -> MicroscopeRun:
    """Load the model, capture every prompt's decode steps, then evaluate every arm and budget."""
    report = on_progress or (lambda stage, done, total: None)
    seconds: dict[str, float] = {}

    start = time.perf_counter()
    report("load model", 0, 1)
    loaded = load_transformers(resolve_model_source(config.model))
    report("load model", 1, 1)
    seconds["load"] = time.perf_counter() - start
    geometry = loaded.geometry
    if geometry.softcap is not None:
        # The scorers estimate LSEs of uncapped logits; capped models need capped scorers first.
        raise ConfigError(f"{loaded.source} soft-caps attention logits at {geometry.softcap}; the microscope does not model soft-capping")

    prompts = build_niah_suite(loaded.tokenizer, config.prompts, config.context_tokens, config.seed)
    captured: list[CapturedRecord] = []
    infos: list[RecordInfo] = []
    start = time.perf_counter()
    report("prefill + decode", 0, len(prompts))
    engine_captures = None
    if config.engine == "vllm":
        start = time.perf_counter()
        report("vllm capture", 0, 1)
        engine_captures = _vllm_captures(config, loaded, prompts)
        report("vllm capture", 1, 1)
        seconds["vllm capture"] = time.perf_counter() - start
    _to_gpu_if_any(loaded)  # after the vLLM capture, which exports the model from the host
    for i, prompt in enumerate(prompts):
        capture = greedy_decode_capture(loaded, prompt.token_ids, config.decode_steps)
        agreement = None
        if engine_captures is not None:
            engine_capture, engine_info = engine_captures[i]
            agreement = {**capture_agreement(engine_capture, capture), "counters": engine_info["counters"]}
            capture = engine_capture
        text = loaded.tokenizer.decode(capture.generated_ids, skip_special_tokens=True)
        record = CapturedRecord(
            record_id=prompt.record_id,
            layers=capture.layers,
            queries=capture.queries,
            keys=capture.keys,
            values=capture.values,
            seq_lens=capture.seq_lens,
            carrier_pages=prompt.carrier_pages(),
            outputs=capture.outputs,
        )
        info = RecordInfo(
            prompt=prompt,
            generated_text=text,
            fullkv_correct=prompt.is_correct(text),
            capture_output_max_err=capture_output_error(record, geometry.scale),
            prefill_seconds=capture.prefill_seconds,
            decode_seconds=capture.decode_seconds,
            engine_agreement=agreement,
        )
        logger.info("%s: %d tokens, needle pages %s, FullKV answer %r (%s)", prompt.record_id, prompt.num_tokens,
                    list(prompt.carrier_pages()), text, "correct" if info.fullkv_correct else "WRONG")
        captured.append(record)
        infos.append(info)
        report("prefill + decode", i + 1, len(prompts))
    seconds["capture"] = time.perf_counter() - start
    source = loaded.source
    del loaded  # the captured tensors are all the engine needs

    start = time.perf_counter()
    total = sum(r.queries.shape[0] * r.queries.shape[1] for r in captured)
    done = 0
    report("microscope", 0, total)
    cells: list[CellResult] = []

    def step_done() -> None:
        nonlocal done
        done += 1
        report("microscope", done, total)

    for record in captured:
        cells.extend(evaluate_record(record, config.arms, config.budgets_tokens, geometry.scale, config.combine, step_done))
    seconds["microscope"] = time.perf_counter() - start
    return MicroscopeRun(config, source, geometry, infos, cells, seconds)


def _to_gpu_if_any(loaded) -> None:
    """Decode on the GPU when there is one (fp32 still): four 32K prompts took 7 min 18 s on the H200 host's 16
    cores."""
    import torch

    if torch.cuda.is_available():
        loaded.model.to("cuda")
        logger.info("transformers capture on %s (fp32)", torch.cuda.get_device_name())


def _vllm_captures(config: MicroscopeConfig, loaded, prompts: list[NiahPrompt]):
    """Every prompt's decode steps captured in vLLM with the Locks backend (the GPU when there is one)."""
    import torch

    from .capture_vllm import vllm_decode_captures
    from .model_source import vllm_model_dir

    model_dir = vllm_model_dir(resolve_model_source(config.model), loaded=loaded)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    geometry = loaded.geometry
    # bf16 on the GPU, as deployed (its stock attention serves no fp32); fp32 on the CPU engine
    dtype = "bfloat16" if device == "cuda" else "float32"
    return vllm_decode_captures(model_dir, [list(p.token_ids) for p in prompts], config.decode_steps,
                                geometry.global_layers, geometry.group_size, device, dtype)


def capture_agreement(engine: DecodeCapture, reference: DecodeCapture) -> dict:
    """How far one engine's capture of a prompt lies from another's: the same greedy tokens, and the largest
    difference of queries, keys and values relative to the reference's largest magnitude."""

    def rel(a, b) -> float | None:
        if a.shape != b.shape:
            return None
        scale = float(b.abs().max())
        return float((a.float() - b.float()).abs().max()) / scale if scale > 0 else 0.0

    return {"same_tokens": list(engine.generated_ids) == list(reference.generated_ids),
            "query_rel_err": rel(engine.queries, reference.queries), "key_rel_err": rel(engine.keys, reference.keys),
            "value_rel_err": rel(engine.values, reference.values)}
