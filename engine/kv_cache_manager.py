"""Per-sequence block tables on top of the block pool. No torch.

Check/act pairs in one call: `allocate_slots` either reserves every block a
step needs (and reports the copy-on-write copies to make) or changes nothing.
A sequence wastes at most one partly filled block: blocks are added only when
the tokens being computed reach into them.

Sliding window (`sliding_window`, given only for a model whose every layer slides: Mistral v0.1,
Phi-3-mini-4k): a query at position p reads the keys p - window < j <= p, so once a sequence's next
query is at q (its num_computed_tokens: proposals computed past it may be rolled back, never it), the
blocks lying entirely before q - window + 1 are read by no future query. `release_outside_window`
releases them and puts NULL_BLOCK (block 0, set aside in the pool, never written) in their table
entries, so a table keeps its length and token i stays in entry i // block_size; a sequence then holds
about window / block_size + 1 blocks (plus the chunk it computes). A sequence getting its first blocks
with `first_query` leaves the blocks before that query's window null instead of adopting or allocating
them (a prefix hit's early blocks; a decode reservation's blocks behind the prompt's last window).
The caller decides who releases: the scheduler does for every running request except those whose
blocks are shipped whole (prefill role). Released blocks stay in the prefix cache until evicted; a hit
still needs the whole chain of cached blocks from the first (correct, if less than vLLM's rule of
needing only the last window's).

Hybrid models (some layers slide, some attend to everything: Gemma 2/3, gpt-oss) get no window here:
one block table serves every layer, so every block stays while any full-attention layer may read it,
and the sliding layers' KV outside their window is held for nothing (for gpt-oss, which alternates,
about half of the KV). vLLM's hybrid allocator gives the sliding layers block groups of their own,
released as above; we do not do that yet.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from engine.block_hash import NO_PARENT, hash_full_blocks
from engine.block_pool import NULL_BLOCK, BlockPool


@dataclass
class PrefixHit:
    """Blocks found in the prefix cache for a new sequence."""

    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0


class KVCacheManager:
    """Owns block tables keyed by sequence id."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        """Every layer's window (tokens) when blocks behind it may be released; None: blocks stay until freed."""
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, null_block=sliding_window is not None)
        self.num_window_released = 0
        """Blocks released because they fell behind the window (and those never taken for that reason)."""
        self.block_tables: dict[str, list[int]] = {}
        self.table_stamps: dict[str, int] = {}
        """Sequence id -> a number, new whenever its table is created or edited other than by appending (copy-on-write,
        window release, truncation): a copy of a table (BlockTableMirror) holding the same stamp needs only what
        was appended since."""
        self._stamps = itertools.count(1)
        self._num_registered: dict[str, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self._num_null: dict[str, int] = {}
        """Sequence id -> leading entries of its table that hold NULL_BLOCK (absent: none)."""
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

    def num_skipped_blocks(self, first_query: int) -> int:
        """Leading blocks that no query at position `first_query` or later reads: those lying entirely before
        first_query - window + 1, the earliest key it sees. 0 without a window."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def num_released(self, seq_id: str) -> int:
        """Leading entries of the sequence's table that hold NULL_BLOCK (released or never taken)."""
        return self._num_null.get(seq_id, 0)

    def num_held_blocks(self, seq_id: str) -> int:
        """Blocks the sequence references (its table less the null entries)."""
        return len(self.block_tables.get(seq_id, [])) - self.num_released(seq_id)

    def window_intact(self, seq_id: str, first_query: int) -> bool:
        """True when every key a query at `first_query` (or later) may read has a real block."""
        return self.num_released(seq_id) <= self.num_skipped_blocks(first_query)

    def find_prefix(self, seq_id: str, token_ids: list[int], salt: str = "", whole: bool = False) -> PrefixHit:
        """Longest run of cached full blocks at the start of `token_ids` (hashed with `salt`:
        only blocks cached under the same salt can match).

        At most len-1 tokens are reported, so the last token is always computed
        (its logits are needed to sample). Counts tokens queried and hit.
        With `whole` (a prefix moved between workers, not a prompt to run): every full block may
        match, and nothing is counted.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        hashes = self._hashes_for(seq_id, token_ids, salt)
        max_blocks = len(token_ids) // self.block_size if whole else (len(token_ids) - 1) // self.block_size
        hit = PrefixHit()
        bs = self.block_size
        for i, block_hash in enumerate(hashes[:max_blocks]):
            block_id = self.pool.lookup(block_hash, token_ids[i * bs:(i + 1) * bs])
            if block_id is None:
                break
            hit.block_ids.append(block_id)
        hit.num_tokens = len(hit.block_ids) * bs
        if not whole:
            self.num_prefix_queries += len(token_ids)
            self.num_prefix_hits += hit.num_tokens
        return hit

    # ---- allocation ----------------------------------------------------
    def allocate_slots(self, seq_id: str, num_computed_tokens: int, num_new_tokens: int,
                       prefix: PrefixHit | None = None, first_query: int | None = None) -> list[tuple[int, int]] | None:
        """Reserve blocks so tokens [computed, computed + new) can be written.

        `prefix` (only for a sequence without blocks) is adopted first and its
        tokens count as computed. `first_query` (only for a sequence without blocks;
        with a sliding window): the position of its earliest query from now on; the
        leading blocks before that query's window are left NULL_BLOCK instead of being
        adopted or allocated (None: every block is taken). Returns the (src, dst) block
        copies needed for copy-on-write, or None, changing nothing, if blocks are short.
        """
        table = self.block_tables.get(seq_id, [])
        bs = self.block_size
        computed = num_computed_tokens
        if prefix is None and first_query is None and -(-(computed + num_new_tokens) // bs) <= len(table) and (
                computed % bs == 0 or self.pool.blocks[table[computed // bs]].ref_count == 1):
            return []  # the common decode step: the blocks exist and the one written is not shared
        prefix = prefix or PrefixHit()
        if (prefix.block_ids or first_query is not None) and table:
            raise ValueError(f"{seq_id}: a prefix hit or first_query is only for a sequence without blocks")
        start = num_computed_tokens + prefix.num_tokens
        end = start + num_new_tokens
        skip = 0 if first_query is None else min(self.num_skipped_blocks(first_query), self.blocks_needed(end))
        adopted = prefix.block_ids[skip:]
        have = len(table) + max(skip, len(prefix.block_ids))
        num_new_blocks = max(0, self.blocks_needed(end) - have)
        cow = bool(num_new_tokens > 0 and start % self.block_size != 0
                   and start // self.block_size < len(table)
                   and self.pool.blocks[table[start // self.block_size]].ref_count > 1)
        revived = sum(1 for b in adopted if self.pool.is_free(b))
        if num_new_blocks + int(cow) > self.pool.num_free_blocks - revived:
            return None
        for block_id in adopted:
            self.pool.touch(block_id)
        if seq_id not in self.block_tables:
            self.block_tables[seq_id] = table
            self._restamp(seq_id)
        table.extend([NULL_BLOCK] * skip)
        table.extend(adopted)
        if skip:
            self._num_null[seq_id] = skip
            self.num_window_released += skip
        if prefix.block_ids:
            self._num_registered[seq_id] = len(prefix.block_ids)
        copies = []
        if cow:
            index = start // self.block_size
            src = table[index]
            dst = self.pool.allocate()
            self.pool.release(src)
            table[index] = dst
            self._restamp(seq_id)
            copies.append((src, dst))
        table.extend(self.pool.allocate() for _ in range(num_new_blocks))
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """Give `child_id` the parent's blocks (shared; written copy-on-write)."""
        if child_id in self.block_tables:
            raise ValueError(f"{child_id} already has blocks")
        table = list(self.block_tables.get(parent_id, []))
        for block_id in table[self.num_released(parent_id):]:
            self.pool.touch(block_id)
        self.block_tables[child_id] = table
        self._restamp(child_id)
        if parent_id in self._num_null:
            self._num_null[child_id] = self._num_null[parent_id]
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
        for i in range(max(done, self.num_released(seq_id)), num_full):  # a released block's KV is gone
            self.pool.register(table[i], hashes[i], token_ids[i * bs:(i + 1) * bs],
                               hashes[i - 1] if i else NO_PARENT)
        self._num_registered[seq_id] = num_full

    def release_outside_window(self, seq_id: str, first_query: int) -> int:
        """Release the sequence's blocks that lie entirely before the window of a query at `first_query` (its next
        query, num_computed_tokens: never a position rollback can return behind), their entries becoming
        NULL_BLOCK; the block nearest the window first, so the oldest is the last evicted from the prefix cache.
        Returns how many were released (0 without a window)."""
        table = self.block_tables.get(seq_id)
        done = self.num_released(seq_id)
        end = min(self.num_skipped_blocks(first_query), len(table or ()))
        if end <= done:
            return 0
        released = table[done:end]
        table[done:end] = [NULL_BLOCK] * (end - done)
        self._restamp(seq_id)
        self._num_null[seq_id] = end
        for block_id in reversed(released):
            self.pool.release(block_id)
        self.num_window_released += end - done
        return end - done

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        """Release the sequence's blocks past those covering `num_tokens` tokens, tail first (speculative
        decoding: blocks that held only rejected proposals). They were never registered in the prefix cache."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        if self._num_registered.get(seq_id, 0) > keep or self.num_released(seq_id) > keep:
            raise RuntimeError(f"{seq_id}: truncating registered or released blocks")
        if len(table) > keep:
            self._restamp(seq_id)
        while len(table) > keep:
            self.pool.release(table.pop())

    def free(self, seq_id: str) -> None:
        """Release all blocks of a sequence, tail first (so tails evict first)."""
        num_null = self._num_null.pop(seq_id, 0)
        for block_id in reversed(self.block_tables.pop(seq_id, [])[num_null:]):
            self.pool.release(block_id)
        self._num_registered.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self.table_stamps.pop(seq_id, None)

    def rename(self, seq_id: str, new_id: str) -> None:
        """Move a sequence's blocks under another id (an aborted request whose blocks a load still fills)."""
        for table in (self.block_tables, self._num_registered, self._hashes, self._num_null):
            if seq_id in table:
                table[new_id] = table.pop(seq_id)
        if self.table_stamps.pop(seq_id, None) is not None:
            self._restamp(new_id)

    def _restamp(self, seq_id: str) -> None:
        self.table_stamps[seq_id] = next(self._stamps)

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
