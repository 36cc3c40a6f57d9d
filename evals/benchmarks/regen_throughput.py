"""Regeneration throughput: tokens/s of `distill`'s answering at each batch size, with in-flight refills and with
static batches, in one run.

    python -m amphista_jax.evals.benchmarks.regen_throughput [--model smollm2] [--batches 1 4 16 64 128 256]
        [--rows-per-batch 2] [--max-new-tokens 256] [--bucket 64] [--out runs/benchmarks]

The prompts are ShareGPT first turns (`amphista-jax fetch sharegpt`) whose chat-templated length falls in one
`--bucket` (so every batch size answers the same kind of prompt at one padded length), in file order,
`--rows-per-batch` x batch of them per batch size, greedy, up to `--max-new-tokens` each, stopping at the target's
stop tokens: what `amphista-jax distill` does. Both modes answer the same prompts with the same programs
(`train.distill.InFlight`): `refill` stops the decode loop once a few rows are done and starts the next prompts in
their rows while the others go on (`answer_in_flight`); `static` runs each batch until its last row stops. Every
program (the refill sizes and the decode loop) is compiled before the clock starts. Idle: the share of the decode
loop's row-steps (batch x steps) that produced no token (rows done and waiting; each answer's first token comes
from its prefill, not the loop). The whole run ends with its last rows draining (both modes alike), which weighs
more the fewer prompts each row answers; the steady columns stop at the last refill (static: every batch but the
last; refill: the phase where the queue still feeds the rows): the regime of a long job such as the 8,000-prompt
regeneration, where each bucket drains once. Writes `regen_throughput.json`
and `.md` to `--out`.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from amphista_jax.engine.decode_spec import DecodeSpec, bucket
from amphista_jax.evals.benchmarks.common import benchmark_parser, load_target, write_report
from amphista_jax.models.fetch import resolve_data
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.train.distill import (
    MIN_REFILL,
    Answering,
    InFlight,
    answer_in_flight,
    read_prompts,
    refill_wait,
)
from amphista_jax.trees.sampling import SamplingConfig


def bucket_prompts(model: str, count: int, length: int) -> list[Answering]:
    """The first `count` ShareGPT first turns whose chat-templated ids pad to `length` (`decode_spec.bucket`)."""
    tok = load_tokenizer(model)
    prompts, _ = read_prompts(resolve_data("sharegpt"))
    picked = []
    for key, text in prompts:
        ids = encode_prompt(tok, text, chat=bool(tok.chat_template))
        if bucket(len(ids)) == length:
            picked.append(Answering(key, text, ids))
            if len(picked) == count:
                return picked
    raise SystemExit(f"only {len(picked)} ShareGPT prompts pad to {length} tokens: lower --rows-per-batch or pick "
                     "another --bucket")


def warm(rows: InFlight) -> None:
    """Compile every program `rows` can run: each refill size and the decode loop (run for zero steps)."""
    r = min(rows.batch, rows.min_refill)
    while True:
        rows.refill(list(range(r)), [[0]] * r)
        if r == rows.batch:
            break
        r = min(rows.batch, 2 * r)
    rows.run(0)


class Marked(InFlight):
    """`InFlight` that notes, at each refill, the clock, the tokens decoded so far (finished answers and the live
    rows' answers so far) and the loop's row-steps: at the last refill they measure the steady phase, before the
    queue runs dry and the last rows drain."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.start, self.finished, self.mark = time.perf_counter(), 0, (0.0, 0, 0)

    def refill(self, slots: list[int], contexts: list[list[int]]) -> None:
        done, counts = np.asarray(self.state.done), np.asarray(self.state.num_tokens)
        live = int(np.maximum(counts[~done] - 1, 0).sum())  # each answer's first token comes from its prefill
        self.mark = (time.perf_counter() - self.start, self.finished + live, self.row_steps)
        super().refill(slots, contexts)


def answer(params: dict, spec: DecodeSpec, prompts: list[Answering], batch: int, length: int, refill: bool) -> dict:
    """Answer `prompts` at `batch` rows (`refill`: in-flight, else static batches): time and idle share, whole and
    in the steady phase (up to the last refill)."""
    warm(InFlight(params, spec, batch, length, jax.random.key(0), MIN_REFILL))
    rows = Marked(params, spec, batch, length, jax.random.key(0), MIN_REFILL)
    todo = [Answering(a.key, a.prompt, a.ids) for a in prompts]
    rows.start = time.perf_counter()
    for a in answer_in_flight(todo, rows, refill, refill_wait(batch)):
        rows.finished += len(a.answer) - 1
    seconds = time.perf_counter() - rows.start
    tokens = sum(len(a.answer) for a in todo)
    at, decoded, row_steps = rows.mark
    return {"batch": batch, "mode": "refill" if refill else "static", "prompts": len(prompts), "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "idle": 1 - rows.finished / max(rows.row_steps, 1),
            "steady_s": at, "steady_tokens_per_s": decoded / at if at else None,
            "steady_idle": 1 - decoded / row_steps if row_steps else None,
            "answers": {a.key: a.answer for a in todo}}


def _gain(row: dict, key: str) -> str:
    return f"{row[key]:.2f}x" if key in row else "-"


def _num(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def main(argv: list[str] | None = None) -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 128, 256])
    parser.add_argument("--rows-per-batch", type=int, default=2, help="prompts answered per batch row")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--bucket", type=int, default=64, help="the prompts' padded length (a power of two)")
    args = parser.parse_args(argv)
    model, params, config = load_target(args.model or "smollm2")
    tok = load_tokenizer(model)
    spec = DecodeSpec(config, None, None, args.max_new_tokens, SamplingConfig(0.0),
                      eos_ids=stop_token_ids(model, tok, config), pad_id=config.pad_token_id or 0)
    prompts = bucket_prompts(model, args.rows_per_batch * max(args.batches), args.bucket)
    rows = []
    for batch in args.batches:
        mine = prompts[: args.rows_per_batch * batch]
        static, flight = (answer(params, spec, mine, batch, args.bucket, refill) for refill in (False, True))
        answers = static.pop("answers"), flight.pop("answers")
        flight["differing_answers"] = sum(answers[0][k] != answers[1][k] for k in answers[0])  # float rounding
        # between prefill batch shapes can flip a near-tie on some backends; 0 on this CPU (tests/test_distill.py)
        flight["gain"] = flight["tokens_per_s"] / static["tokens_per_s"]
        if flight["steady_tokens_per_s"] and static["steady_tokens_per_s"]:
            flight["steady_gain"] = flight["steady_tokens_per_s"] / static["steady_tokens_per_s"]
        rows += [static, flight]
        print(f"batch {batch}: static {static['tokens_per_s']:.1f} tokens/s ({static['idle']:.0%} idle), refill "
              f"{flight['tokens_per_s']:.1f} ({flight['idle']:.0%} idle): {flight['gain']:.2f}x; "
              f"{flight['differing_answers']} answers differ", flush=True)
    table = (f"SmolLM2 regeneration ({model}), ShareGPT prompts padded to {args.bucket} tokens, up to "
             f"{args.max_new_tokens} new tokens, greedy; {args.rows_per_batch} prompts per row; jax "
             f"{jax.__version__}. Steady: up to the last refill (static: every batch but the last; refill: until the "
             "queue runs dry), decoded tokens only\n\n"
             "| batch | mode | prompts | tokens | s | tokens/s | idle row-steps | gain | steady s | steady tokens/s | "
             "steady idle | steady gain |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    table += "".join(f"| {r['batch']} | {r['mode']} | {r['prompts']} | {r['tokens']} | {r['seconds']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['idle']:.1%} | {_gain(r, 'gain')} | {r['steady_s']:.1f} | "
                     f"{_num(r['steady_tokens_per_s'], '.1f')} | {_num(r['steady_idle'], '.1%')} | "
                     f"{_gain(r, 'steady_gain')} |\n" for r in rows)
    write_report(args.out, "regen_throughput", {"rows": rows, "args": vars(args)}, table)


if __name__ == "__main__":
    main()
