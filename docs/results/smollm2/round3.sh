#!/bin/bash
# Round 3 of docs/results/smollm2, in the order it ran (quiet machine, after `amphista-jax train --config configs/eagle3/smollm2.yaml`)
cd "$(dirname "$0")/../../.."  # the repository root
E3=runs/smollm2/eagle3/heads
EG=amphista_jax/assets/smollm2-heads/eagle
AM=runs/smollm2/amphista/heads
set -x
date
amphista-jax tree-search --model smollm2 --heads $E3 --tasks 100:108 --max-nodes 12 --batch-sizes 1 --runs 2 --max-new-tokens 48 > runs/ts-eagle3.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set out_dir=runs/eval/mt-bench-smollm2-r3-t0 --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-4=$E3@chain-4" "eagle-3-10=$E3@dynamic-10x4x4" \
  "eagle-3-searched=$E3@auto" "amphista-8=$AM@small-8" > runs/eval-r3-t0.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set temperature=1.0 --set heldout_batches=0 --set out_dir=runs/eval/mt-bench-smollm2-r3-t1 --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4" "amphista-8=$AM@small-8" > runs/eval-r3-t1.log 2>&1
date
for B in 4 16; do
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set batch_size=$B --set dataset.per_category=2 --set out_dir=runs/eval/mt-bench-smollm2-b$B --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4" "amphista-8=$AM@small-8" > runs/eval-b$B.log 2>&1
date
done
amphista-jax eval --config configs/eval/code-edit-smollm2.yaml --set dataset.limit=8 --set out_dir=runs/eval/code-edit-smollm2-r3 --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4" "amphista-8=$AM@small-8" > runs/eval-code-edit.log 2>&1
date
