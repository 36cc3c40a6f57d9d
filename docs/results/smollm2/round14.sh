#!/bin/bash
# Round 14 of docs/results/smollm2, in the order it ran (issue 34, quiet machine): the methods missing from rounds
# 12-13 retrained on the shared recipe (SAR, Hydra, Hydra++: their round 4-5 run directories were on another
# machine), SAR shipped (bf16, 4.4 MB), a tree searched on this CPU for each, then all 80 MT-Bench first turns at
# T=0 with them, EAGLE-3 on its searched tree (round 13's fastest), AR at both ends, SAR on its paper's chain of 4
# (the SAR paper decodes without tree attention) and Hydra++ on the papers' 63-node tree, interleaved prompt by prompt.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
# XLA's persistent compilation cache (compilation is never timed; this only saves the session's time)
export JAX_COMPILATION_CACHE_DIR=/tmp/r12-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
SR=amphista_jax/assets/smollm2-heads/sar
HY=runs/smollm2/hydra/heads
HP=runs/smollm2/hydra-plus/heads
E3=amphista_jax/assets/smollm2-heads/eagle3
search() {  # NAME HEADS: the tree searched for HEADS at batch 1 on this CPU
  amphista-jax tree-search --model smollm2 --heads "$2" --tasks 100:108 --max-nodes 12 --batch-sizes 1 --runs 2 \
    --max-new-tokens 48 > "runs/tree-search-$1-r14.log" 2>&1
}
date
amphista-jax train --config configs/sar/smollm2.yaml > runs/sar-train-r14.log 2>&1  # 826 s
amphista-jax convert --model smollm2 --heads runs/smollm2/sar/heads --out $SR --dtype bfloat16
amphista-jax train --config configs/hydra/smollm2.yaml > runs/hydra-train-r14.log 2>&1  # 1,438 s
date
search sar $SR
search hydra $HY
date
amphista-jax train --config configs/hydra/smollm2-plus.yaml > runs/hydra-plus-train-r14.log 2>&1
date
search hydra-plus $HP
date
# Stopped for session time at 55 of the 80 questions; the same command resumed it in the next session (20 minutes).
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.turns=1 \
  --set out_dir=runs/eval/mt-bench-smollm2-r14-t0 \
  --methods ar "sar-auto=$SR@auto" "hydra-auto=$HY@auto" "hydra-plus-auto=$HP@auto" "eagle-3-auto=$E3@auto" \
  "sar-4=$SR@chain-4" "ar-end=ar" "hydra-plus-63=$HP@mc_sim_7b_63" > runs/eval-r14-mt-t0.log 2>&1
date
# The papers' trees at T=1 on MT-Bench (24 first turns: 3 per category), AR timed first and last (next session)
H=amphista_jax/assets/smollm2-heads
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.turns=1 \
  --set dataset.per_category=3 --set temperature=1.0 --set out_dir=runs/eval/mt-bench-smollm2-r14-t1-paper \
  --methods ar "medusa-63=$H/medusa@mc_sim_7b_63" "amphista-63=$H/amphista@mc_sim_7b_63" \
  "eagle-3-paper=$H/eagle3@dynamic" "bita-paper=$H/bita@efficient-3x5" "sar-paper=$H/sar@chain-4" \
  "hydra-plus-63=$HP@mc_sim_7b_63" "ar-end=ar" > runs/eval-r14-mt-t1-paper.log 2>&1  # 29 minutes
date
# Hydra++ on chains of 1-4 nodes at T=0 (24 first turns): what a deeper draft buys against what its step costs
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.turns=1 \
  --set dataset.per_category=3 --set out_dir=runs/eval/mt-bench-smollm2-r14-t0-chains \
  --methods ar "hydra-plus-auto=$HP@auto" "hydra-plus-2=$HP@chain-2" "hydra-plus-3=$HP@chain-3" \
  "hydra-plus-4=$HP@chain-4" "ar-end=ar" > runs/eval-r14-mt-t0-chains.log 2>&1  # 11 minutes
date
