"""Needle prompts: deterministic under a seed, and the needle's token span maps to the right pages."""

from __future__ import annotations

import re
import zlib

import pytest
from locks_toolkit.suites.niah import NEEDLE, NiahPrompt, build_niah_prompt, build_niah_suite


class WordTokenizer:
    """Words, punctuation and whitespace runs as tokens; ids from a CRC (stable across processes)."""

    bos_token_id = 2

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        pieces = re.findall(r"\w+|[^\w\s]|\s+", text)
        ids = [10 + zlib.crc32(piece.encode()) % 50_000 for piece in pieces]
        return ([self.bos_token_id] if add_special_tokens else []) + ids


TOKENIZER = WordTokenizer()


def test_same_seed_same_prompt_and_different_seed_different_needle():
    a = build_niah_prompt(TOKENIZER, 1500, seed=7)
    b = build_niah_prompt(TOKENIZER, 1500, seed=7)
    c = build_niah_prompt(TOKENIZER, 1500, seed=8)
    assert a == b
    assert (a.key, a.answer) != (c.key, c.answer)
    assert len(a.answer) == 7 and a.answer.isdigit()


@pytest.mark.parametrize("context_tokens", [300, 1000, 2345])
def test_length_is_close_to_the_request(context_tokens):
    prompt = build_niah_prompt(TOKENIZER, context_tokens, seed=1)
    noise_tokens = len(TOKENIZER.encode("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n", False))
    assert abs(prompt.num_tokens - context_tokens) <= noise_tokens
    assert prompt.token_ids[0] == TOKENIZER.bos_token_id


@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_needle_span_holds_exactly_the_needle_tokens_and_maps_to_its_pages(depth):
    prompt = build_niah_prompt(TOKENIZER, 2000, seed=3, depth=depth)
    start, end = prompt.needle_span
    needle_ids = TOKENIZER.encode(NEEDLE.format(key=prompt.key, value=prompt.answer), False)
    assert list(prompt.token_ids[start:end]) == needle_ids
    assert 0 < start and end < prompt.num_tokens  # haystack on both sides, even at depth 0 and 1
    pages = prompt.carrier_pages(16)
    assert pages == tuple(range(start // 16, (end - 1) // 16 + 1))
    for page in pages:  # every carrier page holds a needle token...
        assert any(start <= i < end for i in range(16 * page, 16 * page + 16))
    for page in (pages[0] - 1, pages[-1] + 1):  # ...and its neighbours hold none
        assert not any(start <= i < end for i in range(16 * page, 16 * page + 16))


def test_depth_orders_the_needle_position():
    starts = [build_niah_prompt(TOKENIZER, 3000, seed=5, depth=d).needle_span[0] for d in (0.1, 0.5, 0.9)]
    assert starts == sorted(starts) and len(set(starts)) == 3


def test_suite_spreads_depths_and_uses_consecutive_seeds():
    suite = build_niah_suite(TOKENIZER, 3, 1200, seed=10)
    assert [p.seed for p in suite] == [10, 11, 12]
    assert [round(p.depth, 4) for p in suite] == pytest.approx([0.2333, 0.5, 0.7667], abs=1e-4)
    assert len({p.record_id for p in suite}) == 3
    assert suite == build_niah_suite(TOKENIZER, 3, 1200, seed=10)


def test_answer_check():
    prompt = NiahPrompt("r", 0, 0.5, "calm-river", "7421935", (2, 3), (0, 1))
    assert prompt.is_correct(": 7421935.")
    assert prompt.is_correct(" 742 1935")  # digits split by whitespace still count
    assert not prompt.is_correct(": 742193")


def test_too_short_context_and_bad_depth_are_refused():
    with pytest.raises(ValueError, match="pass at least"):
        build_niah_prompt(TOKENIZER, 40, seed=0)
    with pytest.raises(ValueError, match="outside"):
        build_niah_prompt(TOKENIZER, 1000, seed=0, depth=1.5)
    with pytest.raises(ValueError, match="num_prompts"):
        build_niah_suite(TOKENIZER, 0, 1000, seed=0)
