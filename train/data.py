"""grain pipelines. Packed fixed-length sequences from token streams (pre-training, plain text/code)."""

from __future__ import annotations

from collections.abc import Sequence

import grain
import jax
import numpy as np


def pack_documents(docs: Sequence[Sequence[int]], eos_id: int, seq_len: int) -> np.ndarray:
    """Concatenate `doc + [eos]` for every doc and cut into `[N, seq_len + 1]` windows (the last partial
    window is dropped); consecutive windows share one boundary token so every position is a target once."""
    stream = np.concatenate([np.append(np.asarray(d, np.int32), eos_id) for d in docs])
    n = (len(stream) - 1) // seq_len
    if n == 0:
        raise ValueError(f"{len(stream)} tokens are too few for one sequence of {seq_len=} + 1")
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


def packed_dataset(windows: np.ndarray, batch_size: int, seed: int) -> grain.MapDataset:
    """Shuffled, repeated batches `[batch_size, seq_len + 1]` of this process's share of `windows`.

    Each JAX process reads a disjoint slice; the iterator's `get_state()` is JSON and resumes exactly.
    """
    ds = grain.MapDataset.source(windows)[jax.process_index()::jax.process_count()]
    return ds.shuffle(seed=seed).repeat().batch(batch_size, drop_remainder=True)
