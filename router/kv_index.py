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
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.kv_events import AllCleared, BlockRemoved, BlockStored, KVEvent


@dataclass
class _WorkerBlocks:
    bit: int
    hashes: dict[int, None] = field(default_factory=dict)
    """A dict, not a set: holding only ints, CPython's garbage collector never scans it
    (a million-block index would otherwise stretch every full collection)."""
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

    def num_blocks(self, worker: str) -> int:
        entry = self._workers.get(worker)
        return len(entry.hashes) if entry else 0

    # ---- feeding --------------------------------------------------------
    def load_snapshot(self, worker: str, seq: int, hashes, epoch: int = 0) -> None:
        """Replace what is known of `worker` by its whole prefix cache as of batch `seq`."""
        self.add_worker(worker)
        entry = self._workers[worker]
        self._drop_all(entry)
        bit = 1 << entry.bit
        holders = self._holders
        for h in hashes:
            holders[h] = holders.get(h, 0) | bit
        entry.hashes = dict.fromkeys(hashes)
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
        bit = 1 << entry.bit
        holders = self._holders
        for event in events:
            if isinstance(event, BlockStored):
                if event.block_hash not in entry.hashes:
                    entry.hashes[event.block_hash] = None
                    holders[event.block_hash] = holders.get(event.block_hash, 0) | bit
            elif isinstance(event, BlockRemoved):
                if event.block_hash in entry.hashes:
                    del entry.hashes[event.block_hash]
                    self._unset(event.block_hash, bit)
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

    # ---- internals ------------------------------------------------------
    def _drop_all(self, entry: _WorkerBlocks) -> None:
        bit = 1 << entry.bit
        for h in entry.hashes:
            self._unset(h, bit)
        entry.hashes = {}

    def _unset(self, block_hash: int, bit: int) -> None:
        mask = self._holders.get(block_hash, 0) & ~bit
        if mask:
            self._holders[block_hash] = mask
        else:
            self._holders.pop(block_hash, None)
