"""Tokens/s of our jitted AR generation vs `transformers` `generate()` (PyTorch, CPU) on the same model.

    python -m amphista_jax.evals.benchmarks.ar_decode [--sizes 20m 150m] [--new-tokens 128] [--runs 3] [--out DIR]

Each size is a random-init Llama built in `transformers`, saved as safetensors and loaded by our loader, so
both sides run identical weights in fp32. Batch 1, greedy, exactly `--new-tokens` tokens (no EOS). Our
compile + first call is excluded from timing and reported separately; both sides get one warm-up run.
Prints medians over `--runs` and the ratio; writes `ar_decode.json` and `ar_decode.md` to `--out`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import numpy as np

from amphista_jax.decode import generate, pad_prompts
from amphista_jax.evals.benchmarks.common import median_seconds, write_report
from amphista_jax.models.hf import load_params

SIZES = {  # name -> transformers LlamaConfig kwargs
    "20m": dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=4),
    "150m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2304, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}



def bench(size: str, new_tokens: int, runs: int, prompt_len: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**SIZES[size], max_position_embeddings=4096)).float().eval()
    n_params = sum(p.numel() for p in hf.parameters())
    prompt = np.random.RandomState(0).randint(3, SIZES[size]["vocab_size"], (1, prompt_len))
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        params, config = load_params(d, dtype="float32")
    tokens, lengths = pad_prompts(prompt.tolist())
    kw = dict(config=config, max_new_tokens=new_tokens, cache_size=tokens.shape[1] + new_tokens)
    t0 = time.perf_counter()
    ours_out = jax.block_until_ready(generate(params, tokens, lengths, jax.random.key(0), **kw))
    compile_s = time.perf_counter() - t0
    ours_s = median_seconds(
        lambda: jax.block_until_ready(generate(params, tokens, lengths, jax.random.key(0), **kw)), runs)

    pt_prompt = torch.tensor(prompt)
    mask = torch.ones_like(pt_prompt)

    def run_torch():
        with torch.no_grad():
            return hf.generate(pt_prompt, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, pad_token_id=0)

    torch_s = median_seconds(run_torch, runs)
    same = bool((run_torch().numpy()[0, prompt_len:] == np.asarray(ours_out.tokens[0])).all())
    return {"size": size, "parameters": n_params, "new_tokens": new_tokens, "runs": runs,
            "ours_tokens_per_s": new_tokens / ours_s, "torch_tokens_per_s": new_tokens / torch_s,
            "speedup_vs_torch": torch_s / ours_s, "ours_compile_s": compile_s, "same_tokens": same,
            "torch_threads": torch.get_num_threads(), "jax_backend": jax.default_backend()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--out", default="runs/benchmarks")
    args = parser.parse_args()
    rows = [bench(s, args.new_tokens, args.runs, args.prompt_len) for s in args.sizes]
    lines = ["| model | params | ours tok/s | transformers tok/s | ratio | compile s | same tokens |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| llama-{r['size']} | {r['parameters'] / 1e6:.1f}M | {r['ours_tokens_per_s']:.1f} | "
                     f"{r['torch_tokens_per_s']:.1f} | {r['speedup_vs_torch']:.2f}x | {r['ours_compile_s']:.1f} | "
                     f"{r['same_tokens']} |")
    write_report(args.out, "ar_decode", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
