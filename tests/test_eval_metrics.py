"""Evaluation metrics on hand-made step logs: exact tau, tokens/s, speed-up, breakdowns, lossless check."""

from __future__ import annotations

import pytest

from amphista_jax.evals.metrics import breakdown, lossless_mismatches, rates, speedup, tree_statistics


def turn(tokens, accept_lengths, wall_s):
    return {"tokens": tokens, "new_tokens": len(tokens), "steps": len(accept_lengths),
            "accept_lengths": accept_lengths, "wall_s": wall_s}


AR = [  # AR: one token per decoding forward; the prefill made the first token
    {"id": "p1", "category": "code", "turns": [turn([1, 2, 3, 4, 5, 6, 7], [1] * 6, 0.7)]},
    {"id": "p2", "category": "math",
     "turns": [turn([8, 9, 10], [1, 1], 0.3), turn([11, 12, 13, 14, 15], [1] * 4, 0.5)]},
]
SPEC = [
    {"id": "p1", "category": "code", "turns": [turn([1, 2, 3, 4, 5, 6, 7], [3, 3], 0.2)]},
    {"id": "p2", "category": "math", "turns": [turn([8, 9, 10], [2], 0.1), turn([11, 12, 13, 14, 15], [1, 3], 0.3)]},
]


def test_tau_tokens_per_second_and_speedup_exact():
    ar, spec = rates(AR), rates(SPEC)
    assert (ar["new_tokens"], ar["decode_tokens"], ar["steps"], ar["turns"]) == (15, 12, 12, 3)
    assert ar["tau"] == 1.0
    assert spec["steps"] == 5 and spec["tau"] == 12 / 5  # (7-1 + 3-1 + 5-1) / (2 + 1 + 2)
    assert ar["tokens_per_s"] == pytest.approx(15 / 1.5)
    assert spec["tokens_per_s"] == pytest.approx(15 / 0.6)
    assert speedup(SPEC, AR) == pytest.approx((15 / 0.6) / (15 / 1.5))  # = 2.5


def test_speedup_uses_only_prompts_both_methods_finished():
    assert speedup(SPEC[:1], AR) == pytest.approx((7 / 0.2) / (7 / 0.7))


def test_breakdown_per_category():
    table = breakdown({"ar": AR, "medusa": SPEC}, "ar")
    assert list(table["medusa"]) == ["overall", "code", "math"]
    assert table["medusa"]["code"]["tau"] == 6 / 2 and table["medusa"]["math"]["tau"] == 6 / 3
    assert table["medusa"]["math"]["speedup"] == pytest.approx((8 / 0.4) / (8 / 0.8))
    assert table["ar"]["overall"]["speedup"] == pytest.approx(1.0)


def test_tau_undefined_without_decoding_steps():
    one = [{"id": "x", "category": "-", "turns": [turn([2], [], 0.01)]}]  # first token was EOS
    assert rates(one)["tau"] is None and rates(one)["new_tokens"] == 1


def test_lossless_check_lists_every_mismatch():
    assert lossless_mismatches({"ar": AR, "medusa": SPEC}, "ar") == []
    wrong = [SPEC[0], {**SPEC[1], "turns": [SPEC[1]["turns"][0], turn([11, 12, 99, 14, 15], [1, 3], 0.3)]}]
    short = [{**SPEC[0], "turns": [turn([1, 2, 3], [2], 0.1)]}]
    got = lossless_mismatches({"ar": AR, "bad": wrong, "short": short}, "ar")
    assert got == [{"id": "p2", "method": "bad", "turn": 1, "index": 2, "ar_token": 13, "method_token": 99},
                   {"id": "p1", "method": "short", "turn": 0, "index": 3, "ar_token": 4, "method_token": None}]


def test_tree_statistics_sum_over_prompts():
    recs = [{"node_tries": [[4, 4], [2, 0]], "node_hits": [[2, 1], [1, 0]]},
            {"node_tries": [[3, 3], [1, 1]], "node_hits": [[1, 0], [1, 0]]}, {}]
    stats = tree_statistics(recs)
    assert stats["depth_rank_tries"] == [[7, 7], [3, 1]]
    assert stats["depth_rank_hits"] == [[3, 1], [2, 0]]
    assert stats["depth_rank_rate"] == [[3 / 7, 1 / 7], [2 / 3, 0.0]]
    assert tree_statistics([{}]) is None
