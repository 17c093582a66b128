"""Which worker holds which prefix blocks: fed only by the workers' KV events. No I/O.

Every worker gets a bit; the index maps a block hash to the bitmask of the
workers holding it. Because block hashes are chained (a hash stands for the
whole prefix up to its block), a worker can reuse a prompt's first k blocks
exactly when it holds hashes 0..k-1, so `overlap` walks the prompt's hashes and
narrows the mask until it empties.

Batches carry per-worker sequence numbers. `apply` refuses a batch that does
not follow the last one (events were lost) and marks the worker stale; its
blocks stay indexed (a slightly old view routes better than none) until the
caller resyncs it from a snapshot with `load_snapshot`.

Workers keep blocks on several media (engine/kv_events.py `MEDIA`: device, cpu,
disk). Per worker the index keeps, for each hash, a small bitmask of the media
holding it (bit i = MEDIA[i]); a block counts as held, in `_holders` and so in
`overlap`, while any medium holds it. `weighted_overlap` prices each held
block by its best medium (`best_media` counts them); `num_blocks` counts device
blocks only (how full the worker's KV pool is).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.kv_events import MEDIA, AllCleared, BlockRemoved, BlockStored, KVEvent

_MEDIUM_BIT = {m: 1 << i for i, m in enumerate(MEDIA)}
_DEVICE_BIT = _MEDIUM_BIT["device"]


@dataclass
class _WorkerBlocks:
    bit: int
    hashes: dict[int, int] = field(default_factory=dict)
    """Block hash -> bitmask of the media holding it (never 0). Holding only ints, CPython's
    garbage collector never scans it (a million-block index would otherwise stretch every full collection)."""
    counts: list[int] = field(default_factory=lambda: [0] * len(MEDIA))
    """Blocks held per medium, in MEDIA order."""
    seq: int = -1
    """Last batch applied; -1 until the first snapshot."""
    epoch: int = 0


class KvIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        self._workers: dict[str, _WorkerBlocks] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self.num_resyncs = 0

    # ---- workers --------------------------------------------------------
    def add_worker(self, worker: str) -> None:
        if worker in self._workers:
            return
        if self._free_bits:
            bit = self._free_bits.pop()
        else:
            bit, self._next_bit = self._next_bit, self._next_bit + 1
        self._workers[worker] = _WorkerBlocks(bit)

    def remove_worker(self, worker: str) -> None:
        entry = self._workers.pop(worker, None)
        if entry is None:
            return
        self._drop_all(entry)
        self._free_bits.append(entry.bit)

    def is_synced(self, worker: str) -> bool:
        entry = self._workers.get(worker)
        return entry is not None and entry.seq >= 0

    def mark_stale(self, worker: str) -> None:
        """Distrust what is known of `worker` past its last snapshot: the next batch resyncs."""
        entry = self._workers.get(worker)
        if entry is not None:
            entry.seq = -1

    def seq(self, worker: str) -> int:
        return self._workers[worker].seq

    @property
    def workers(self) -> list[str]:
        return list(self._workers)

    def num_blocks(self, worker: str) -> int:
        """Blocks `worker` holds on its device (how full its KV pool is); lower tiers not counted."""
        entry = self._workers.get(worker)
        return entry.counts[0] if entry else 0

    def num_blocks_by_medium(self, worker: str) -> dict[str, int]:
        entry = self._workers.get(worker)
        return dict(zip(MEDIA, entry.counts if entry else [0] * len(MEDIA), strict=True))

    # ---- feeding --------------------------------------------------------
    def load_snapshot(self, worker: str, seq: int, blocks: Iterable[tuple[int, str]], epoch: int = 0) -> None:
        """Replace what is known of `worker` by its whole prefix cache as of batch `seq`: one
        (block hash, medium) pair per block and medium holding it; unknown media are ignored."""
        self.add_worker(worker)
        entry = self._workers[worker]
        self._drop_all(entry)
        for block_hash, medium in blocks:
            self._store(entry, block_hash, medium)
        entry.seq = seq
        entry.epoch = epoch
        self.num_resyncs += 1

    def apply(self, worker: str, seq: int, events: list[KVEvent], epoch: int = 0) -> bool:
        """Apply batch `seq`; False (nothing applied, worker marked stale) unless it is the next one."""
        entry = self._workers.get(worker)
        if entry is None or entry.seq < 0:
            return False
        if seq <= entry.seq and epoch == entry.epoch:
            return True  # already covered by the snapshot
        if seq != entry.seq + 1 or epoch != entry.epoch:
            entry.seq = -1
            return False
        for event in events:
            if isinstance(event, BlockStored):
                self._store(entry, event.block_hash, event.medium)
            elif isinstance(event, BlockRemoved):
                self._remove(entry, event.block_hash, event.medium)
            elif isinstance(event, AllCleared):
                self._drop_all(entry)
        entry.seq = seq
        return True

    # ---- queries --------------------------------------------------------
    def overlap(self, block_hashes: list[int], workers: list[str]) -> dict[str, int]:
        """For each of `workers`, how many leading blocks of the prompt it holds."""
        result = dict.fromkeys(workers, 0)
        by_bit = {}
        alive = 0
        for w in workers:
            entry = self._workers.get(w)
            if entry is not None:
                by_bit[entry.bit] = w
                alive |= 1 << entry.bit
        depth = 0
        holders = self._holders
        for h in block_hashes:
            held = holders.get(h, 0) & alive
            if held != alive:
                for bit, w in by_bit.items():
                    if alive >> bit & 1 and not held >> bit & 1:
                        result[w] = depth
                alive = held
                if not alive:
                    return result
            depth += 1
        for bit, w in by_bit.items():
            if alive >> bit & 1:
                result[w] = depth
        return result

    def best_media(self, block_hashes: list[int], worker: str) -> dict[str, int]:
        """Of `block_hashes` (blocks `worker` holds), how many each medium is the best holder of there."""
        entry = self._workers.get(worker)
        counts = dict.fromkeys(MEDIA, 0)
        for h in block_hashes:
            mask = entry.hashes.get(h, 0) if entry is not None else 0
            if mask:
                counts[MEDIA[(mask & -mask).bit_length() - 1]] += 1
        return counts

    def weighted_overlap(self, block_hashes: list[int], workers: list[str], weights: dict[str, float],
                         depths: dict[str, int] | None = None) -> dict[str, float]:
        """For each of `workers`, its `overlap` depth with each block weighted by the best medium
        holding it there (`weights` per medium name, e.g. device 1.0, cpu 0.8; a medium left out: 0).
        `depths`: that `overlap`, when the caller already has it."""
        if depths is None:
            depths = self.overlap(block_hashes, workers)
        by_mask = [0.0] * (1 << len(MEDIA))
        for mask in range(1, len(by_mask)):
            best = (mask & -mask).bit_length() - 1
            by_mask[mask] = weights.get(MEDIA[best], 0.0)
        result: dict[str, float] = {}
        for w, depth in depths.items():
            entry = self._workers.get(w)
            if not depth or entry is None:
                result[w] = 0.0
            elif entry.counts[0] == len(entry.hashes):  # everything on device: no lookups
                result[w] = depth * by_mask[_DEVICE_BIT]
            else:
                media = entry.hashes
                result[w] = sum(by_mask[media[h]] for h in block_hashes[:depth])
        return result

    # ---- internals ------------------------------------------------------
    def _store(self, entry: _WorkerBlocks, block_hash: int, medium: str) -> None:
        bit = _MEDIUM_BIT.get(medium, 0)
        mask = entry.hashes.get(block_hash, 0)
        if not bit or mask & bit:
            return
        if not mask:
            self._holders[block_hash] = self._holders.get(block_hash, 0) | 1 << entry.bit
        entry.hashes[block_hash] = mask | bit
        entry.counts[bit.bit_length() - 1] += 1

    def _remove(self, entry: _WorkerBlocks, block_hash: int, medium: str) -> None:
        bit = _MEDIUM_BIT.get(medium, 0)
        mask = entry.hashes.get(block_hash, 0)
        if not mask & bit:
            return
        entry.counts[bit.bit_length() - 1] -= 1
        if mask == bit:
            del entry.hashes[block_hash]
            self._unset(block_hash, 1 << entry.bit)
        else:
            entry.hashes[block_hash] = mask & ~bit

    def _drop_all(self, entry: _WorkerBlocks) -> None:
        bit = 1 << entry.bit
        for h in entry.hashes:
            self._unset(h, bit)
        entry.hashes = {}
        entry.counts = [0] * len(MEDIA)

    def _unset(self, block_hash: int, bit: int) -> None:
        mask = self._holders.get(block_hash, 0) & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            self._holders.pop(block_hash, None)
