"""Per-sequence block tables on top of the block pool. No torch.

Check/act pairs in one call: `allocate_slots` either reserves every block a
step needs (and reports the copy-on-write copies to make) or changes nothing.
A sequence wastes at most one partly filled block: blocks are added only when
the tokens being computed reach into them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_hash import NO_PARENT, hash_full_blocks
from engine.block_pool import BlockPool


@dataclass
class PrefixHit:
    """Blocks found in the prefix cache for a new sequence."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    """Owns block tables keyed by sequence id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---- queries -------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_table(self, seq_id: str) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, seq_id: str, token_ids: list[int], salt: str = "") -> PrefixHit:
        """Longest run of cached full blocks at the start of `token_ids` (hashed with `salt`:
        only blocks cached under the same salt can match).

        At most len-1 tokens are reported, so the last token is always computed
        (its logits are needed to sample). Counts tokens queried and hit.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        hashes = self._hashes_for(seq_id, token_ids, salt)
        max_blocks = (len(token_ids) - 1) // self.block_size
        hit = PrefixHit()
        bs = self.block_size
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block_id = self.pool.lookup(block_hash, token_ids[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            hit.block_ids.append(block_id)
        hit.num_tokens = len(hit.block_ids) * bs
        self.num_prefix_queries += len(token_ids)
        self.num_prefix_hits += hit.num_tokens
        return hit

    # ---- allocation ----------------------------------------------------
    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int,
                       prefix: PrefixHit | None = None) -> list[tuple[int, int]] | None:
        """Reserve blocks so tokens [computed, computed + new) can be written.

        `prefix` (only for a sequence without blocks) is adopted first and its
        tokens count as computed. Returns the (src, dst) block copies needed for
        copy-on-write, or None, changing nothing, if blocks are short.
        """
        table = self.block_tables.get(seq_id, [])
        bs = self.block_size
        if prefix is None and -(-(num_computed_tokens + num_new_tokens) // bs) <= len(table) and (
                num_computed_tokens % bs == 0 or self.pool.blocks[table[num_computed_tokens // bs]].ref_count == 1):
            return []  # the common decode step: the blocks exist and the one written is not shared
        prefix = prefix or PrefixHit()
        if prefix.block_ids and table:
            raise ValueError(f"{seq_id}: a prefix hit is only for a sequence without blocks")
        start = num_computed_tokens + prefix.num_tokens
        end = start + num_new_tokens
        have = len(table) + len(prefix.block_ids)
        num_new_blocks = max(0, self.blocks_needed(end) - have)
        cow = bool(num_new_tokens > 0 and start % self.block_size != 0
                   and start // self.block_size < len(table)
                   and self.pool.blocks[table[start // self.block_size]].ref_count > 1)
        revived = sum(1 for b in prefix.block_ids if self.pool.is_free(b))
        if num_new_blocks + int(cow) > self.pool.num_free_blocks - revived:
            return None
        for block_id in prefix.block_ids:
            self.pool.touch(block_id)
        table = self.block_tables.setdefault(seq_id, table)
        table.extend(prefix.block_ids)
        if prefix.block_ids:
            self._num_registered[seq_id] = len(prefix.block_ids)
        copies = []
        if cow:
            index = start // self.block_size
            src = table[index]
            dst = self.pool.allocate()
            self.pool.release(src)
            table[index] = dst
            copies.append((src, dst))
        table.extend(self.pool.allocate() for _ in range(num_new_blocks))
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's blocks (shared; written copy-on-write)."""
        if child_id in self.block_tables:
            raise ValueError(f"{child_id} already has blocks")
        table = list(self.block_tables.get(parent_id, []))
        for block_id in table:
            self.pool.touch(block_id)
        self.block_tables[child_id] = table
        self._num_registered[child_id] = self._num_registered.get(parent_id, 0)
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id])

    def cache_computed_blocks(self, seq_id: str, token_ids: list[int], num_computed_tokens: int,
                              salt: str = "") -> None:
        """Register the sequence's full blocks whose KV is now computed (under the sequence's `salt`)."""
        if not self.enable_prefix_caching:
            return
        num_full = num_computed_tokens // self.block_size
        done = self._num_registered.get(seq_id, 0)
        if num_full <= done:
            return
        hashes = self._hashes_for(seq_id, token_ids[:num_full * self.block_size], salt)
        table = self.block_tables[seq_id]
        bs = self.block_size
        for i in range(done, num_full):
            self.pool.register(table[i], hashes[i], token_ids[i * bs:(i + 1) * bs],
                               hashes[i - 1] if i else NO_PARENT)
        self._num_registered[seq_id] = num_full

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Release the sequence's blocks past those covering `num_tokens` tokens, tail first (speculative
        decoding: blocks that held only rejected proposals). They were never registered in the prefix cache."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        if self._num_registered.get(seq_id, 0) > keep:
            raise RuntimeError(f"{seq_id}: truncating registered blocks")
        while len(table) > keep:
            self.pool.release(table.pop())

    def free(self, seq_id: str) -> None:
        """Release all blocks of a sequence, tail first (so tails evict first)."""
        for block_id in reversed(self.block_tables.pop(seq_id, [])):
            self.pool.release(block_id)
        self._num_registered.pop(seq_id, None)
        self._hashes.pop(seq_id, None)

    def rename(self, seq_id: str, new_id: str) -> None:
        """Move a sequence's blocks under another id (an aborted request whose blocks a load still fills)."""
        for table in (self.block_tables, self._num_registered, self._hashes):
            if seq_id in table:
                table[new_id] = table.pop(seq_id)

    def block_hashes(self, seq_id: str, token_ids: list[int], salt: str = "") -> list[int]:
        """Chained hashes of the full blocks of `token_ids` (remembered per sequence)."""
        return self._hashes_for(seq_id, token_ids, salt)

    def _hashes_for(self, seq_id: str, token_ids: list[int], salt: str) -> list[int]:
        known = self._hashes.get(seq_id)
        num_full = len(token_ids) // self.block_size
        if known is None or len(known) < num_full:
            known = hash_full_blocks(token_ids[:num_full * self.block_size], self.block_size, known, salt)
            self._hashes[seq_id] = known
        return known[:num_full]
