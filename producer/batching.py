"""Token-budget batches over length-sorted samples.

Samples are sorted by length, longest first (an out-of-memory batch shows up at the start of a
run, not at 3 a.m.), ties broken by sample index so the cut is deterministic. A batch grows while
``rows x longest row`` stays within the token budget, so padding waste is at most the length
spread inside one batch, which sorting keeps small.
"""

from __future__ import annotations

import numpy as np

from hsx.errors import BadConfig


def cut_batches(lengths_N: np.ndarray, *, batch_tokens: int, max_batch_samples: int) -> list[np.ndarray]:
    """Group sample indices into batches.

    Args:
        lengths_N: int array [N], tokens per sample (sample i has index i).
        batch_tokens: budget per batch, counted as rows x longest row (padding included).
        max_batch_samples: most rows per batch.

    Returns:
        A list of int64 arrays of sample indices; every sample appears exactly once.

    Raises:
        BadConfig: a sample is longer than the budget (raise the budget or lower --max-length).
    """
    lengths_N = np.asarray(lengths_N, dtype=np.int64)
    if len(lengths_N) and int(lengths_N.max()) > batch_tokens:
        raise BadConfig(
            f"--batch-tokens {batch_tokens} is smaller than one sample of {int(lengths_N.max())} tokens: "
            f"set --batch-tokens >= --max-length"
        )
    order = np.lexsort((np.arange(len(lengths_N)), -lengths_N))
    batches: list[np.ndarray] = []
    start = 0
    while start < len(order):
        longest = int(lengths_N[order[start]])
        rows = min(max_batch_samples, max(1, batch_tokens // longest), len(order) - start)
        batches.append(order[start : start + rows].astype(np.int64))
        start += rows
    return batches


def padding_waste(lengths_N: np.ndarray, batches: list[np.ndarray]) -> float:
    """Fraction of padded tokens across all batches (0 = no padding)."""
    lengths_N = np.asarray(lengths_N)
    valid = sum(int(lengths_N[b].sum()) for b in batches)
    padded = sum(int(lengths_N[b].max()) * len(b) for b in batches)
    return 1.0 - valid / padded if padded else 0.0
