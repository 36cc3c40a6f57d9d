#!/bin/bash
# Round 4 of docs/results/smollm2: Hydra trained on the shared recipe, measured with AR, prompt lookup, Medusa,
# Amphista and EAGLE-2 in one run per task and temperature (MT-Bench T=0, HumanEval T=0, MT-Bench T=1), on a quiet
# machine, after `amphista-jax train --config configs/hydra/smollm2.yaml`.
cd "$(dirname "$0")/../../.."  # the repository root
MD=amphista_jax/assets/smollm2-heads/medusa
EG=amphista_jax/assets/smollm2-heads/eagle
HY=runs/smollm2/hydra/heads
AM=runs/smollm2/amphista/heads
METHODS=(ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "hydra-8=$HY@small-8" "amphista-8=$AM@small-8" "eagle-2-10=$EG@dynamic-10x4x4")
set -x
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=4 --set out_dir=runs/eval/mt-bench-smollm2-r4-t0 \
  --methods "${METHODS[@]}" > runs/eval-r4-t0.log 2>&1
date
amphista-jax eval --config configs/eval/humaneval-smollm2.yaml --set dataset.limit=12 --set out_dir=runs/eval/humaneval-smollm2-r4-t0 \
  --methods "${METHODS[@]}" > runs/eval-r4-he.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set temperature=1.0 --set heldout_batches=0 --set out_dir=runs/eval/mt-bench-smollm2-r4-t1 \
  --methods "${METHODS[@]}" > runs/eval-r4-t1.log 2>&1
date
