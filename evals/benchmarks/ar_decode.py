"""Tokens/s of our jitted AR generation against this machine's memory roofline and `transformers` `generate()`.

    python -m amphista_jax.evals.benchmarks.ar_decode [--sizes 20m 150m 500m] [--model smollm2 DIR ...]
        [--dtypes float32 bfloat16] [--batches 1 4] [--layouts stacked split] [--new-tokens 128] [--runs 3] [--out DIR]

Each size is a random-init Llama built in `transformers`, saved as safetensors and loaded by our loader; each
`--model` is a real checkpoint (a Hugging Face directory or a registry name, `smollm2`, fetched on first use) that
both sides load from its files (`--sizes` then defaults to none). Greedy from the same random prompt ids, exactly
`--new-tokens` tokens per row (no EOS). Our compile + first call is excluded from timing and reported
separately; every side gets one warm-up run. Medians over `--runs`. Layouts (`hf.LAYOUTS`): `stacked`, the layers
on one leading axis run by a loop (training's layout), and `split`, one module per layer (`split_layers`:
decoding's default).

Roofline: a batch-B decode step must read every weight once, so at best it runs at `bandwidth / weight bytes`
steps/s, i.e. `B * bandwidth / weight bytes` tokens/s. `bandwidth` is measured here, in the same run: the
median rate of a jitted matrix-vector product over a 512 MiB fp32 matrix (far larger than any cache). Each row
reports our tokens/s as a share of that bound. `transformers` (PyTorch, fp32) runs the same weights
at every batch size, for comparison (the ratio column), and whether its tokens equal ours. Writes
`ar_decode.json` and `ar_decode.md` to `--out`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import itertools
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from amphista_jax.engine.decode import GenerateOutput, generate, pad_prompts
from amphista_jax.evals.benchmarks.common import SIZES, median_seconds, nbytes, write_report
from amphista_jax.models.config import ModelConfig
from amphista_jax.models.fetch import resolve_model
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


def bench(name: str, hf: Any, model_dir: str, dtypes: list[str], batches: list[int], layouts: list[str],
          new_tokens: int, runs: int, prompt_len: int, bandwidth: float) -> list[dict]:
    """The rows of one model: `hf` (`transformers`, fp32) and the same weights in `model_dir`, which we load."""
    n_params = sum(p.numel() for p in hf.parameters())
    prompts = np.random.RandomState(0).randint(3, hf.config.vocab_size, (max(batches), prompt_len))
    rows = []
    for dtype, batch, layout in itertools.product(dtypes, batches, layouts):
        params, config = load_params(model_dir, dtype=dtype, layout=layout)
        out, compile_s, ours_s = time_generate(params, config, prompts[:batch], new_tokens, runs)
        weight_bytes = nbytes(params)
        roofline = batch * bandwidth / weight_bytes  # tokens/s
        row = {"model": name, "parameters": n_params, "dtype": dtype, "batch": batch, "layout": layout,
               "new_tokens": new_tokens, "runs": runs, "weight_bytes": weight_bytes,
               "ours_tokens_per_s": batch * new_tokens / ours_s,
               "roofline_tokens_per_s": roofline, "roofline_share": batch * new_tokens / ours_s / roofline,
               "ours_compile_s": compile_s, "jax_backend": jax.default_backend()}
        if dtype == "float32" and layout == layouts[0]:
            row |= torch_row(hf, prompts[:batch], new_tokens, runs, np.asarray(out.tokens), ours_s)
        rows.append(row)
    return rows


def random_llama_rows(size: str, **kw: Any) -> list[dict]:
    """`bench` of a random-init Llama of `SIZES[size]`, saved as safetensors for our loader."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SIZES[size], max_position_embeddings=4096)).float().eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return bench(f"llama-{size}", hf, d, **kw)


def checkpoint_rows(model: str, **kw: Any) -> list[dict]:
    """`bench` of a real checkpoint: a Hugging Face directory or a registry name (fetched on first use)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model(model)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    return bench(model, hf, model_dir, **kw)


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


def torch_row(hf: Any, prompts: np.ndarray, new_tokens: int, runs: int, ours_tokens: np.ndarray, ours_s: float
              ) -> dict:
    """`transformers` on the same fp32 weights and prompts `[B, T]` (one length: no padding): tokens/s and whether
    its tokens equal ours (`ours_tokens [B, new_tokens]`) in every row."""
    import torch

    pt_prompts = torch.tensor(prompts)
    mask = torch.ones_like(pt_prompts)
    greedy = copy.deepcopy(hf.generation_config)  # exactly `new_tokens`, EOS a token like any other, as ours
    greedy.update(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=new_tokens, temperature=None,
                  top_p=None, top_k=None)

    def run_torch():
        with torch.no_grad():
            return hf.generate(pt_prompts, attention_mask=mask, generation_config=greedy)

    torch_s = median_seconds(run_torch, runs)
    same = bool((run_torch().numpy()[:, prompts.shape[1]:] == ours_tokens[:, :new_tokens]).all())
    return {"torch_tokens_per_s": len(prompts) * new_tokens / torch_s, "speedup_vs_torch": torch_s / ours_s,
            "same_tokens": same, "torch_threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=None, choices=list(SIZES),
                        help="random-init Llamas (default: all of them, or none with --model)")
    parser.add_argument("--model", nargs="+", default=[], help="real checkpoints: directories or registry names")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", default="runs/benchmarks")
    args = parser.parse_args()
    if importlib.util.find_spec("torch") is None:
        parser.exit(2, "ar_decode: error: this benchmark times transformers' own generate() beside ours, which needs "
                       "torch: pip install 'amphista-jax[bench]'\n")
    bandwidth = memory_bandwidth()
    ceilings = {(d, b): memory_bandwidth(d, b) for d in args.dtypes for b in args.batches}
    kw = dict(dtypes=args.dtypes, batches=args.batches, layouts=args.layouts, new_tokens=args.new_tokens,
              runs=args.runs, prompt_len=args.prompt_len, bandwidth=bandwidth)
    sizes = args.sizes if args.sizes is not None else ([] if args.model else list(SIZES))
    rows = [r for s in sizes for r in random_llama_rows(s, **kw)] + [r for m in args.model
                                                                      for r in checkpoint_rows(m, **kw)]
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
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:.1f}M | {r['dtype']} | {r['batch']} | "
                     f"{r['layout']} | {r['ours_tokens_per_s']:.1f} | {r['roofline_tokens_per_s']:.1f} | "
                     f"{r['roofline_share']:.0%} | {r['product_share']:.0%} | "
                     f"{torch_cells} | {r['ours_compile_s']:.1f} | {r.get('same_tokens', '-')} |")
    write_report(args.out, "ar_decode", {"bandwidth_bytes_per_s": bandwidth, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
