"""Prefix-cache arithmetic on token ids (pure Python): block keys and a selection's ideal hit ratio.

A prefix cache reuses whole blocks of `block_size` tokens, each keyed by its tokens and every
token before it, so only a run of leading full blocks can ever be reused.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

CLUSTER_BLOCK_SIZE = 16
"""Tokens per KV block of a pdserve cluster (the engine's default `block_size`)."""


def block_keys(token_ids: Sequence[int], block_size: int = CLUSTER_BLOCK_SIZE) -> list[int]:
    """One key per full block: a hash of the block's tokens chained to the previous block's key."""
    keys, key = [], 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        key = hash((key, tuple(token_ids[start:start + block_size])))
        keys.append(key)
    return keys


def cached_prefix_tokens(keys: Sequence[int], seen: set[int], block_size: int = CLUSTER_BLOCK_SIZE) -> int:
    """Tokens of the leading blocks whose keys are in `seen` (what a prefix cache holding them would reuse)."""
    n = 0
    while n < len(keys) and keys[n] in seen:
        n += 1
    return n * block_size


def ideal_prefix_hit_ratio(prompts: Iterable[Sequence[int]], block_size: int = CLUSTER_BLOCK_SIZE) -> float:
    """Tokens in blocks already seen in an earlier prompt / all prompt tokens, prompts taken in order.

    What an unbounded prefix cache shared by every request would reuse when the prompts arrive one
    after another (0.0 for no tokens)."""
    seen: set[int] = set()
    hits = total = 0
    for token_ids in prompts:
        keys = block_keys(token_ids, block_size)
        hits += cached_prefix_tokens(keys, seen, block_size)
        total += len(token_ids)
        seen.update(keys)
    return hits / total if total else 0.0
