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
amphista-jax train --config configs/sar/smollm2.yaml > runs/smollm2/sar.log 2>&1
date
# Quiet machine from here: AR against transformers and the roofline on the real target (issue 34's benchmark)
python -m amphista_jax.evals.benchmarks.ar_decode --model smollm2 --dtypes float32 --batches 1 4 --layouts split stacked \
  --new-tokens 64 --runs 3 --out runs/ar-decode-smollm2 > runs/ar-decode-smollm2.log 2>&1
date
# Every trained method in one run, MT-Bench T=0 (24 questions, 64 new tokens, batch 1)
MD=amphista_jax/assets/smollm2-heads/medusa
EG=amphista_jax/assets/smollm2-heads/eagle
HY=runs/smollm2/hydra/heads
HP=runs/smollm2/hydra-plus/heads
AM=runs/smollm2/amphista/heads
E3=runs/smollm2/eagle3/heads
SA=runs/smollm2/sar/heads
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=4 --set out_dir=runs/eval/mt-bench-smollm2-r5-t0 \
  --methods ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "hydra-8=$HY@small-8" "hydra++-8=$HP@small-8" \
  "sar-8=$SA@small-8" "amphista-8=$AM@small-8" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4" > runs/eval-r5-t0.log 2>&1
date
# Speed-up against batch size (issue 36): batch 2 and 8, the methods of the batch 4 and 16 runs (round 3)
for B in 2 8; do
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set batch_size=$B --set dataset.per_category=2 --set out_dir=runs/eval/mt-bench-smollm2-b$B --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4" "amphista-8=$AM@small-8" > runs/eval-b$B.log 2>&1
date
done
# (ran: batch 8 alone, at the end, after the resumed MT-Bench run below; batch 2 not run (time). Then:
# python -m amphista_jax.evals.benchmarks.batch_speedup --measured runs/eval/mt-bench-smollm2-r3-t0 \
#   runs/eval/mt-bench-smollm2-b4 runs/eval/mt-bench-smollm2-b8 runs/eval/mt-bench-smollm2-b16 \
#   --predicted docs/roofline-batch-vicuna-7b.json docs/roofline-batch-llama-3-8b.json --out docs The MT-Bench run died in its last method, eagle-3-10, with
# "LLVM compilation error: Cannot allocate memory" (the process's memory mappings past vm.max_map_count; fixed in
# evals/runner.py after it); the same command resumed it: 1 of eagle-3-10's 24 prompts had been kept, 23 ran.)
# Started in the session's last minutes, cut off when it ended (checkpoints every 100 steps in
# runs/smollm2/gumiho/checkpoints, gitignored, on that machine only); the same command resumes from the last one:
amphista-jax train --config configs/gumiho/smollm2.yaml > runs/smollm2/gumiho.log 2>&1
