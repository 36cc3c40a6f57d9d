#!/bin/bash
# Round 12 of docs/results/smollm2, in the order it ran (issue 34, quiet machine): BiTA trained for the real target
# (configs/bita/smollm2.yaml) and shipped with a tree searched for it on this CPU, then the papers' protocol with
# every shipped head set and prompt lookup, each run interleaving its methods prompt by prompt (`order: prompt`)
# with AR timed at both ends: HumanEval's first 20 tasks at T=0 (each method on its CPU tree, then on the papers'
# tree) and T=1, then all 80 MT-Bench first turns at T=1 (T=0: round 11's run of both turns), then the demo.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
# XLA's persistent compilation cache, so the later runs reuse the earlier runs' programs (compilation is never timed)
export JAX_COMPILATION_CACHE_DIR=/tmp/r12-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
date
amphista-jax train --config configs/bita/smollm2.yaml > runs/bita-train.log 2>&1  # 120 steps, 2,747 s
amphista-jax convert --model smollm2 --heads runs/smollm2/bita/heads --out amphista_jax/assets/smollm2-heads/bita
AM=amphista_jax/assets/smollm2-heads/amphista
BT=amphista_jax/assets/smollm2-heads/bita
E3=amphista_jax/assets/smollm2-heads/eagle3
MD=amphista_jax/assets/smollm2-heads/medusa
EG=amphista_jax/assets/smollm2-heads/eagle
amphista-jax tree-search --model smollm2 --heads $BT --tasks 100:108 --max-nodes 8 --batch-sizes 1 --runs 2 \
  --max-new-tokens 48 > runs/tree-search-bita-r12.log 2>&1  # picked: no speculation at batch 1
date
PAPER_TREES=("medusa-63=$MD@mc_sim_7b_63" "amphista-63=$AM@mc_sim_7b_63" "eagle-3-paper=$E3@dynamic"
             "bita-paper=$BT@efficient-3x5")
# bita-auto decodes plainly here (its searched policy at batch 1 is no speculation): a third AR timing
amphista-jax eval --config configs/eval/humaneval-smollm2.yaml --set out_dir=runs/eval/humaneval-smollm2-r12-t0 \
  --methods ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" \
  "amphista-auto=$AM@auto" "bita-auto=$BT@auto" "ar-end=ar" "eagle-2-10=$EG@dynamic-10x4x4" "${PAPER_TREES[@]}" \
  > runs/eval-r12-he-t0.log 2>&1
date
# the later runs draft with BiTA on the one-node tree the search ranked first (predicted 0.90x)
CPU_TREES=(ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto"
           "amphista-auto=$AM@auto" "bita-1=$BT@chain-1" "ar-end=ar")
amphista-jax eval --config configs/eval/humaneval-smollm2.yaml --set out_dir=runs/eval/humaneval-smollm2-r12-t1 \
  --set temperature=1.0 --methods "${CPU_TREES[@]}" "eagle-2-10=$EG@dynamic-10x4x4" > runs/eval-r12-he-t1.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.turns=1 \
  --set temperature=1.0 --set out_dir=runs/eval/mt-bench-smollm2-r12-t1 --methods "${CPU_TREES[@]}" \
  > runs/eval-r12-mt-t1.log 2>&1
date
amphista-jax demo > runs/demo-r12.log 2>&1  # the real target, its default question and method
date
