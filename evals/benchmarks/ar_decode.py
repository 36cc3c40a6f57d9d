"""Tokens/s of our jitted AR generation against this machine's memory roofline and `transformers` `generate()`.

    python -m amphista_jax.evals.benchmarks.ar_decode [--sizes 20m 150m 500m] [--dtypes float32 bfloat16]
        [--batches 1 4] [--layouts stacked split] [--new-tokens 128] [--runs 3] [--out DIR]

Each size is a random-init Llama built in `transformers`, saved as safetensors and loaded by our loader. Greedy,
exactly `--new-tokens` tokens per row (no EOS). Our compile + first call is excluded from timing and reported
separately; every side gets one warm-up run. Medians over `--runs`. Layouts (`hf.LAYOUTS`): `stacked`, the layers
on one leading axis run by a loop (training's layout), and `split`, one module per layer (`split_layers`:
decoding's default).

Roofline: a batch-B decode step must read every weight once, so at best it runs at `bandwidth / weight bytes`
steps/s, i.e. `B * bandwidth / weight bytes` tokens/s. `bandwidth` is measured here, in the same run: the
median rate of a jitted matrix-vector product over a 512 MiB fp32 matrix (far larger than any cache). Each row
reports our tokens/s as a share of that bound. `transformers` (PyTorch, fp32, batch 1) runs the same weights
for comparison. Writes `ar_decode.json` and `ar_decode.md` to `--out`.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.decode import GenerateOutput, generate, pad_prompts
from amphista_jax.evals.benchmarks.common import SIZES, median_seconds, nbytes, write_report
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.hf import LAYOUTS, load_params

BANDWIDTH_MATRIX = (16384, 8192)  # fp32: 512 MiB


def memory_bandwidth(dtype: str = "float32", rows: int = 1, runs: int = 10) -> float:
    """Weight bytes/s of a jitted product of `rows` activation rows with a `BANDWIDTH_MATRIX` of `dtype` (it
    reads the matrix once). fp32 with one row is the machine's bandwidth (the roofline); other dtypes and row
    counts give the ceiling XLA:CPU's own product kernel reaches for a decode step of that dtype and batch."""
    w = jax.random.normal(jax.random.key(0), BANDWIDTH_MATRIX, dtype)
    x = jnp.ones((rows, BANDWIDTH_MATRIX[0]), dtype)
    product = jax.jit(lambda x, w: x @ w)
    jax.block_until_ready(product(x, w))
    return w.nbytes / median_seconds(lambda: jax.block_until_ready(product(x, w)), runs)


def bench(size: str, dtypes: list[str], batches: list[int], layouts: list[str], new_tokens: int, runs: int,
          prompt_len: int, bandwidth: float) -> list[dict]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SIZES[size], max_position_embeddings=4096)).float().eval()
    n_params = sum(p.numel() for p in hf.parameters())
    prompts = np.random.RandomState(0).randint(3, SIZES[size]["vocab_size"], (max(batches), prompt_len))
    rows = []
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        for dtype, batch, layout in itertools.product(dtypes, batches, layouts):
            params, config = load_params(d, dtype=dtype, layout=layout)
            out, compile_s, ours_s = time_generate(params, config, prompts[:batch], new_tokens, runs)
            weight_bytes = nbytes(params)
            roofline = batch * bandwidth / weight_bytes  # tokens/s
            row = {"size": size, "parameters": n_params, "dtype": dtype, "batch": batch, "layout": layout,
                   "new_tokens": new_tokens, "runs": runs, "weight_bytes": weight_bytes,
                   "ours_tokens_per_s": batch * new_tokens / ours_s,
                   "roofline_tokens_per_s": roofline, "roofline_share": batch * new_tokens / ours_s / roofline,
                   "ours_compile_s": compile_s, "jax_backend": jax.default_backend()}
            if dtype == "float32" and batch == 1 and layout == layouts[0]:
                row |= torch_row(hf, prompts[:1], new_tokens, runs, np.asarray(out.tokens[0]), ours_s)
            rows.append(row)
    return rows


def time_generate(params: dict, config: ModelConfig, prompts: np.ndarray, new_tokens: int, runs: int
                  ) -> tuple[GenerateOutput, float, float]:
    """(output, compile + first call seconds, median seconds of a call) of our `generate` on `prompts [B, T]`
    (`params` in either layer layout)."""
    tokens, lengths = pad_prompts(prompts.tolist())
    kw = dict(config=config, max_new_tokens=new_tokens, cache_size=tokens.shape[1] + new_tokens)
    t0 = time.perf_counter()
    out = jax.block_until_ready(generate(params, tokens, lengths, jax.random.key(0), **kw))
    compile_s = time.perf_counter() - t0
    seconds = median_seconds(
        lambda: jax.block_until_ready(generate(params, tokens, lengths, jax.random.key(0), **kw)), runs)
    return out, compile_s, seconds


def torch_row(hf: Any, prompt: np.ndarray, new_tokens: int, runs: int, ours_tokens: np.ndarray, ours_s: float) -> dict:
    """`transformers` on the same fp32 weights and prompt (batch 1): tokens/s and whether its tokens equal ours."""
    import torch

    pt_prompt = torch.tensor(prompt)
    mask = torch.ones_like(pt_prompt)

    def run_torch():
        with torch.no_grad():
            return hf.generate(pt_prompt, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0)

    torch_s = median_seconds(run_torch, runs)
    same = bool((run_torch().numpy()[0, prompt.shape[1]:] == ours_tokens).all())
    return {"torch_tokens_per_s": new_tokens / torch_s, "speedup_vs_torch": torch_s / ours_s, "same_tokens": same,
            "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", default="runs/benchmarks")
    args = parser.parse_args()
    bandwidth = memory_bandwidth()
    ceilings = {(d, b): memory_bandwidth(d, b) for d in args.dtypes for b in args.batches}
    rows = [r for s in args.sizes for r in bench(s, args.dtypes, args.batches, args.layouts, args.new_tokens,
                                                  args.runs, args.prompt_len, bandwidth)]
    for r in rows:
        r["product_bytes_per_s"] = ceilings[r["dtype"], r["batch"]]
        r["product_share"] = r["ours_tokens_per_s"] / (r["batch"] * r["product_bytes_per_s"] / r["weight_bytes"])
    lines = [f"Measured memory bandwidth (fp32 matrix-vector product over 512 MiB): {bandwidth / 1e9:.1f} GB/s; "
             "roofline = batch x bandwidth / weight bytes. Product ceiling: weight bytes/s of XLA's product of "
             "`batch` rows with a 512 MiB-of-fp32 matrix in the row's dtype "
             + ", ".join(f"({d}, {b}): {v / 1e9:.1f} GB/s" for (d, b), v in ceilings.items())
             + "; product share = ours / (batch x product ceiling / weight bytes).", "",
             "| model | params | dtype | batch | layout | ours tok/s | roofline tok/s | share | product share | "
             "transformers tok/s | ratio | compile s | same tokens |", "|---" * 13 + "|"]
    for r in rows:
        torch_cells = (f"{r['torch_tokens_per_s']:.1f} | {r['speedup_vs_torch']:.2f}x" if "torch_tokens_per_s" in r
                       else "- | -")
        lines.append(f"| llama-{r['size']} | {r['parameters'] / 1e6:.1f}M | {r['dtype']} | {r['batch']} | "
                     f"{r['layout']} | {r['ours_tokens_per_s']:.1f} | {r['roofline_tokens_per_s']:.1f} | "
                     f"{r['roofline_share']:.0%} | {r['product_share']:.0%} | "
                     f"{torch_cells} | {r['ours_compile_s']:.1f} | {r.get('same_tokens', '-')} |")
    write_report(args.out, "ar_decode", {"bandwidth_bytes_per_s": bandwidth, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
