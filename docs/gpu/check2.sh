#!/usr/bin/env bash
# The second device call (after check.sh): what the first cut short or found. Same set-up as check.sh.
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
exec > >(tee -a "$OUT/run.log") 2>&1
start=$(date +%s)
stamp() { echo "=== $1 at $(( $(date +%s) - start )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . || exit 1
stamp "which input breaks the kernel"
timeout 40 python3 docs/gpu/head_dim_diag.py 2>&1 | grep -v Warn
stamp "pallas tests"
timeout 60 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_tree_attention.py -k "Device or refuses" 2>&1 | tail -6
stamp "decode loop on the GPU: lossless and sampling tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE -n 8 tests/test_speculative.py tests/test_prompt_lookup.py \
  tests/test_eagle3.py tests/test_generator.py 2>&1 | grep -v -i "benchmark\|warner" | tail -12
stamp "step times, LLaMA-3-8B shape, bf16, batch 64"
timeout 100 python3 -m amphista_jax.evals.benchmarks.step_time --target llama-3-8b --dtype bfloat16 --layout stacked \
  --context 512 --batch 64 --methods eagle3 medusa prompt_lookup --trees chain-3 dynamic --new-tokens 32 \
  --runs 3 --out "$OUT/step-llama-3-8b-b64" 2>&1 | tr '\r' '\n' | grep -v "step/s" | tail -12
stamp "done"
