"""The device pool's blocks as rows of bytes: what the tiers copy a block from and back into.

A block is every layer's K and V for its tokens. With tensor parallelism each
rank's cache holds some of the heads (`ModelRunner.kv_shards()`); a tier's row
is the shards' bytes of that block one after the other, so every rank's heads
come back to the rank that owns them.
"""
from __future__ import annotations

import torch


class PoolView:
    def __init__(self, shards: list[torch.Tensor]) -> None:
        self.shards = [s.view(s.shape[0], -1).view(torch.uint8) for s in shards]
        self.sizes = [s.shape[1] for s in self.shards]
        self.block_bytes = sum(self.sizes)
        self.device = shards[0].device

    def copy_out(self, block_id: int, row: torch.Tensor) -> None:
        """Block `block_id` of every shard into `row` (non-blocking on CUDA: the caller's stream orders it)."""
        offset = 0
        for shard, size in zip(self.shards, self.sizes, strict=True):
            row[offset:offset + size].copy_(shard[block_id], non_blocking=True)
            offset += size

    def copy_in(self, row: torch.Tensor, block_id: int) -> None:
        """`row` back into block `block_id` of every shard."""
        offset = 0
        for shard, size in zip(self.shards, self.sizes, strict=True):
            shard[block_id].copy_(row[offset:offset + size], non_blocking=True)
            offset += size
