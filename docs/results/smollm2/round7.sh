#!/bin/bash
# Round 7 of docs/results/smollm2, in the order it ran: EAGLE-3 on the reference's full recipe (7 training-time-test
# steps, the shared recipe's 600 steps), a tree searched for it, then one MT-Bench run (T=0) with EAGLE-2 and the
# cut-recipe EAGLE-3 beside it, on a quiet machine (the rest of round 6's methods left out: time).
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
amphista-jax train --config configs/eagle3/smollm2-full.yaml > runs/smollm2/eagle3-full.log 2>&1
date
EG=amphista_jax/assets/smollm2-heads/eagle
E3=runs/smollm2/eagle3/heads
E3F=runs/smollm2/eagle3-full/heads
amphista-jax tree-search --model smollm2 --heads $E3F --tasks 100:108 --max-nodes 12 --batch-sizes 1 --runs 2 \
  --max-new-tokens 48 > runs/ts-eagle3-full.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=4 \
  --set out_dir=runs/eval/mt-bench-smollm2-r7-t0 --methods ar \
  "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4" "eagle-3-full-10=$E3F@dynamic-10x4x4" \
  "eagle-3-full-searched=$E3F@auto" > runs/eval-r7-t0.log 2>&1
date
