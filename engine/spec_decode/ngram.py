"""Prompt lookup (vLLM's `ngram` method): no model, the sequence proposes its own continuation.

The last n tokens of prompt + output (n from ngram_max down to ngram_min) are looked up in the earlier
tokens; at the first (earliest) match, the K tokens that followed it are proposed.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from engine.request import Request


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """Up to k tokens following the earliest earlier occurrence of the longest matching suffix."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = len(tokens)
    if k < 1:
        return []
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        windows = sliding_window_view(tokens[:length - 1], n)  # starts 0 .. length-1-n: each has a successor
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[list[int]]:
        return [propose_ngram(r.all_token_ids, k, self.ngram_min, self.ngram_max)
                for r, k in zip(requests, max_tokens, strict=True)]

    def free(self, request_id: str) -> None:
        pass
