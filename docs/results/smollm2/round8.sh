#!/bin/bash
# Round 8 of docs/results/smollm2, in the order it ran: the draft model made from the target trained (shared recipe),
# a tree searched for it, then every trained method in one run per temperature (MT-Bench first turns, 24 questions,
# 64 new tokens, batch 1) on a quiet machine, with EAGLE-3 on the reference's full recipe (round 7) on EAGLE-2's
# CPU budget and on its searched tree (shipped from this round, bf16), and the draft model on speculative sampling's chain of 4 and its searched tree.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
amphista-jax train --config configs/draft_model/smollm2.yaml > runs/smollm2/draft-model.log 2>&1 &
# while it trained: the full-recipe EAGLE-3 heads of round 7 shipped in bf16 (12 MB) with the tree searched for them
# (round 7, on the fp32 heads)
amphista-jax convert --model smollm2 --heads runs/smollm2/eagle3-full/heads --out amphista_jax/assets/smollm2-heads/eagle3
cp -r runs/smollm2/eagle3-full/heads/trees amphista_jax/assets/smollm2-heads/eagle3/
wait
date
DM=runs/smollm2/draft-model/heads
amphista-jax tree-search --model smollm2 --heads $DM --tasks 100:108 --max-nodes 12 --batch-sizes 1 --runs 2 \
  --max-new-tokens 48 > runs/ts-draft-model.log 2>&1
date
MD=amphista_jax/assets/smollm2-heads/medusa
EG=amphista_jax/assets/smollm2-heads/eagle
HY=runs/smollm2/hydra/heads
HP=runs/smollm2/hydra-plus/heads
AM=runs/smollm2/amphista/heads
E3F=amphista_jax/assets/smollm2-heads/eagle3
SA=runs/smollm2/sar/heads
GU=runs/smollm2/gumiho/heads
METHODS=(ar "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "hydra-8=$HY@small-8" "hydra++-8=$HP@small-8"
  "sar-8=$SA@small-8" "amphista-8=$AM@small-8" "eagle-2-10=$EG@dynamic-10x4x4" "eagle-3-full-10=$E3F@dynamic-10x4x4"
  "eagle-3-full-searched=$E3F@auto" "gumiho-18=$GU@dynamic-18x4x10" "draft-model-4=$DM@chain-4"
  "draft-model-searched=$DM@auto")
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 \
  --set out_dir=runs/eval/mt-bench-smollm2-r8-t0 --methods "${METHODS[@]}" > runs/eval-r8-t0.log 2>&1
date
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set temperature=1.0 \
  --set out_dir=runs/eval/mt-bench-smollm2-r8-t1 --methods "${METHODS[@]}" > runs/eval-r8-t1.log 2>&1
date
