"""Configuration of the KV cache tiers below the engine's block pool (engine/kv_offload/)."""
from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30


@dataclass
class OffloadConfig:
    cpu_bytes: int = field(default=0, metadata={
        "flag": "--kv-offload-cpu-gib", "unit": "GiB",
        "help": "KV tier 2: host memory (pinned on CUDA) keeping prefix blocks the pool evicts (0: off)"})
    """Tier 2: host memory for evicted prefix blocks (pinned on CUDA hosts); 0 turns the tiers off."""
    disk_dir: str | None = field(default=None, metadata={
        "flag": "--kv-offload-dir",
        "help": "KV tier 3: directory of a local-disk arena below the host tier, found again on restart"})
    """Tier 3: directory of the disk tier's arena file (an emptyDir or local NVMe); None: no disk tier."""
    disk_bytes: int = field(default=0, metadata={
        "flag": "--kv-offload-disk-gib", "unit": "GiB", "help": "size of the disk tier's arena"})
    """Size of the disk tier's arena (a sparse file: only written blocks take space)."""
    max_store_blocks_per_step: int = 256
    """Blocks copied down from the device pool per engine step at most; the rest wait for later steps."""
    max_loading_blocks: int = 1024
    """Blocks being loaded back into the device pool at once; requests past it wait their turn."""

    def __post_init__(self) -> None:
        if self.cpu_bytes < 0 or self.disk_bytes < 0:
            raise ValueError("kv offload sizes must be >= 0")
        if (self.disk_dir is None) != (self.disk_bytes == 0):
            raise ValueError("the disk tier needs both kv_offload_dir and kv_offload_disk_gib > 0")
        if self.disk_dir is not None and not self.cpu_bytes:
            raise ValueError("the disk tier sits below the host tier: give kv_offload_cpu_gib > 0 as well")
        if self.max_store_blocks_per_step < 1 or self.max_loading_blocks < 1:
            raise ValueError("max_store_blocks_per_step and max_loading_blocks must be >= 1")

    @property
    def enabled(self) -> bool:
        return self.cpu_bytes > 0
