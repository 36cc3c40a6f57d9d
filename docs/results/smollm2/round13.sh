#!/bin/bash
# Round 13 of docs/results/smollm2 (issue 34, quiet machine): all 80 MT-Bench first turns at T=0, the papers'
# protocol, in one run: the methods of configs/eval/mt-bench-smollm2.yaml (AR, prompt lookup, every
# shipped head set on its CPU tree, AR timed again, then the papers' trees) plus EAGLE-2 on its dynamic tree,
# interleaved prompt by prompt (`order: prompt`), so drift hits every method alike. The first try died at 718 of the
# 1040 (question, method) pairs with LLVM's "Cannot allocate memory" (the methods' compiled programs past the kernel's
# memory-mapping limit: fixed by commit 414488b); the same command then resumed from the 718.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
# XLA's persistent compilation cache (compilation is never timed; this only saves the session's time)
export JAX_COMPILATION_CACHE_DIR=/tmp/r12-jax-cache JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
H=amphista_jax/assets/smollm2-heads
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.turns=1 \
  --set out_dir=runs/eval/mt-bench-smollm2-r13-t0 \
  --methods ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$H/medusa@small-8" "eagle-3-auto=$H/eagle3@auto" \
  "amphista-auto=$H/amphista@auto" "bita-1=$H/bita@chain-1" "amphista-8=$H/amphista@small-8" \
  "eagle-2-10=$H/eagle@dynamic-10x4x4" "ar-end=ar" "medusa-63=$H/medusa@mc_sim_7b_63" \
  "amphista-63=$H/amphista@mc_sim_7b_63" "eagle-3-paper=$H/eagle3@dynamic" "bita-paper=$H/bita@efficient-3x5" \
  > runs/eval-r13-mt-t0.log 2>&1
date
# then the papers' trees at T=1 on HumanEval's first 20 tasks (round 12's T=1 run had only the CPU trees), with AR
# timed in the same run, first and last
amphista-jax eval --config configs/eval/humaneval-smollm2.yaml --set out_dir=runs/eval/humaneval-smollm2-r13-t1-paper \
  --set temperature=1.0 --methods ar "medusa-63=$H/medusa@mc_sim_7b_63" "amphista-63=$H/amphista@mc_sim_7b_63" \
  "eagle-3-paper=$H/eagle3@dynamic" "bita-paper=$H/bita@efficient-3x5" "ar-end=ar" > runs/eval-r13-he-t1-paper.log 2>&1
date
