"""Prefix-cache events a worker publishes so routers can index what it holds.

The block pool records one event whenever a block enters the prefix cache
(`BlockStored`), leaves it (`BlockRemoved`, on eviction) or the whole cache is
forgotten (`AllCleared`). Hashes are the chained block hashes of
engine/block_hash.py, which the router computes for each prompt too.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.block_hash import NO_PARENT

MEDIA = ("device", "cpu", "disk")


@dataclass(frozen=True)
class BlockStored:
    block_hash: int
    parent_hash: int = NO_PARENT
    medium: str = "device"


@dataclass(frozen=True)
class BlockRemoved:
    block_hash: int
    medium: str = "device"


@dataclass(frozen=True)
class AllCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllCleared
