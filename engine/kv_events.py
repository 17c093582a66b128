"""Prefix-cache events a worker publishes so routers can index what it holds.

A worker keeps prefix blocks on up to three media (`MEDIA`, best first): its
device KV pool (`device`), host memory (`cpu`) and local disk (`disk`); a block
may sit on several at once (a device block with a host copy). One event is
recorded whenever a block enters a medium (`BlockStored`), leaves it
(`BlockRemoved`, on eviction from that medium) or the worker forgets every
block on every medium (`AllCleared`). The block pool emits device events only;
the lower tiers emit their own. Hashes are the chained block hashes of
engine/block_hash.py, which the router computes for each prompt too.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import NO_PARENT

MEDIA = ("device", "cpu", "disk")
"""Where a worker keeps prefix blocks, best (fastest to reuse) first."""


@dataclass(frozen=True)
class BlockStored:
    block_hash: int
    parent_hash: int = NO_PARENT
    medium: str = "device"
    """One of MEDIA: the medium the block entered."""


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: int
    medium: str = "device"
    """One of MEDIA: the medium the block left (it may still be held on another)."""


@dataclass(frozen=True)
class AllCleared:
    """Every block on every medium is forgotten."""


KVEvent = BlockStored | BlockRemoved | AllCleared
