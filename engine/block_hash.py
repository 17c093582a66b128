"""Chained hashes of full KV blocks: one function shared by workers and router.

hash(block i) = xxh64(parent hash || token ids of block i). Only full blocks are
hashed, so equal hashes mean equal prefixes up to and including that block.

A cache salt (tenant isolation, as vLLM's `cache_salt`) is mixed into the first
block only: hash(block 0) = xxh64(salt digest || token ids), where the digest is
a 16-byte BLAKE2b of the salt. Every later hash chains from it, so prompts with
different salts share no block hash, and the 16-byte prefix gives salted first
blocks a byte length no unsalted or chained block has. The empty salt is no salt.
"""
from __future__ import annotations

import hashlib
from array import array

import xxhash

NO_PARENT = -1
SALT_DIGEST_BYTES = 16


def salt_digest(salt: str) -> bytes:
    """What a non-empty salt contributes to its first block's hash."""
    return hashlib.blake2b(salt.encode("utf-8"), digest_size=SALT_DIGEST_BYTES, person=b"pdserve-salt").digest()


def hash_block(parent_hash: int, token_ids, salt: str = "") -> int:
    """Hash one full block given its parent's hash (NO_PARENT for the first, which alone takes `salt`)."""
    h = xxhash.xxh64()
    if parent_hash != NO_PARENT:
        h.update(parent_hash.to_bytes(8, "little"))
    elif salt:
        h.update(salt_digest(salt))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def hash_full_blocks(token_ids, block_size: int, known: list[int] | None = None, salt: str = "") -> list[int]:
    """Hashes of every full block of `token_ids`, extending `known` (a prefix of them, hashed with the
    same salt)."""
    hashes = list(known) if known else []
    parent = hashes[-1] if hashes else NO_PARENT
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes
