"""Which block hash sits in which slot of one lower tier, least recently used first. No torch.

Only the engine thread touches an index. A slot being read by the tier's I/O
thread is pinned and never evicted; an entry whose bytes are still being
written is not `ready`: lookups skip it and eviction leaves it.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.block_hash import NO_PARENT


@dataclass
class TierEntry:
    slot: int
    parent_hash: int = NO_PARENT
    token_ids: tuple[int, ...] = ()
    """The block's tokens, compared on a hash hit (collision guard, as the device pool does)."""
    pins: int = 0
    ready: bool = False


class TierIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError("a tier needs at least one slot")
        self.num_slots = num_slots
        self._entries: OrderedDict[int, TierEntry] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._entries

    def hashes(self) -> list[int]:
        """Every hash whose bytes are in the tier, least recently used first."""
        return [h for h, e in self._entries.items() if e.ready]

    def get(self, block_hash: int, token_ids=None) -> TierEntry | None:
        """The ready entry holding exactly these tokens under this hash (now most recently used), else None."""
        entry = self._entries.get(block_hash)
        if entry is None or not entry.ready or (token_ids is not None and entry.token_ids != tuple(token_ids)):
            return None
        self._entries.move_to_end(block_hash)
        return entry

    def put(self, block_hash: int, parent_hash: int, token_ids, ready: bool = False,
            slot: int | None = None) -> tuple[TierEntry, list[tuple[int, TierEntry]]] | None:
        """A slot for a new hash (the least recently used ready, unpinned entry evicted when the tier is full):
        (entry, evicted (hash, entry) pairs), or None when every slot is busy. `slot` places it there (warm
        restart)."""
        if block_hash in self._entries:
            raise ValueError(f"block {block_hash:#x} is already in the tier")
        evicted = []
        if slot is not None:
            self._free_slots.remove(slot)
        elif self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, e in self._entries.items() if e.ready and not e.pins), None)
            if victim is None:
                return None
            gone = self._entries.pop(victim)
            slot = gone.slot
            evicted.append((victim, gone))
        entry = TierEntry(slot, parent_hash, tuple(token_ids), ready=ready)
        self._entries[block_hash] = entry
        return entry, evicted

    def mark_ready(self, block_hash: int) -> TierEntry:
        """The entry's bytes are written: lookups may find it."""
        entry = self._entries[block_hash]
        entry.ready = True
        return entry

    def pin(self, block_hash: int) -> TierEntry:
        entry = self._entries[block_hash]
        entry.pins += 1
        return entry

    def unpin(self, block_hash: int) -> None:
        entry = self._entries.get(block_hash)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def remove(self, block_hash: int) -> bool:
        """Forget a hash (its bytes failed a check or were never written); a pinned entry stays."""
        entry = self._entries.get(block_hash)
        if entry is None or entry.pins:
            return False
        del self._entries[block_hash]
        self._free_slots.append(entry.slot)
        return True
