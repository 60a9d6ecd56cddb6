"""N-gram drafting (prompt lookup): the tokens that followed the latest earlier occurrence of the
context's last n tokens, longest n first (vLLM's `ngram` method). Host side, numpy only.

    propose_ngram(np.array(prompt + output), k=4, min_n=2, max_n=5)   # -> up to k token ids
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """tokens [L] int: the context (prompt + output). For n = max_n .. min_n: the last n tokens'
    most recent earlier occurrence whose continuation exists; its next up to k tokens. [] if
    no n-gram recurs."""
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n :]
        windows = sliding_window_view(tokens[: L - 1], n)  # [L - n, n]: windows ending before the last token
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return [int(t) for t in tokens[start : start + k]]
    return []
