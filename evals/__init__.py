"""Evaluation, installed as `amphista_jax.evals` (the folder is `evals/`).

The acceptance-length harness (`runner`: AR and every method on identical prompts, resumable, multi-process
with `launch_local`), its datasets, metrics, report and per-head accuracy, the target's quality check, and the
speed benchmarks (`benchmarks`). It builds on the library (`amphista_jax.*`) and is used by the CLI; the library
never imports it.
"""
