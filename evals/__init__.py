"""Evaluation: benchmarks and (later) the acceptance-length harness."""
