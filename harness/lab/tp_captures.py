"""The capture half of the TP check: per-rank capture results, and layer-0 page selections across TP sizes.

Each sparse engine records its decode captures and checks them on every rank
(ranks.rank_capture_check -> kernels/vllm_backend/capture_check.py). Layer 0's queries and keys come
straight from the TP-sharded projections of the same embeddings, so at a decode step whose token prefix
two runs share they differ by GEMM rounding only: selections may flip at near-ties, while a head-partition
or summary bug makes them part. Rank r of N holds KV heads [r Hkv/N, (r+1) Hkv/N) (vLLM's column-parallel
QKV split), so the ranks' selections concatenated in rank order line up with the TP=1 heads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

COMPARED_LAYER = 0


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two greedy decodes (None: equal over the shorter)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def capture_fault(name: str, per_rank: Sequence[dict] | None) -> str | None:
    """Why the per-rank capture results of run `name` do not pass (None: every rank passed)."""
    if not per_rank:
        return f"{name}: no capture results (the sparse engine ran without debug_capture_layers?)"
    for result in per_rank:
        rank = result.get("rank", "?")
        if result.get("error"):
            return f"{name} rank {rank}: capture check could not run: {result['error']}"
        if not result.get("pass"):
            return (f"{name} rank {rank}: capture check failed ({result.get('captures')} captures, max excess error "
                    f"{result.get('max_excess_error')} > atol {result.get('atol')}, or selection faults "
                    f"{result.get('selection_faults')}: {result.get('faults')})")
    return None


def _ranks_in_order(run: dict) -> list[dict]:
    """The run's per-rank capture results sorted by rank, checked against its rank facts."""
    captures, facts = run.get("captures"), run.get("ranks")
    name = f"{run.get('arm')} TP={run.get('tensor_parallel_size')}"
    if not captures or any(c.get("error") for c in captures):
        raise ValueError(f"{name}: capture results missing or failed on a rank")
    if not facts or any(f is None for f in facts):
        raise ValueError(f"{name}: rank facts unavailable, the head partition cannot be verified")
    by_rank = {c["rank"]: c for c in captures}
    heads = {f["rank"]: f["num_kv_heads"] for f in facts}
    if sorted(by_rank) != list(range(len(captures))) or set(heads) != set(by_rank):
        raise ValueError(f"{name}: ranks {sorted(by_rank)} of the captures do not match the rank facts {sorted(heads)}")
    if len(set(heads.values())) != 1:
        raise ValueError(f"{name}: ranks hold unequal KV head counts {heads}; the partition is not the even split")
    return [dict(by_rank[r], num_kv_heads=heads[r]) for r in sorted(by_rank)]


def _joined_steps(ordered: list[dict]) -> dict[int, tuple[list, list]]:
    """seq_len -> (per-KV-head selections, per-query-head q) of sequence 0, ranks concatenated in rank order.

    A step is kept only when every rank captured it; a rank whose head count disagrees with its facts raises.
    """
    per_rank = []
    for result in ordered:
        steps = {}
        for step in result["steps"]:
            selected = step["selected"][0]
            if len(selected) != result["num_kv_heads"]:
                raise ValueError(f"rank {result['rank']}: {len(selected)} KV heads in a capture, "
                                 f"{result['num_kv_heads']} in its rank facts")
            steps[step["seq_lens"][0]] = (selected, step["q"][0])
        per_rank.append(steps)
    common = set.intersection(*(set(steps) for steps in per_rank)) if per_rank else set()
    return {length: ([h for steps in per_rank for h in steps[length][0]], [h for steps in per_rank for h in steps[length][1]])
            for length in sorted(common)}


def compare_captures(reference: dict, other: dict, context: int) -> dict:
    """Layer-0 selections and queries of `other` (TP=N) vs `reference` (TP=1) per shared-prefix decode step.

    Runs are engine results (tokens, ranks, captures). The decode step with seq_len L is step
    i = L - context - 1 and reads generated tokens 0..i, so it is compared when those agree. Per
    (step, KV head) the page sets are compared: identical or not, and overlap |A & B| / max(|A|, |B|).
    """
    first = first_divergence(reference["tokens"], other["tokens"])
    result: dict = {"layer": COMPARED_LAYER, "shared_prefix_tokens": first, "compared_steps": [],
                    "selections": 0, "identical_fraction": None, "mean_page_overlap": None,
                    "min_page_overlap": None, "per_step_overlap": [], "max_abs_dq": None, "q_abs_max": None}
    try:
        ref_steps, other_steps = _joined_steps(_ranks_in_order(reference)), _joined_steps(_ranks_in_order(other))
    except ValueError as exc:
        return {**result, "error": str(exc)}
    overlaps, identical, dq, q_max = [], 0, 0.0, 0.0
    for length, (ref_heads, ref_q) in ref_steps.items():
        step = length - context - 1
        # step < 0: not a decode of the request (a warm-up batch the engine ran before it)
        if step < 0 or length not in other_steps or (first is not None and step >= first):
            continue
        other_heads, other_q = other_steps[length]
        if len(other_heads) != len(ref_heads) or len(other_q) != len(ref_q):
            return {**result, "error": f"decode step {step}: {len(other_heads)} KV heads / {len(other_q)} query heads "
                                       f"at TP={other.get('tensor_parallel_size')} vs {len(ref_heads)} / {len(ref_q)} at TP=1"}
        step_overlaps = []
        for a, b in zip(map(set, ref_heads), map(set, other_heads)):
            identical += a == b
            step_overlaps.append(len(a & b) / max(len(a), len(b), 1))
        overlaps += step_overlaps
        result["compared_steps"].append(step)
        result["per_step_overlap"].append(sum(step_overlaps) / len(step_overlaps))
        for qa, qb in zip(ref_q, other_q):
            dq = max(dq, max(abs(x - y) for x, y in zip(qa, qb)))
            q_max = max(q_max, max(abs(x) for x in qa))
    if overlaps:
        result.update(selections=len(overlaps), identical_fraction=identical / len(overlaps),
                      mean_page_overlap=sum(overlaps) / len(overlaps), min_page_overlap=min(overlaps),
                      max_abs_dq=dq if not math.isnan(dq) else math.inf, q_abs_max=q_max)
    return result


def without_queries(per_rank: Sequence[dict] | None) -> list[dict] | None:
    """Per-rank results with each step's q list dropped (its q_abs_max stays): the record stays small."""
    if per_rank is None:
        return None
    return [{**r, "steps": [{k: v for k, v in s.items() if k != "q"} for s in r.get("steps", [])]} for r in per_rank]
