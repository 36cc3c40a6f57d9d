"""How good is a target model as a code model: held-out bits per byte and the share of looping completions.

    python -m amphista_jax.evals.target_quality --models amphista_jax/assets/code-llama [OTHER_MODEL_DIR ...]

* bits per byte (tokenizer-independent) on a package that is in no training source (default: pip's own code,
  tests and vendored packages left out, the first `--bpb-mb` MB in path-hash order), in windows of the
  context each model was pre-trained with;
* the share of greedy completions of the first `--tasks` HumanEval prompts (`--new-tokens` each) whose tail
  is a loop: some period p <= 32 tokens repeats over the last max(3p, 24) generated tokens.

Prints a markdown table and writes `target_quality.{json,md}` under `--out`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from amphista_jax.engine.decode import generate, pad_prompts
from amphista_jax.infra.output_lock import write_atomic
from amphista_jax.models.hf import load_params
from amphista_jax.models.llama import Transformer
from amphista_jax.models.tokenizer import encode_prompt, load_tokenizer, stop_token_ids
from amphista_jax.prompts import ends_in_loop, humaneval_prompts
from amphista_jax.train.corpus import package_texts, package_version
from amphista_jax.train.pretrain_target import bits_per_byte


def loop_share(params: dict, config: Any, tok: Any, model_dir: str | Path, tasks: int, new_tokens: int
               ) -> tuple[float, list[str]]:
    """(share of looping greedy completions, the completions) on HumanEval/0 .. HumanEval/tasks-1."""
    pad = config.pad_token_id or 0
    tokens, lengths = pad_prompts([encode_prompt(tok, p) for p in humaneval_prompts(0, tasks)], pad_id=pad)
    eos = stop_token_ids(model_dir, tok, config)
    out = generate(params, tokens, lengths, jax.random.key(0), config=config, max_new_tokens=new_tokens,
                   cache_size=tokens.shape[1] + new_tokens, eos_ids=eos, pad_id=pad)
    rows = [np.asarray(r[:n]) for r, n in zip(out.tokens, out.num_tokens, strict=True)]
    rows = [r[:-1] if len(r) and r[-1] in eos else r for r in rows]
    return float(np.mean([ends_in_loop(r) for r in rows])), [tok.decode(r) for r in rows]


def trained_seq_len(model_dir: str | Path, default: int = 256) -> int:
    """The context the model was pre-trained with (its recipe's `seq_len`), so bits/byte is scored inside it."""
    summary = Path(model_dir) / "training_summary.json"
    return json.loads(summary.read_text())["config"].get("seq_len", default) if summary.is_file() else default


def measure(model_dir: str | Path, package: str, bpb_mb: float, tasks: int, new_tokens: int) -> dict:
    params, config = load_params(model_dir, dtype="float32")
    tok = load_tokenizer(model_dir)
    texts = package_texts(package, int(bpb_mb * 2**20))
    seq_len = trained_seq_len(model_dir)
    bpb = bits_per_byte(Transformer(config), params, tok, texts, seq_len=seq_len, batch_size=16)
    share, completions = loop_share(params, config, tok, model_dir, tasks, new_tokens)
    return {"model": str(model_dir), "parameters": config.num_params,
            "bpb_package": f"{package} {package_version(package)}", "bpb_seq_len": seq_len,
            "bpb_bytes": sum(len(t.encode()) for t in texts), "bits_per_byte": round(bpb, 4),
            "loop_share": share, "loop_tasks": tasks, "new_tokens": new_tokens, "completions": completions}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", required=True, help="HF checkpoint directories")
    ap.add_argument("--package", default="pip", help="held-out package for bits per byte (in no training source)")
    ap.add_argument("--bpb-mb", type=float, default=0.5)
    ap.add_argument("--tasks", type=int, default=20)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--out", default="runs/target_quality")
    args = ap.parse_args(argv)
    results = [measure(m, args.package, args.bpb_mb, args.tasks, args.new_tokens) for m in args.models]
    table = ["| model | parameters | bits/byte on " + results[0]["bpb_package"] + " | looping completions |",
             "|---|---|---|---|"]
    table += [f"| {r['model']} | {r['parameters']:,} | {r['bits_per_byte']:.3f} | "
              f"{r['loop_share']:.0%} of {r['loop_tasks']} |" for r in results]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "target_quality.json", json.dumps(results, indent=1) + "\n")
    write_atomic(out / "target_quality.md", "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
