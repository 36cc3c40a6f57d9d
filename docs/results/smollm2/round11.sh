#!/bin/bash
# Round 11 of docs/results/smollm2, in the order it ran (issue 34, quiet machine): the Amphista heads shipped for the
# real target (low-rank LM heads, rank 64: configs/amphista/smollm2.yaml), a tree searched for them, then all 80
# MT-Bench first turns (the papers' protocol: 10 per category, chat template, 64 new tokens, batch 1) with every
# shipped head set and prompt lookup, each on its searched or small tree and then on the papers' tree (last, so a run
# cut for time still holds AR at both ends); T=0, then T=1.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
amphista-jax train --config configs/amphista/smollm2.yaml  # resumed from step 483 of 600 (the run of stop 46)
amphista-jax convert --model smollm2 --heads runs/smollm2/amphista/heads --out amphista_jax/assets/smollm2-heads/amphista \
  --dtype bfloat16
AM=amphista_jax/assets/smollm2-heads/amphista
E3=amphista_jax/assets/smollm2-heads/eagle3
MD=amphista_jax/assets/smollm2-heads/medusa
amphista-jax tree-search --model smollm2 --heads $AM --tasks 100:108 --max-nodes 12 --batch-sizes 1 --runs 2 \
  --max-new-tokens 48 > runs/tree-search-amphista-r11.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.per_category=0 --set order=method \
  --set out_dir=runs/eval/mt-bench-smollm2-r11-t0 --methods ar "prompt-lookup=prompt_lookup@chain-4" \
  "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" "amphista-auto=$AM@auto" "amphista-8=$AM@small-8" "ar-end=ar" \
  "medusa-63=$MD@mc_sim_7b_63" "amphista-63=$AM@mc_sim_7b_63" "eagle-3-paper=$E3@dynamic" > runs/eval-r11-t0.log 2>&1
# (the test suite started beside it at medusa-63's first prompt; the run was stopped with SIGTERM at its second, for
# the session's time; the same command with the first 7 methods resumed it, found every prompt done and wrote the
# summary)
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set dataset.per_category=0 --set order=method \
  --set out_dir=runs/eval/mt-bench-smollm2-r11-t0 --methods ar "prompt-lookup=prompt_lookup@chain-4" \
  "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" "amphista-auto=$AM@auto" "amphista-8=$AM@small-8" "ar-end=ar"
date
# T=1, 24 questions (3 per category, both turns) for the session's time, every method interleaved prompt by prompt
# (`order: prompt`, now the config's), AR timed twice as before
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set temperature=1.0 \
  --set dataset.per_category=3 --set out_dir=runs/eval/mt-bench-smollm2-r11-t1 --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" "amphista-auto=$AM@auto" \
  "ar-end=ar" > runs/eval-r11-t1.log 2>&1  # stopped with SIGTERM after 17 of the 24 questions (time)
date
