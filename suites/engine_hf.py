"""Engine (a): transformers (CPU or GPU) with the Locks page selection applied inside attention.

One attention function is registered with transformers' `AttentionInterface`. Prefill runs stock
sdpa untouched (dense). Decode steps (query length 1) run one plain attention, `decode_attention`,
on every layer and arm. On a full-attention layer (config.layer_types) the active `PageSelector`
splits the cached keys into pages of 16, scores the full pages with the arm's scorer (per KV head,
all G query heads, the model's own scale), combines over the group, keeps sink + recent +
top-(k-2) pages, and attention runs over those tokens only. With no selector active (FullKV) every
token is attended; this equals stock sdpa to fp32 rounding (tests/suites/test_eval_engine_hf.py).

Arms share the prefill: an instance is prefilled once, and each (arm, budget) decodes greedily
from a copy of that KV cache. Scorer states (summaries) of the prompt's pages are built once per
(instance, arm) and shared by every budget; pages that fill during decode are summarized once,
when they fill, never per step.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.config import PAGE_SIZE, SelectionConfig, scored_pages
from ..kernels.score.selectors import PageScorer
from ..kernels.select.reference import combine_group, select_pages
from .arms import Arm, continuation_scorer, prompt_scorer
from .models import AttentionGeometry, geometry_from_config, with_cache

logger = logging.getLogger(__name__)

ATTN_IMPL = "locks_select"


@dataclass
class _Chunk:
    """Scorer state of pages [first, first + count) of one layer (all KV heads)."""

    first: int
    count: int
    state: Any


class PageSelector:
    """Picks the pages one decode run attends, per (full-attention layer, KV head).

    Keeps the scorer state of every full page, built once when the page fills (`pages_built`
    counts them, for tests). `prompt_chunks` seeds it with states built on the prompt's pages.
    """

    def __init__(
        self,
        scorer: PageScorer,
        selection: SelectionConfig,
        layers: Sequence[int],
        prompt_chunks: dict[int, _Chunk] | None = None,
    ) -> None:
        self.scorer = scorer
        self.selection = selection
        self.chunks: dict[int, list[_Chunk]] = {layer: [] for layer in layers}
        self.scorers: dict[int, PageScorer] = {layer: scorer for layer in layers}
        self.pages_built = 0
        for layer, chunk in (prompt_chunks or {}).items():
            self.chunks[layer].append(chunk)
            self.scorers[layer] = continuation_scorer(scorer, chunk.state)
        self.steps = 0
        self.sparse_steps = 0

    def covers(self, layer: int | None) -> bool:
        return layer in self.chunks

    def _extend(self, layer: int, keys: torch.Tensor) -> None:
        """Summarize the pages of `keys` [Hkv, N, d] that filled since the last call."""
        full = keys.shape[1] // PAGE_SIZE
        chunks = self.chunks[layer]
        built = chunks[-1].first + chunks[-1].count if chunks else 0
        if full > built:
            hkv, _, dim = keys.shape
            pages = keys[:, built * PAGE_SIZE : full * PAGE_SIZE].reshape(hkv, full - built, PAGE_SIZE, dim)
            scorer = self.scorers[layer]
            state = scorer.prepare(pages)
            if not chunks:  # a shared-basis sketch fits on its first pages, then keeps that basis
                self.scorers[layer] = continuation_scorer(scorer, state)
            chunks.append(_Chunk(built, full - built, state))
            self.pages_built += full - built

    def select(self, layer: int, query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor | None:
        """query [Hkv, G, d], keys [Hkv, N, d] -> int64 [Hkv, k] selected page ids, or None when every page fits."""
        self.steps += 1
        num_pages = math.ceil(keys.shape[1] / PAGE_SIZE)
        page_budget = self.selection.page_budget
        if num_pages <= page_budget:
            return None
        self._extend(layer, keys)
        scorer = self.scorers[layer]
        scores = torch.cat([scorer.scores(chunk.state, query, scale) for chunk in self.chunks[layer]], dim=-1)
        # The recent page (full or not) is always kept and never scored (config.scored_pages).
        scored = scored_pages(keys.shape[1])
        scores = torch.nn.functional.pad(scores[..., :scored], (0, num_pages - scored), value=float("-inf"))
        group = combine_group(scores, self.selection.combine)
        self.sparse_steps += 1
        return select_pages(group, num_pages, page_budget)


class SelectiveAttention:
    """The registered attention function. Prefill: stock sdpa. Decode steps: `decode_attention` on
    every layer and arm (torch's CPU sdpa takes ~1 s for one query over 4K keys; a plain matmul-
    softmax takes milliseconds), over the selected tokens where the active selector applies."""

    def __init__(self) -> None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        self._sdpa = sdpa_attention_forward
        self.selector: PageSelector | None = None

    def __call__(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        # query [b, Hq, q_len, d]; key/value [b, Hkv, N, d] (the cache, this step's token included)
        if query.shape[2] != 1:
            return self._sdpa(module, query, key, value, attention_mask, **kwargs)
        selector, layer = self.selector, getattr(module, "layer_idx", None)
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        softcap = kwargs.get("softcap")
        visible = _visible(attention_mask, key.shape[2])  # [b, 1, N] bool or None
        if selector is None or not selector.covers(layer):
            return decode_attention(query, key, value, visible, scale, softcap), None
        if query.shape[0] != 1:
            raise ValueError(f"the selective engine decodes one sequence at a time (batch {query.shape[0]})")
        hq, hkv = query.shape[1], key.shape[1]
        grouped = query[0, :, 0, :].reshape(hkv, hq // hkv, -1)  # query head h reads KV head h // G
        selected = selector.select(layer, grouped, key[0], scale)
        if selected is None:
            return decode_attention(query, key, value, visible, scale, softcap), None
        # Attend over the gathered selected tokens only (same result as masking the rest, and the
        # cost no longer grows with the context). Padding slots and the partial page's tail are masked.
        index, valid = selected_token_index(selected, key.shape[2])  # [Hkv, K]
        if visible is not None:
            valid = valid & visible[0].expand(hkv, -1).gather(1, index)
        gather = index[None, :, :, None].expand(1, hkv, index.shape[1], key.shape[-1])
        return decode_attention(query, key.gather(2, gather), value.gather(2, gather), valid[None], scale, softcap), None


def _visible(attention_mask: torch.Tensor | None, num_keys: int) -> torch.Tensor | None:
    """A decode step's mask [b, 1|Hq, 1, >=N] (bool, or additive float) -> bool [b, 1, N] (True = visible)."""
    if attention_mask is None:
        return None
    if attention_mask.shape[1] != 1:
        raise ValueError(f"per-head attention masks are not supported at decode (mask {tuple(attention_mask.shape)})")
    mask = attention_mask[:, 0, -1:, -num_keys:]
    return mask if mask.dtype == torch.bool else mask == 0


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor | None,
                     scale: float, softcap: float | None = None) -> torch.Tensor:  # fmt: skip
    """One decode step: query [b, Hq, 1, d], key/value [b, Hkv, K, d], keep bool [b, 1|Hkv, K] or None
    -> [b, 1, Hq, d] (transformers' attention output layout). Softmax in fp32."""
    batch, hq, _, dim = query.shape
    hkv = key.shape[1]
    q = query.reshape(batch, hkv, hq // hkv, dim)  # query head h reads KV head h // G
    logits = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [b, Hkv, G, K]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    if keep is not None:
        logits = logits.masked_fill(~keep[:, :, None, :], float("-inf"))
    weights = torch.softmax(logits, dim=-1).to(value.dtype)
    return torch.matmul(weights, value).reshape(batch, 1, hq, value.shape[-1])


def selected_token_index(selected: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """selected int64 [Hkv, k] page ids (-1 = padding) -> token positions int64 [Hkv, k * B] and
    valid bool [Hkv, k * B] (False for padding slots and positions past the last token)."""
    offsets = torch.arange(PAGE_SIZE, device=selected.device)
    positions = selected.clamp(min=0)[:, :, None] * PAGE_SIZE + offsets  # [Hkv, k, B]
    valid = (selected[:, :, None] >= 0) & (positions < num_tokens)
    return positions.clamp(max=num_tokens - 1).flatten(1), valid.flatten(1)


@dataclass
class Generation:
    """One greedy decode: token ids after the prompt, their text, and why it stopped."""

    token_ids: list[int]
    text: str
    stop_reason: str  # "eos" | "newline" | "max_new_tokens"
    seconds: float
    logits: list[torch.Tensor] = field(default_factory=list)  # [vocab] per token, when asked for
    pages_built: int = 0
    sparse_steps: int = 0


@dataclass(frozen=True)
class StopRule:
    """Greedy decode stops after max_new_tokens, at EOS, or (newline=True) at the first line break
    that follows some non-blank text (base models keep writing after a one-line answer)."""

    max_new_tokens: int
    newline: bool = True


Stops = StopRule | Mapping[str, StopRule]  # one rule for every instance, or one per instance_id


def stop_for(stops: Stops, instance_id: str) -> StopRule:
    return stops if isinstance(stops, StopRule) else stops[instance_id]


@dataclass
class Prefill:
    """A prefilled prompt: its cache (copied per arm), first token and logits, prompt page states per arm."""

    prompt_ids: list[int]
    cache: Any
    first_token: int
    first_logits: torch.Tensor
    seconds: float
    prompt_states: dict[str, tuple[PageScorer, dict[int, _Chunk]]] = field(default_factory=dict)


class HFEngine:
    """Greedy decode of a transformers causal LM under any arm; `prefill` once, `generate` per (arm, budget)."""

    name = "transformers"
    # How every record of this engine selected its pages (stored in each record's `selection`).
    selection = "transformers: one decode per (arm, budget), the selection applied inside attention"

    def __init__(self, model: Any, tokenizer: Any, model_name: str, geometry: AttentionGeometry | None = None,
                 combine: str = "share_average") -> None:  # fmt: skip
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.source = model_name  # where the weights came from (package and file), for records
        self.geometry = geometry or geometry_from_config(model.config)
        self.combine = combine
        self.attention = SelectiveAttention()
        AttentionInterface.register(ATTN_IMPL, self.attention)
        # Without a mask function under the same name the model builds the wrong mask format and
        # silently generates garbage (docs/transformers-notes.md).
        AttentionMaskInterface.register(ATTN_IMPL, sdpa_mask)
        model.set_attn_implementation(ATTN_IMPL)
        self.eos_ids = _eos_ids(model, tokenizer)

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    @torch.inference_mode()
    def prefill(self, prompt_ids: Sequence[int]) -> Prefill:
        """Dense prefill of one prompt (the expensive part on CPU)."""
        from transformers import DynamicCache

        self.attention.selector = None
        cache = DynamicCache(config=self.model.config)
        start = time.perf_counter()
        # logits_to_keep=1: the LM head over every prompt position (262K vocab on Gemma 3) would cost
        # more than the rest of the prefill.
        ids = torch.tensor([list(prompt_ids)], device=self.model.device)
        out = self.model(input_ids=ids, **with_cache(self.model, cache), logits_to_keep=1)
        logits = out.logits[0, -1].float()
        seconds = time.perf_counter() - start
        logger.debug("prefill of %d tokens: %.1f s", len(prompt_ids), seconds)
        return Prefill(list(prompt_ids), cache, int(logits.argmax()), logits, seconds)

    def _prompt_chunks(self, prefill: Prefill, arm: Arm) -> tuple[PageScorer, dict[int, _Chunk]]:
        """Scorer states of the prompt's full pages on every full-attention layer, built once per arm."""
        if arm.label not in prefill.prompt_states:
            layers = self.geometry.global_layers
            full = len(prefill.prompt_ids) // PAGE_SIZE
            keys = torch.stack([_layer_keys(prefill.cache, layer) for layer in layers])  # [L, Hkv, N, d]
            pages = keys[:, :, : full * PAGE_SIZE].reshape(*keys.shape[:2], full, PAGE_SIZE, keys.shape[-1])
            scorer = prompt_scorer(arm, pages)
            chunks = {layer: _Chunk(0, full, scorer.prepare(pages[i])) for i, layer in enumerate(layers)} if full else {}
            prefill.prompt_states[arm.label] = (scorer, chunks)
        return prefill.prompt_states[arm.label]

    @torch.inference_mode()
    def generate(self, prefill: Prefill, arm: Arm, budget_tokens: int | None, stop: StopRule,
                 keep_logits: bool = False) -> Generation:  # fmt: skip
        """Greedy decode from a copy of the prefill cache under `arm` (budget None for dense arms)."""
        selector = None
        if arm.sparse:
            if budget_tokens is None:
                raise ValueError(f"arm {arm.label} is sparse: pass a budget in tokens")
            scorer, chunks = self._prompt_chunks(prefill, arm)
            selection = SelectionConfig(budget_tokens=budget_tokens, combine=self.combine)
            selector = PageSelector(scorer, selection, self.geometry.global_layers, chunks)
        cache = copy.deepcopy(prefill.cache)
        tokens, logits = [prefill.first_token], [prefill.first_logits] if keep_logits else []
        start = time.perf_counter()
        self.attention.selector = selector
        watch = _LineWatch(self.tokenizer)
        try:
            reason = self._stop_reason(tokens, stop, watch)
            while reason is None:
                out = self.model(input_ids=torch.tensor([[tokens[-1]]], device=self.model.device),
                                 **with_cache(self.model, cache))
                step_logits = out.logits[0, -1].float()
                tokens.append(int(step_logits.argmax()))
                if keep_logits:
                    logits.append(step_logits)
                reason = self._stop_reason(tokens, stop, watch)
        finally:
            self.attention.selector = None
        text_ids = tokens[:-1] if reason == "eos" else tokens
        return Generation(
            token_ids=tokens,
            text=self.tokenizer.decode(text_ids, skip_special_tokens=True),
            stop_reason=reason,
            seconds=time.perf_counter() - start,
            logits=logits,
            pages_built=selector.pages_built if selector else 0,
            sparse_steps=selector.sparse_steps if selector else 0,
        )

    def run(self, instances: Sequence[Any], requests: Any, stops: Stops) -> Iterator[tuple[Any, Any, Generation, float]]:
        """The runner's interface: each instance prefilled once, then decoded under each of its
        pending requests (`requests[instance_id]`, objects with .arm and .budget_tokens)."""
        for instance in instances:
            prefill = self.prefill(self.encode(instance.prompt))
            stop = stop_for(stops, instance.instance_id)
            for request in requests[instance.instance_id]:
                yield instance, request, self.generate(prefill, request.arm, request.budget_tokens, stop), prefill.seconds

    def _stop_reason(self, tokens: list[int], stop: StopRule, watch: _LineWatch) -> str | None:
        """Why to stop after the newest token of `tokens` (None: go on); `watch` has seen every earlier one."""
        if tokens[-1] in self.eos_ids:
            return "eos"
        if stop.newline and watch.line_break(tokens):
            return "newline"
        if len(tokens) >= stop.max_new_tokens:
            return "max_new_tokens"
        return None


class _LineWatch:
    """Is there a line break after non-blank text in the decoded tokens? Decodes only the tokens since the
    last complete text per step (not the whole output: that is quadratic in its length).

    The new text is measured against the decode of the previous step's new tokens, not decoded alone,
    because tokenizers decode a token differently at the start of a text (a leading-space piece loses
    its space). A byte-fallback piece of a multi-byte character decodes to U+FFFD until the character
    completes; such text is re-read next step instead of being taken as final.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.prefix = 0  # tokens[prefix:read] were decoded last step: the context the new text follows
        self.read = 0  # tokens[:read] are final text
        self.text_seen = False  # final text so far has a non-blank character

    def line_break(self, tokens: Sequence[int]) -> bool:
        """Call once per new token, with all tokens so far."""
        before = self.tokenizer.decode(tokens[self.prefix : self.read], skip_special_tokens=True)
        after = self.tokenizer.decode(tokens[self.prefix :], skip_special_tokens=True)
        new = after[len(before) :]
        if "\n" in (new if self.text_seen else new.lstrip()):
            return True
        if not new.endswith("\ufffd"):
            self.text_seen = self.text_seen or bool(new.strip())
            self.prefix, self.read = self.read, len(tokens)
        return False


def _layer_keys(cache: Any, layer: int) -> torch.Tensor:
    """The cached keys of one layer of a DynamicCache as [Hkv, N, d] (batch 1)."""
    return cache.layers[layer].keys[0]


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def load_engine(model: str, combine: str = "share_average") -> HFEngine:
    """The transformers engine for what `--model` names (suites/model_source.py: gemma3-270m, a .gguf
    file or a HF folder)."""
    from .model_source import load_transformers, resolve_model_source

    loaded = load_transformers(resolve_model_source(model))
    logger.info("model %s loaded in %.0f s (%s)", model, loaded.load_seconds, loaded.source)
    engine = HFEngine(loaded.model, loaded.tokenizer, model_name=model, geometry=loaded.geometry, combine=combine)
    engine.source = loaded.source
    return engine
