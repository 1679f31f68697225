"""n-gram proposals (vLLM's "ngram", prompt lookup): the tokens that followed the last time the
sequence's own last n tokens occurred in it, for the longest n in [min_n, max_n] that occurred.
The most recent earlier occurrence is taken: the nearest context is the likeliest to repeat (an
edit of the code just quoted, a summary of the paragraph just read). No model, no state: the
worker holds every sequence's tokens, so the proposal costs one scan of them."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """Up to k proposed next tokens for a sequence of `tokens` (int array); empty when its last
    min_n tokens never occurred before."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        suffix = tokens[size - n:]
        # Windows that start early enough to be followed by at least one token before the suffix.
        windows = sliding_window_view(tokens[:size - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].copy()
    return tokens[:0].copy()
