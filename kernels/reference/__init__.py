"""Pure-torch reference of Locks (locks.md). Device-agnostic; fp32/fp64. Fast kernels are tested against it."""

from .attention import attend_pages, paged_decode_reference
from .packing import SummaryLayout, pack_summaries, quantize_summaries, unpack_summaries
from .score import exact_page_scores, summary_page_scores
from .select import combine_group, select_pages
from .selectors import make_scorer, scorer_names
from .summary import PageSummaries, build_page_summaries, reconstruct_keys

__all__ = [
    "PageSummaries",
    "SummaryLayout",
    "attend_pages",
    "build_page_summaries",
    "combine_group",
    "exact_page_scores",
    "make_scorer",
    "pack_summaries",
    "paged_decode_reference",
    "quantize_summaries",
    "reconstruct_keys",
    "scorer_names",
    "select_pages",
    "summary_page_scores",
    "unpack_summaries",
]
