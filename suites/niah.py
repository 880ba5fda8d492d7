"""Seeded needle-in-a-haystack prompts (RULER niah_single phrasing) with the needle's token span.

A prompt is built directly as token ids (preamble + haystack + needle + haystack + question), so
the needle's token span is exact and its pages are known: they are the "carrier" pages whose
retention the microscope measures. The haystack is RULER's repeated noise paragraph.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

from ..kernels.config import PAGE_SIZE

PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
NEEDLE = "One of the special magic numbers for {key} is: {value}.\n"
QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
_ADJECTIVES = (
    "amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly",
    "keen", "lucky", "mellow", "nimble", "olive", "proud", "quiet", "rustic", "silent", "tidy",
)
_NOUNS = (
    "anchor", "badger", "candle", "delta", "ember", "falcon", "garden", "harbor", "island", "jacket",
    "kettle", "lantern", "meadow", "needle", "orchid", "pepper", "quartz", "river", "saddle", "tunnel",
)
MIN_DEPTH, MAX_DEPTH = 0.1, 0.9  # keep the needle away from the sink and recent pages


class Tokenizer(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class NiahPrompt:
    """One frozen needle prompt. needle_span = [start, end) token positions of the needle sentence."""

    record_id: str
    seed: int
    depth: float  # requested relative position of the needle in the haystack
    key: str
    answer: str  # the magic number, as digits
    token_ids: tuple[int, ...]
    needle_span: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def carrier_pages(self, page_size: int = PAGE_SIZE) -> tuple[int, ...]:
        """Logical pages that hold at least one needle token."""
        start, end = self.needle_span
        return tuple(range(start // page_size, (end - 1) // page_size + 1))

    def is_correct(self, generated_text: str) -> bool:
        """FullKV check: the greedy continuation contains the magic number."""
        return self.answer in "".join(generated_text.split())


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def build_niah_prompt(
    tokenizer: Tokenizer, context_tokens: int, seed: int, depth: float | None = None, record_id: str | None = None
) -> NiahPrompt:
    """A prompt of about `context_tokens` tokens (within one noise paragraph) with one keyed needle.

    The key, the 7-digit answer and (when `depth` is None) the needle depth are drawn from `seed`;
    the same tokenizer, length and seed always give the same token ids.
    """
    rng = random.Random(seed)
    key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
    answer = str(rng.randrange(1_000_000, 10_000_000))
    drawn_depth = rng.uniform(MIN_DEPTH, MAX_DEPTH)
    depth = drawn_depth if depth is None else depth
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"needle depth {depth} is outside [0, 1]; pass a fraction of the haystack")

    head = ([tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []) + _encode(tokenizer, PREAMBLE)
    noise = _encode(tokenizer, NOISE)
    needle = _encode(tokenizer, NEEDLE.format(key=key, value=answer))
    question = _encode(tokenizer, QUESTION.format(key=key))
    fixed = len(head) + len(needle) + len(question)
    repeats = round((context_tokens - fixed) / len(noise))
    if repeats < 2:
        raise ValueError(
            f"context of {context_tokens} tokens leaves no haystack around a {fixed}-token needle and question; "
            f"pass at least {fixed + 2 * len(noise)} tokens"
        )
    before = min(max(round(depth * repeats), 1), repeats - 1)  # whole paragraphs before the needle
    start = len(head) + before * len(noise)
    token_ids = head + noise * before + needle + noise * (repeats - before) + question
    return NiahPrompt(
        record_id=record_id or f"niah-s{seed}",
        seed=seed,
        depth=depth,
        key=key,
        answer=answer,
        token_ids=tuple(token_ids),
        needle_span=(start, start + len(needle)),
    )


def build_niah_suite(tokenizer: Tokenizer, num_prompts: int, context_tokens: int, seed: int) -> list[NiahPrompt]:
    """`num_prompts` prompts with seeds seed, seed + 1, ...; depths at the centres of equal slices of [0.1, 0.9]."""
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1 (got {num_prompts})")
    width = (MAX_DEPTH - MIN_DEPTH) / num_prompts
    return [
        build_niah_prompt(
            tokenizer, context_tokens, seed + i, MIN_DEPTH + (i + 0.5) * width, record_id=f"niah-{context_tokens}-s{seed + i}"
        )
        for i in range(num_prompts)
    ]
