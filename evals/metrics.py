"""Evaluation metrics over per-prompt result records (docs/evaluation.md defines each one).

A record is one finished prompt of one method: `{"id", "category", "turns": [turn, ...]}` where each turn
has `new_tokens` (tokens generated, the prefill's first token and a final EOS included), `steps` (target
forward passes after the prefill), `accept_lengths` (tokens committed by each of those forwards) and
`wall_s` (seconds of the generate call: prefill + decoding, compilation excluded).

* tau = sum(new_tokens - 1) / sum(steps): tokens per decoding forward. The bonus token counts; the prefill
  forward and the token it produced do not. Exactly 1 for the AR baseline.
* tokens/s = sum(new_tokens) / sum(wall_s).
* speed-up = method tokens/s / AR tokens/s over the same prompts (those both have finished).
All are ratios of sums over the selected prompts (and their turns), not means of per-prompt ratios.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

Record = dict[str, Any]


def totals(records: Iterable[Record]) -> dict[str, float]:
    """Sums over every turn of `records`: prompts, turns, new_tokens, decode_tokens, steps, wall_s."""
    out = {"prompts": 0, "turns": 0, "new_tokens": 0, "decode_tokens": 0, "steps": 0, "wall_s": 0.0}
    for r in records:
        out["prompts"] += 1
        for t in r["turns"]:
            out["turns"] += 1
            out["new_tokens"] += t["new_tokens"]
            out["decode_tokens"] += t["new_tokens"] - 1
            out["steps"] += t["steps"]
            out["wall_s"] += t["wall_s"]
    return out


def rates(records: Iterable[Record]) -> dict[str, float | None]:
    """`totals` plus tau and tokens/s (None where the denominator is 0)."""
    s = totals(records)
    return s | {"tau": s["decode_tokens"] / s["steps"] if s["steps"] else None,
                "tokens_per_s": s["new_tokens"] / s["wall_s"] if s["wall_s"] else None}


def speedup(method: Iterable[Record], ar: Iterable[Record]) -> float | None:
    """tokens/s of `method` over tokens/s of `ar`, both over the prompts present in both."""
    method, ar = list(method), list(ar)
    common = {r["id"] for r in method} & {r["id"] for r in ar}
    m = rates(r for r in method if r["id"] in common)["tokens_per_s"]
    a = rates(r for r in ar if r["id"] in common)["tokens_per_s"]
    return m / a if m is not None and a else None


def breakdown(results: dict[str, list[Record]], ar_label: str) -> dict[str, dict[str, dict[str, Any]]]:
    """`{method: {category or "overall": rates + speedup}}`, categories in first-seen order."""
    categories = list(dict.fromkeys(r["category"] for recs in results.values() for r in recs))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for label, recs in results.items():
        rows = {}
        for cat in ["overall", *categories]:
            sel = [r for r in recs if cat == "overall" or r["category"] == cat]
            ar = [r for r in results.get(ar_label, []) if cat == "overall" or r["category"] == cat]
            if sel:
                rows[cat] = rates(sel) | {"speedup": speedup(sel, ar)}
        out[label] = rows
    return out


def lossless_mismatches(results: dict[str, list[Record]], ar_label: str) -> list[dict[str, Any]]:
    """Every (prompt, method) whose token ids differ from the AR baseline's, with the first differing turn and
    index (`index` = the shorter length when one output is a prefix of the other)."""
    ar = {r["id"]: r for r in results[ar_label]}
    out = []
    for label, recs in results.items():
        if label == ar_label:
            continue
        for r in recs:
            if r["id"] not in ar:
                continue
            for turn, (a, b) in enumerate(zip(ar[r["id"]]["turns"], r["turns"], strict=False)):
                if a["tokens"] != b["tokens"]:
                    index = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"], strict=False)) if x != y),
                                 min(len(a["tokens"]), len(b["tokens"])))
                    out.append({"id": r["id"], "method": label, "turn": turn, "index": index,
                                "ar_token": a["tokens"][index] if index < len(a["tokens"]) else None,
                                "method_token": b["tokens"][index] if index < len(b["tokens"]) else None})
                    break
            else:
                if len(r["turns"]) != len(ar[r["id"]]["turns"]):
                    out.append({"id": r["id"], "method": label, "turn": min(len(r["turns"]), len(ar[r["id"]]["turns"])),
                                "index": 0, "ar_token": None, "method_token": None})
    return out


def tree_statistics(records: Iterable[Record]) -> dict[str, Any] | None:
    """Summed `node_tries` / `node_hits` `[D][R]` over records, with the hit rate per (depth, rank) cell:
    P(head d's rank-r candidate is the target's token | the path to its parent was accepted)."""
    tries = hits = None
    for r in records:
        if r.get("node_tries") is None:
            continue
        if tries is None:
            tries = [[0] * len(row) for row in r["node_tries"]]
            hits = [[0] * len(row) for row in r["node_tries"]]
        for d, (tr, hr) in enumerate(zip(r["node_tries"], r["node_hits"], strict=True)):
            for k, (t, h) in enumerate(zip(tr, hr, strict=True)):
                tries[d][k] += t
                hits[d][k] += h
    if tries is None:
        return None
    rate = [[h / t if t else None for t, h in zip(tr, hr, strict=True)] for tr, hr in zip(tries, hits, strict=True)]
    return {"depth_rank_tries": tries, "depth_rank_hits": hits, "depth_rank_rate": rate,
            "note": "row d = depth d + 1 (head d), column r = the head's rank-r candidate"}
