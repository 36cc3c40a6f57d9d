#!/bin/bash
# Round 5 of docs/results/smollm2, in the order it ran
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
# EAGLE-3's draft vocabulary in the LLaMA-3-8B roofline (issue 35): the reference's 32000 of Llama 3's 128256 tokens,
# next to the full-vocabulary rows of the earlier run (those reproduce byte for byte)
python -m amphista_jax.evals.benchmarks.roofline --target llama-3-8b --batch 1 4 16 64 --runs eagle3@dynamic \
  "eagle3@dynamic#draft_vocab_size=32000" eagle3@chain-3 "eagle3@chain-3#draft_vocab_size=32000" eagle@dynamic \
  medusa@chain-4 prompt_lookup@chain-4 --tau 2 3 4 --out runs/roofline-llama3-dv
cp runs/roofline-llama3-dv/roofline.json docs/roofline-batch-llama-3-8b.json
cp runs/roofline-llama3-dv/roofline.md docs/roofline-batch-llama-3-8b.md
python -m amphista_jax.evals.benchmarks.batch_speedup --measured runs/eval/mt-bench-smollm2-r3-t0 \
  runs/eval/mt-bench-smollm2-b4 runs/eval/mt-bench-smollm2-b16 --predicted docs/roofline-batch-vicuna-7b.json \
  docs/roofline-batch-llama-3-8b.json --out docs
date
# Heads trained (shared recipe, base/smollm2-cpu.yaml)
amphista-jax train --config configs/hydra/smollm2-plus.yaml > runs/smollm2/hydra-plus.log 2>&1
