"""What the engine tells the world about its KV: prefix-cache events, cached hashes per medium, block counts,
and the KV tiers below its pool (built here: engine/kv_offload/)."""
from __future__ import annotations


class KVViews:
    """Mixed into LLMEngine (which provides `kv`, `scheduler`, `runner`, `config` and `model_path`)."""

    def _start_kv_tiers(self) -> None:
        """Put the configured host/disk tiers behind the pool (a disk tier found again announces its blocks)."""
        offload = self.config.cache.offload
        if not offload.enabled:
            return
        from engine.kv_offload.layout_key import layout_key
        from engine.kv_offload.offloader import KVOffloader
        shards = self.runner.kv_shards()
        if len(shards) > 1 and self.runner.device.type == "cuda":
            # The I/O thread's copies wait for rank 0's stream only; the other GPUs' steps are not fenced.
            raise ValueError("KV offload tiers with tensor parallelism on CUDA are not supported yet")
        self.scheduler.offload = KVOffloader(offload, self.kv, shards,
                                             layout_key(self.model_path, shards, self.runner.kv_scales))

    def _stop_kv_tiers(self) -> None:
        if self.scheduler.offload is not None:
            self.scheduler.offload.close()
            self.scheduler.offload = None

    def enable_kv_events(self) -> None:
        """Start recording prefix-cache events (taken with `take_kv_events`)."""
        self.kv.pool.enable_events()

    def take_kv_events(self) -> list:
        """Prefix-cache events since the last call, oldest first (engine/kv_events.py)."""
        return self.kv.pool.take_events()

    def cached_block_hashes(self) -> list[int]:
        """Hashes of the blocks in the device pool's prefix cache."""
        return self.kv.pool.cached_hashes()

    def offloaded_block_hashes(self) -> dict[str, list[int]]:
        """Hashes of the blocks in each lower tier, by medium ("cpu", "disk"); empty without tiers."""
        offload = self.scheduler.offload
        return offload.hashes_by_medium() if offload is not None else {}

    def kv_tier_stats(self) -> dict[str, dict]:
        """Per lower tier (by medium): capacity, use, hits, misses, bytes stored and loaded, load latencies."""
        offload = self.scheduler.offload
        return offload.snapshot_stats() if offload is not None else {}

    @property
    def num_kv_blocks_used(self) -> int:
        """Blocks held by requests or kept for transfers (free prefix-cache blocks excluded)."""
        return self.kv.pool.num_used_blocks

    @property
    def num_kv_blocks_total(self) -> int:
        return self.kv.pool.num_blocks
