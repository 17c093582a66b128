"""KV cache tiers behind the block pool: what the engine thread does with them.

Store: every block the pool registers in its prefix cache is copied down to
the host tier after the step that computed it (write-through, as vLLM's
offloading connector and LMCache do), by the I/O thread. The device block is
pinned (one extra reference) until its copy is made, so an eviction from the
pool costs nothing and loses nothing: the block is already below. At most
`max_store_blocks_per_step` blocks start down per step. A block the host tier
evicts is written to the disk tier (write-back: the disk sees only what the
host cannot hold) before its slot is reused (the I/O thread runs stores in
order); on close the host tier's blocks are written to disk too, so a restart
finds them.

Load: when a waiting request's prefix continues in a lower tier past its
device hit, the scheduler gives it blocks and `start_load` copies the lower
tiers' bytes into them, while the request waits in the loading state; `poll`
reports the loads that ended (how many leading blocks arrived; a disk block
that fails its checksum ends the load there and is forgotten).

Every change of a tier is a KV event with its medium ("cpu", "disk"), next to
the pool's own ("device"), so routers see where each block is.
"""
from __future__ import annotations

import logging
from collections import deque

from engine.kv_cache_manager import KVCacheManager
from engine.kv_events import BlockRemoved, BlockStored
from engine.kv_offload.config import OffloadConfig
from engine.kv_offload.disk_tier import DiskTier
from engine.kv_offload.host_tier import HostTier
from engine.kv_offload.pool_view import PoolView
from engine.kv_offload.tier_io import DiskWriteJob, LoadJob, StoreJob, TierIO
from engine.kv_offload.tier_stats import TierStats

logger = logging.getLogger(__name__)

JOB_BLOCKS = 16
"""Blocks per store or disk-write job: a load (which a request waits on) never queues behind more than that."""


class KVOffloader:
    def __init__(self, config: OffloadConfig, kv: KVCacheManager, shards, layout_key: str) -> None:
        self.config = config
        self.kv = kv
        self.pool = PoolView(shards)
        self.host = HostTier(config.cpu_bytes, self.pool.block_bytes, pin=self.pool.device.type == "cuda")
        self.disk = (DiskTier(config.disk_dir, config.disk_bytes, self.pool.block_bytes, kv.block_size, layout_key)
                     if config.disk_dir else None)
        self.tiers = [t for t in (self.host, self.disk) if t is not None]
        self.stats = {t.medium: TierStats(t.capacity_bytes) for t in self.tiers}
        self.io = TierIO(self.pool, self.host, self.disk)
        self._to_store: deque[tuple[int, int, int, tuple[int, ...]]] = deque()
        kv.pool.registered = []
        self.num_loading_blocks = 0
        self._jobs_out = 0
        """Jobs handed to the I/O thread and not yet processed by `poll`."""
        logger.info("KV tiers: host %d blocks%s", self.host.index.num_slots,
                    f", disk {self.disk.index.num_slots} blocks at {self.disk.path}" if self.disk else "")

    # ---- lookups and loads ----------------------------------------------
    def lookup(self, hashes: list[int], token_ids: list[int], start: int, end: int) -> list[tuple[object, int]]:
        """(tier, hash) of blocks start, start+1, ... (before `end`) found in a lower tier, up to the first miss.
        Counted in the tiers' hits and misses only when the load starts (`start_load`) or nothing is found
        (`count_lookup`), so a request retried while blocks are short is not counted again."""
        found, bs = [], self.kv.block_size
        for i in range(start, end):
            tokens = token_ids[i * bs:(i + 1) * bs]
            tier = next((t for t in self.tiers if t.index.get(hashes[i], tokens) is not None), None)
            if tier is None:
                break
            found.append((tier, hashes[i]))
        return found

    def count_lookup(self, found: list[tuple[object, int]], missed: bool) -> None:
        """Each found block was queried in the tiers above its own and hit there; a miss queried them all."""
        for tier, _ in found:
            for upper in self.tiers[:self.tiers.index(tier) + 1]:
                self.stats[upper.medium].queries += 1
            self.stats[tier.medium].hits += 1
        if missed:
            for tier in self.tiers:
                self.stats[tier.medium].queries += 1

    def can_load(self, num_blocks: int) -> bool:
        return not self.num_loading_blocks or self.num_loading_blocks + num_blocks <= self.config.max_loading_blocks

    def start_load(self, key: str, found: list[tuple[object, int]], block_ids: list[int], missed: bool) -> None:
        """Copy the `found` blocks into device blocks `block_ids` (reported by `poll` under `key`); `missed`: the
        lookup stopped at a block no tier holds."""
        self.count_lookup(found, missed)
        sources = [(tier, h, tier.index.pin(h).slot) for tier, h in found]
        self.num_loading_blocks += len(sources)
        self._submit(LoadJob(key, sources, list(block_ids), self.io.ready_event()), urgent=True)

    # ---- stores ---------------------------------------------------------
    def after_step(self) -> None:
        """Start copying down the blocks registered since the last call (within the step's budget)."""
        self._to_store.extend(self.kv.pool.registered)
        self.kv.pool.registered.clear()
        items, writes = [], []
        while self._to_store and len(items) < self.config.max_store_blocks_per_step:
            block_id, block_hash, parent, tokens = self._to_store[0]
            if self.kv.pool.blocks[block_id].block_hash != block_hash:  # evicted before its turn
                self._to_store.popleft()
                continue
            if block_hash in self.host.index:
                self.host.index.get(block_hash)
                self._to_store.popleft()
                continue
            placed = self.host.index.put(block_hash, parent, tokens)
            if placed is None:
                break  # every host slot is busy: later
            self._to_store.popleft()
            entry, evicted = placed
            self._announce_removed(self.host, [h for h, _ in evicted])
            writes.extend(self._to_disk(evicted))
            self.kv.pool.touch(block_id)
            items.append((block_id, block_hash, entry.slot))
        for i in range(0, len(writes), JOB_BLOCKS):  # before the stores that reuse their host slots
            self._submit(DiskWriteJob(writes[i:i + JOB_BLOCKS]))
        if items:
            event = self.io.ready_event()
            for i in range(0, len(items), JOB_BLOCKS):
                self._submit(StoreJob(items[i:i + JOB_BLOCKS], event))

    def _to_disk(self, evicted) -> list[tuple]:
        """Disk writes for blocks leaving the host tier (those not on disk yet, while the disk has room)."""
        writes = []
        for block_hash, entry in evicted:
            if self.disk is None or block_hash in self.disk.index:
                continue
            placed = self.disk.index.put(block_hash, entry.parent_hash, entry.token_ids)
            if placed is None:
                continue
            disk_entry, gone = placed
            self._announce_removed(self.disk, [h for h, _ in gone])
            writes.append((entry.slot, disk_entry.slot, block_hash, entry.parent_hash, entry.token_ids,
                           self.disk.next_seq()))
        return writes

    # ---- completions ----------------------------------------------------
    def poll(self) -> list[tuple[str, int]]:
        """Process the I/O thread's finished jobs; the loads among them as (key, blocks loaded)."""
        loads = []
        self.io.done_event.clear()
        while self.io.done:
            job = self.io.done.popleft()
            self._jobs_out -= 1
            if isinstance(job, StoreJob):
                self._stored_on_host(job)
            elif isinstance(job, DiskWriteJob):
                self._stored_on_disk(job)
            else:
                loads.append((job.key, self._loaded(job)))
        return loads

    def _stored_on_host(self, job: StoreJob) -> None:
        for block_id, block_hash, _ in job.items:
            self.kv.pool.release(block_id)
            if not job.ok:
                self.host.index.remove(block_hash)
                continue
            entry = self.host.index.mark_ready(block_hash)
            self.stats["cpu"].bytes_stored += self.pool.block_bytes
            self._announce(BlockStored(block_hash, entry.parent_hash, "cpu"))

    def _stored_on_disk(self, job: DiskWriteJob) -> None:
        for _, _, block_hash, parent, _, _ in job.items:
            if not job.ok:
                self.disk.index.remove(block_hash)
                continue
            self.disk.index.mark_ready(block_hash)
            self.stats["disk"].bytes_stored += self.pool.block_bytes
            self._announce(BlockStored(block_hash, parent, "disk"))

    def _loaded(self, job: LoadJob) -> int:
        self.num_loading_blocks -= len(job.sources)
        for i, (tier, block_hash, _) in enumerate(job.sources):
            tier.index.unpin(block_hash)
            if i < job.num_loaded:
                self.stats[tier.medium].bytes_loaded += self.pool.block_bytes
            elif i == job.num_loaded and tier.medium == "disk" and tier.index.remove(block_hash):
                self.stats["disk"].num_refused += 1  # failed its checksum: never offered again
                logger.warning("disk tier block %#x failed its checksum; dropped", block_hash)
                self._announce(BlockRemoved(block_hash, "disk"))
        for tier in {tier for tier, _, _ in job.sources}:
            self.stats[tier.medium].observe_load(job.seconds)
        return job.num_loaded

    def _submit(self, job, urgent: bool = False) -> None:
        self._jobs_out += 1
        self.io.submit(job, urgent)

    # ---- views ------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """True while blocks wait to be copied down or a job is out (the engine keeps stepping to finish them:
        pinned device blocks are released and disk writes queued only when `poll` sees their stores end)."""
        return bool(self._jobs_out or self._to_store)

    def wait(self, timeout: float) -> None:
        """Sleep until the I/O thread finishes a job (or `timeout` seconds)."""
        self.io.done_event.wait(timeout)

    def hashes_by_medium(self) -> dict[str, list[int]]:
        return {t.medium: t.index.hashes() for t in self.tiers}

    def snapshot_stats(self) -> dict[str, dict]:
        return {t.medium: self.stats[t.medium].snapshot(len(t.index) * self.pool.block_bytes) for t in self.tiers}

    def close(self) -> None:
        """Stop the I/O thread; write the host tier's blocks that are not on disk yet to it (most recently used
        last, so they are the last evicted after a restart); release the tiers."""
        self.io.stop()
        if self.disk is not None:
            ready = [(h, self.host.index.get(h)) for h in self.host.index.hashes()]
            for host_slot, disk_slot, block_hash, parent, tokens, seq in self._to_disk(ready):
                self.disk.write(disk_slot, block_hash, parent, tokens, seq, self.host.row(host_slot))
                self.disk.index.mark_ready(block_hash)
        for tier in self.tiers:
            tier.close()

    def _announce(self, event) -> None:
        if self.kv.pool.events is not None:
            self.kv.pool.events.append(event)

    def _announce_removed(self, tier, hashes: list[int]) -> None:
        for block_hash in hashes:
            self._announce(BlockRemoved(block_hash, tier.medium))
