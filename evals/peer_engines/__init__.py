"""The reference packages' own generation loops (`tests/reference-packages.txt`), run on our target beside our
engine by `evals/benchmarks/peers.py`: medusa-llm's `medusa_generate`, eagle-llm's `eagenerate`, dflash's
`dflash_generate`. Each module wraps one loop as a side of that benchmark (`side(ids, max_new_tokens)` -> the new
token ids, the wall-clock seconds of the call, tau and the tokens committed by each verify step, read from the
loop's own acceptance variable) and names every fix the package needs to run here, in its docstring and as a
function of its own. torch and the packages are imported only here (`pip install -e ".[peers]"` and the packages'
install line). `llama_forks` holds the fixes the two forked Llamas (medusa-llm's, eagle-llm's) share.
"""

from __future__ import annotations


def count_steps(new_ids: list[int], accept: list[int], max_new_tokens: int, eos_id: int
                ) -> tuple[list[int], list[int]]:
    """(`new_ids` cut to `max_new_tokens` and after `eos_id` inclusive, the tokens each verify step commits within
    them): step i commits `accept[i] + 1` (its accepted drafts and the target's token) after the prefill's one, the
    last one counted cut to what is left, steps wholly past the cut dropped (for engines that decode past either)."""
    ids = list(new_ids[:max_new_tokens])
    if eos_id in ids:
        ids = ids[: ids.index(eos_id) + 1]
    lengths, have = [], min(len(ids), 1)
    for a in accept:
        if have >= len(ids):
            break
        lengths.append(min(a + 1, len(ids) - have))
        have += lengths[-1]
    if have != len(ids):
        raise ValueError(f"the engine's {len(accept)} steps commit {have} of its {len(ids)} tokens")
    return ids, lengths


def side_result(ids: list[int], seconds: float, accept_lengths: list[int], **extra: object) -> dict:
    """A side's call as the peers benchmark reads it: tau as ours counts it, (new tokens - the prefill's one) / verify
    steps (1.0 where the prefill's token was the whole answer)."""
    tau = (len(ids) - 1) / len(accept_lengths) if accept_lengths else 1.0
    return {"ids": ids, "seconds": seconds, "tau": tau, "accept_lengths": accept_lengths} | extra
