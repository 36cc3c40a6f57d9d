#!/bin/bash
# Round 6 of docs/results/smollm2, in the order it ran: Gumiho trained (shared recipe), then every trained method
# in one run per temperature (MT-Bench first turns, 24 questions, 64 new tokens, batch 1), on a quiet machine.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
# Gumiho (configs/gumiho/smollm2.yaml), resumed from the checkpoint round 5's session left; it ran beside the test suite
amphista-jax train --config configs/gumiho/smollm2.yaml > runs/smollm2/gumiho.log 2>&1
date
MD=amphista_jax/assets/smollm2-heads/medusa
EG=amphista_jax/assets/smollm2-heads/eagle
HY=runs/smollm2/hydra/heads
HP=runs/smollm2/hydra-plus/heads
AM=runs/smollm2/amphista/heads
E3=runs/smollm2/eagle3/heads
SA=runs/smollm2/sar/heads
GU=runs/smollm2/gumiho/heads
METHODS=(ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "hydra-8=$HY@small-8" "hydra++-8=$HP@small-8"
  "sar-8=$SA@small-8" "amphista-8=$AM@small-8" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-10=$E3@dynamic-10x4x4"
  "gumiho-18=$GU@dynamic-18x4x10")
# Gumiho's smallest budget: 18 drafted nodes (its full-tree attention adds 16 nodes, so it needs more than 17), top-10
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=4 \
  --set out_dir=runs/eval/mt-bench-smollm2-r6-t0 --methods "${METHODS[@]}" > runs/eval-r6-t0.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set temperature=1.0 \
  --set out_dir=runs/eval/mt-bench-smollm2-r6-t1 --methods "${METHODS[@]}" > runs/eval-r6-t1.log 2>&1
date
