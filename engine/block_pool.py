"""The pool of KV blocks: free list, ref counts and the prefix cache. No torch.

A block is either in use (ref_count > 0) or free. Free blocks wait in an LRU
queue: blocks without a hash at the front (reused first), freed cached blocks
at the back in the order they were freed, so the least recently used cached
block is evicted first. A freed cached block keeps its hash until it is
evicted, so a later request with the same prefix revives it.

A pool for a sliding-window model (`null_block=True`) sets block NULL_BLOCK aside: block tables
put it where a block behind every query's window was released. It is never handed out, referenced,
cached or written, and not counted as used.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.block_hash import NO_PARENT
from engine.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent

NULL_BLOCK = 0
"""The placeholder block id of a released block-table entry (only in a pool made with `null_block=True`)."""


@dataclass
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    """Set while the block is registered in the prefix cache."""
    token_ids: tuple[int, ...] | None = None
    """The block's tokens, compared on a hash hit (collision guard)."""


class BlockPool:
    """Fixed set of `num_blocks` blocks with ref counts and a hash -> block map."""

    def __init__(self, num_blocks: int, enable_caching: bool = True, null_block: bool = False) -> None:
        if num_blocks < 1 + null_block:
            raise ValueError(f"num_blocks must be >= {1 + null_block}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.num_reserved = int(null_block)
        """Blocks never handed out: 1 when NULL_BLOCK is set aside, else 0."""
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_reserved, num_blocks))
        self._cached: dict[int, int] = {}
        self.num_evictions = 0
        self.events: list[KVEvent] | None = None
        """When a list, every change of the prefix cache is appended to it (see kv_events)."""
        self.registered: list[tuple[int, int, int, tuple[int, ...]]] | None = None
        """When a list (KV tiers, engine/kv_offload/), every block entering the prefix cache is appended to it:
        (block id, hash, parent hash, token ids)."""

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_reserved - len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks sequences can hold (all but the null block)."""
        return self.num_blocks - self.num_reserved

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: int, token_ids) -> int | None:
        """Block id holding exactly these tokens under this hash, else None."""
        block_id = self._cached.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != tuple(token_ids):
            return None
        return block_id

    def allocate(self) -> int:
        """Take the front free block (evicting its cached hash) with ref_count 1."""
        if not self._free:
            raise MemoryError("no free KV blocks")
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.append(BlockRemoved(block.block_hash))
            block.block_hash = block.token_ids = None
            self.num_evictions += 1
        block.ref_count = 1
        return block_id

    def touch(self, block_id: int) -> None:
        """Add a reference (reviving the block from the free queue if needed)."""
        self._check_not_null(block_id)
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_id: int) -> None:
        """Drop a reference; at zero the block becomes free (kept cached if hashed)."""
        self._check_not_null(block_id)
        block = self.blocks[block_id]
        if block.ref_count <= 0:
            raise RuntimeError(f"block {block_id} released more often than referenced")
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block_id, last=False)

    def register(self, block_id: int, block_hash: int, token_ids, parent_hash: int = NO_PARENT) -> None:
        """Enter a full, computed block into the prefix cache (first one wins)."""
        self._check_not_null(block_id)
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
        if self.events is not None:
            self.events.append(BlockStored(block_hash, parent_hash))
        if self.registered is not None:
            self.registered.append((block_id, block_hash, parent_hash, block.token_ids))

    def enable_events(self) -> None:
        """Start recording prefix-cache events (no-op when already recording)."""
        if self.events is None:
            self.events = []

    def take_events(self) -> list[KVEvent]:
        """Events recorded since the last call, oldest first."""
        events = self.events or []
        if events:
            self.events = []
        return events

    def cached_hashes(self) -> list[int]:
        """Every hash in the prefix cache (a snapshot for routers that lost events)."""
        return list(self._cached)

    def is_free(self, block_id: int) -> bool:
        return self.blocks[block_id].ref_count == 0

    def is_null(self, block_id: int) -> bool:
        """True for the placeholder of a released block-table entry."""
        return self.num_reserved > 0 and block_id == NULL_BLOCK

    def _check_not_null(self, block_id: int) -> None:
        if self.is_null(block_id):
            raise RuntimeError("the null block is never referenced, released or cached")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = block.token_ids = None
        self._cached.clear()
        if self.events is not None:
            self.events.append(AllCleared())
        return True
