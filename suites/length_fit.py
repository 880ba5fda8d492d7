"""Fit prompts to a token length: an approximate token counter, a monotone search, middle truncation.

Lengths are in tokens of the engine's tokenizer, which the caller passes as `count_tokens(text) -> int`.
`approx_count_tokens` (one token per word or punctuation mark) stands in for tests and dry runs.
"""

from __future__ import annotations

import re
from collections.abc import Callable

CountTokens = Callable[[str], int]
_APPROX_TOKEN = re.compile(r"\w+|[^\w\s]")


class LengthError(ValueError):
    """The requested length cannot hold the task's fixed text; the message names the shortest length."""


def approx_count_tokens(text: str) -> int:
    """Approximate token count: words and punctuation marks (English BPE gives ~1.3x this)."""
    return len(_APPROX_TOKEN.findall(text))


def fit_largest(fits: Callable[[int], bool], *, lowest: int, highest: int, hint: int | None = None) -> int:
    """Largest n in [lowest, highest] with fits(n), assuming fits is monotone (true up to some n).

    Gallops from `hint` (e.g. the previous instance's answer) and then bisects, so a good hint costs
    O(log of the miss) calls. Returns lowest - 1 when not even `lowest` fits.
    """
    if highest < lowest:
        return lowest - 1
    start = min(max(hint if hint is not None else (lowest + highest) // 2, lowest), highest)
    step = max(1, (start - lowest) // 128 if hint is not None else (highest - lowest) // 256)
    if fits(start):
        good, bad = start, None
        while bad is None:
            probe = min(good + step, highest)
            if probe == good:
                return good
            if fits(probe):
                good, step = probe, step * 2
            else:
                bad = probe
    else:
        good, bad = None, start
        while good is None:
            probe = max(bad - step, lowest)
            if fits(probe):
                good = probe
            elif probe == lowest:
                return lowest - 1
            else:
                bad, step = probe, step * 2
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good


def middle_truncate(text: str, budget_tokens: int, count_tokens: CountTokens, render: Callable[[str], str]) -> str:
    """Keep the head and tail of `text` (equal characters each) so that count_tokens(render(kept)) <= budget.

    LongBench keeps the first and last max_length/2 tokens; with only a counter we cut characters
    and search the largest equal head/tail that fits, which matches it to within a token or two.
    """
    if count_tokens(render(text)) <= budget_tokens:
        return text
    half = len(text) // 2

    def keep(chars: int) -> str:
        return text[:chars] + text[len(text) - chars :] if chars else ""

    chars = fit_largest(lambda c: count_tokens(render(keep(c))) <= budget_tokens, lowest=0, highest=half)
    if chars < 0:
        raise LengthError(f"even with an empty context the prompt exceeds {budget_tokens} tokens; use a longer length")
    return keep(chars)
