#!/bin/bash
# Round 10 of docs/results/smollm2, in the order it ran (issue 36, quiet machine): round 9's MT-Bench runs at the batch
# sizes it did not reach (2, 4, 8; 16 first-turn questions, 64 new tokens, T=0), each with AR, prompt lookup, Medusa
# on its small tree, EAGLE-3 on its auto tree (the shipped per-batch policy: the tree searched for that batch size),
# AR timed again, and then the papers' trees (Medusa's 63 nodes, EAGLE-2's dynamic 60 for EAGLE-3: last, so a run cut
# for time still holds AR at both ends); then T=1 at batch 4.
cd "$(dirname "$0")/../../.."  # the repository root
set -x
date
E3=amphista_jax/assets/smollm2-heads/eagle3
MD=amphista_jax/assets/smollm2-heads/medusa
for B in 2 4 8; do
  amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set batch_size=$B \
    --set dataset.per_category=2 --set out_dir=runs/eval/mt-bench-smollm2-r10-b$B --methods ar \
    "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" "ar-end=ar" \
    "medusa-63=$MD@mc_sim_7b_63" "eagle-3-paper=$E3@dynamic" > runs/eval-r10-b$B.log 2>&1
  date
done
amphista-jax eval --config configs/eval/mt-bench-smollm2.yaml --set heldout_batches=0 --set batch_size=4 \
  --set temperature=1.0 --set dataset.per_category=2 --set out_dir=runs/eval/mt-bench-smollm2-r10-b4-t1 --methods ar \
  "prompt-lookup=prompt_lookup@chain-4" "medusa-8=$MD@small-8" "eagle-3-auto=$E3@auto" "ar-end=ar" \
  > runs/eval-r10-b4-t1.log 2>&1
date
# (Tests of this round's code changes ran on one core beside the batch-2 run's two papers'-tree rows, the last ones of
# that run, and the first minute of batch 4's AR row.)
# Then prompt lookup's fans (several matches with distinct next tokens, new this round) next to its chain and the
# shipped heads, on the task whose answer repeats the prompt (code editing, 12 HumanEval solutions rewritten with type
# hints) and on HumanEval (12 first tasks, for the session's time), T=0, batch 1, each in one run with AR timed at both ends.
E2=amphista_jax/assets/smollm2-heads/eagle
PL=("prompt-lookup=prompt_lookup@chain-4" "prompt-lookup-fan-2x4=prompt_lookup@fan-2x4"
  "prompt-lookup-fan-3x3=prompt_lookup@fan-3x3")
amphista-jax eval --config configs/eval/code-edit-smollm2.yaml --set dataset.limit=12 \
  --set out_dir=runs/eval/code-edit-smollm2-r10 --methods ar "${PL[@]}" "medusa-8=$MD@small-8" \
  "eagle-3-auto=$E3@auto" "ar-end=ar" > runs/eval-r10-code-edit.log 2>&1
date
amphista-jax eval --config configs/eval/humaneval-smollm2.yaml --set dataset.limit=12 \
  --set out_dir=runs/eval/humaneval-smollm2-r10 \
  --methods ar "${PL[@]}" "medusa-8=$MD@small-8" "eagle-2-10=$E2@dynamic-10x4x4" "eagle-3-auto=$E3@auto" \
  "ar-end=ar" > runs/eval-r10-humaneval.log 2>&1
date
# Speed-up against batch size: round 9's batch 1 and 16 (its summaries are the JSON files kept in docs/results) with
# this round's batch 2, 4 and 8, and the accelerator predictions of earlier rounds.
for B in 1 16; do
  mkdir -p runs/eval/mt-bench-smollm2-r9-b$B
  cp docs/results/smollm2/mt-bench-r9-b$B.json runs/eval/mt-bench-smollm2-r9-b$B/summary.json
done
python -m amphista_jax.evals.benchmarks.batch_speedup --measured runs/eval/mt-bench-smollm2-r9-b1 \
  runs/eval/mt-bench-smollm2-r10-b2 runs/eval/mt-bench-smollm2-r10-b4 runs/eval/mt-bench-smollm2-r10-b8 \
  runs/eval/mt-bench-smollm2-r9-b16 --predicted docs/roofline-batch-vicuna-7b.json \
  docs/roofline-batch-llama-3-8b.json --steps docs/gpu/step_time-llama-3-8b-h200.json --out docs
