"""MATH / AIME answers: the last \\boxed{...} of a generation, and its equivalence with the reference.

The last `\\boxed{...}` (or `\\fbox{...}`) of the generation, braces matched, is compared to the
reference with `math_verify.verify(parse(gold), parse(prediction))` (gold first, as math-verify
requires); no boxed answer scores 0. When math-verify cannot parse the reference, an exact match
after whitespace removal decides. Nothing here knows tasks or instances (scorers.py imports it).
"""

from __future__ import annotations

from collections.abc import Sequence

INSTALL_HINT = "pip install 'locks-toolkit[suites]'   (or: pip install math-verify)"


class MathVerifyMissingError(ImportError):
    """math-verify is not installed; the message names the install command."""


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} in `text`, nested braces matched; None if absent or unclosed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    after = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if text.startswith(" ", after):  # "\boxed 5$" (no braces): up to the closing dollar
        return text[after:].split("$")[0].strip() or None
    if not text.startswith("{", after):
        return None
    brace = after
    depth = 0
    for position in range(brace, len(text)):
        if text[position] == "{":
            depth += 1
        elif text[position] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : position]
    return None


def _verify():
    try:
        from math_verify import parse, verify
    except ImportError as error:
        raise MathVerifyMissingError(f"MATH/AIME grading needs the PyPI package math-verify; {INSTALL_HINT}") from error
    return parse, verify


def is_equivalent(prediction: str, reference: str) -> bool:
    """math-verify equivalence of two bare LaTeX answers (no $ or \\boxed needed)."""
    parse, verify = _verify()
    gold = parse(f"${reference}$")
    if not gold:
        return "".join(prediction.split()) == "".join(reference.split())
    return bool(verify(gold, parse(f"${prediction}$")))


def boxed_equiv_score(generation: str, answers: Sequence[str]) -> float:
    predicted = last_boxed(generation)
    if predicted is None:
        return 0.0
    return float(any(is_equivalent(predicted, str(a)) for a in answers))
