"""Tier 2: evicted prefix blocks in host memory, one row of bytes per slot (pinned on CUDA hosts)."""
from __future__ import annotations

import logging

import torch

from engine.kv_offload.tier_index import TierIndex

logger = logging.getLogger(__name__)


class HostTier:
    medium = "cpu"

    def __init__(self, capacity_bytes: int, block_bytes: int, pin: bool) -> None:
        num_slots = capacity_bytes // block_bytes
        if num_slots < 1:
            raise ValueError(f"kv_offload_cpu_gib holds no block: {capacity_bytes} bytes < {block_bytes} per block")
        self.block_bytes = block_bytes
        self.index = TierIndex(num_slots)
        self.arena = torch.empty((num_slots, block_bytes), dtype=torch.uint8)
        self._pinned = pin and self._pin()

    def _pin(self) -> bool:
        """Page-lock the arena for DMA. Registered rather than allocated pinned: torch's pinned allocator
        rounds a request up to a power of two, which for a tier of tens of GiB is a lot of locked memory."""
        nbytes = self.arena.numel()
        error = torch.cuda.cudart().cudaHostRegister(self.arena.data_ptr(), nbytes, 0)
        if int(error) != 0:
            logger.warning("could not pin the %d-byte host KV tier (CUDA error %s): copies go through pageable "
                           "memory", nbytes, error)
            return False
        return True

    @property
    def capacity_bytes(self) -> int:
        return self.index.num_slots * self.block_bytes

    def row(self, slot: int) -> torch.Tensor:
        return self.arena[slot]

    def close(self) -> None:
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
            self._pinned = False
