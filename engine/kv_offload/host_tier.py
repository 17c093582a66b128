"""Tier 2: evicted prefix blocks in host memory, one row of bytes per slot (pinned on CUDA hosts)."""
from __future__ import annotations

import torch

from engine.kv_offload.tier_index import TierIndex


class HostTier:
    medium = "cpu"

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool) -> None:
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"kv_offload_cpu_gib holds no block: {capacity_bytes} bytes < {block_bytes} per block")
        self.block_bytes = block_bytes
        self.index = TierIndex(num_slots)
        self.arena = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)

    @property
    def capacity_bytes(self) -> int:
        return self.index.num_slots * self.block_bytes

    def row(self, slot: int) -> torch.Tensor:
        return self.arena[slot]

    def close(self) -> None:
        pass
