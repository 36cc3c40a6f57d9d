#!/bin/bash
# Round 9 of docs/results/smollm2, in the order it ran (issue 36, quiet machine): the shipped EAGLE-3 heads searched
# for a tree per batch size (1, 2, 4, 8, 16; `none` where AR is predicted faster), then one MT-Bench run per batch size
# (16 first-turn questions, 64 new tokens, T=0), each with AR, prompt lookup, Medusa on its small tree and its paper's,
# EAGLE-3 on its auto tree (the search's pick for that batch size) and its paper's, AR timed again at the end.
# (A first try searched at --max-nodes 12 for EAGLE-3 and then Medusa: the EAGLE-3 search died at its 46th of 50
# timings with LLVM's "Cannot allocate memory" (the memory-mapping limit; tree_search now releases compiled programs
# when crowded, as the evaluation runner does), and the session had no time left for both searches at that size.)
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
mkdir -p runs/smollm2/shipped
rm -rf runs/smollm2/shipped/eagle3 && cp -r amphista_jax/assets/smollm2-heads/eagle3 runs/smollm2/shipped/eagle3
amphista-jax tree-search --model smollm2 --heads runs/smollm2/shipped/eagle3 --tasks 100:108 --max-nodes 8 \
  --batch-sizes 1,2,4,8,16 --runs 2 --max-new-tokens 48 --replace > runs/ts-eagle3-batch.log 2>&1
date
E3=runs/smollm2/shipped/eagle3
MD=amphista_jax/assets/smollm2-heads/medusa
for B in 1 16 2 4 8; do  # batch 16 second: where the search switched speculation off
  amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set batch_size=$B \
    --set dataset.per_category=2 --set out_dir=runs/eval/mt-bench-smollm2-r9-b$B --methods ar \
    "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "medusa-63=$MD@mc_sim_7b_63" \
    "eagle-3-auto=$E3@auto" "eagle-3-paper=$E3@dynamic" "ar-end=ar" > runs/eval-r9-b$B.log 2>&1
  date
done
# (ran: batch 1 whole; batch 16 stopped for time in medusa-63 (the 63-node tree over 16 rows: no prompt done after
# 7 minutes), then batch 16 again without the papers' trees, below; batches 2, 4 and 8 not run: the session's end.)
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set batch_size=16 \
  --set dataset.per_category=2 --set out_dir=runs/eval/mt-bench-smollm2-r9-b16-small --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" "ar-end=ar" > runs/eval-r9-b16-small.log 2>&1
date
python -m amphista_jax.evals.benchmarks.batch_speedup --measured runs/eval/mt-bench-smollm2-r9-b1 \
  runs/eval/mt-bench-smollm2-r9-b16-small --predicted docs/roofline-batch-vicuna-7b.json \
  docs/roofline-batch-llama-3-8b.json --steps docs/gpu/step_time-llama-3-8b-h200.json --out docs
