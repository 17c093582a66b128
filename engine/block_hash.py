"""Chained hashes of full KV blocks: one function shared by workers and router.

hash(block i) = xxh64(parent hash || token ids of block i). Only full blocks are
hashed, so equal hashes mean equal prefixes up to and including that block.
"""
from __future__ import annotations

from array import array

import xxhash

NO_PARENT = -1


def hash_block(parent_hash: int, token_ids) -> int:
    """Hash one full block given its parent's hash (NO_PARENT for the first)."""
    h = xxhash.xxh64()
    if parent_hash != NO_PARENT:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def hash_full_blocks(token_ids, block_size: int, known: list[int] | None = None) -> list[int]:
    """Hashes of every full block of `token_ids`, extending `known` (a prefix of them)."""
    hashes = list(known) if known else []
    parent = hashes[-1] if hashes else NO_PARENT
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes
