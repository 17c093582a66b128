"""BlockPool and KVCacheManager on their own: exact ids, hits, eviction order, CoW."""
import pytest

from engine.block_hash import NO_PARENT, hash_block, hash_full_blocks
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager

BS = 4


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.pool.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
    assert not kv.block_tables


def test_hashes_chain_and_cover_only_full_blocks():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, BS)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(NO_PARENT, [0, 1, 2, 3])
    assert hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])
    # Same block tokens under another parent hash differently.
    assert hash_full_blocks([9, 9, 9, 9, 4, 5, 6, 7], BS)[1] != hashes[1]
    # Extending from known hashes gives the same chain.
    assert hash_full_blocks(tokens + [10, 11], BS, known=hashes) == hash_full_blocks(tokens + [10, 11], BS)


def test_pool_allocates_in_order_and_reuses_uncached_first():
    pool = BlockPool(4)
    assert [pool.allocate() for _ in range(3)] == [0, 1, 2]
    pool.register(1, 111, [1, 1, 1, 1])
    pool.release(1)  # cached: goes to the back
    pool.release(2)  # uncached: goes to the front
    assert pool.allocate() == 2
    assert pool.allocate() == 3
    assert pool.lookup(111, [1, 1, 1, 1]) == 1
    assert pool.allocate() == 1  # evicts the cached block last
    assert pool.lookup(111, [1, 1, 1, 1]) is None
    assert pool.num_evictions == 1
    with pytest.raises(MemoryError):
        pool.allocate()


def test_pool_hash_hit_checks_tokens_and_refcounts():
    pool = BlockPool(2)
    b = pool.allocate()
    pool.register(b, 42, [1, 2, 3, 4])
    assert pool.lookup(42, [1, 2, 3, 5]) is None  # collision guard
    pool.touch(b)
    assert pool.blocks[b].ref_count == 2
    pool.release(b)
    pool.release(b)
    assert pool.is_free(b) and pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.release(b)


def test_allocate_grows_by_blocks_only_when_needed():
    kv = KVCacheManager(8, BS)
    assert kv.allocate_slots("a", 0, 5) == []
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 5, 3) == []  # fills block 1, no new block
    assert kv.block_table("a") == [0, 1]
    kv.allocate_slots("a", 8, 1)
    assert kv.block_table("a") == [0, 1, 2]
    kv.free("a")
    assert_all_free(kv)


def test_allocate_refuses_without_changing_anything():
    kv = KVCacheManager(3, BS)
    assert kv.allocate_slots("a", 0, 8) == []
    assert kv.allocate_slots("b", 0, 8) is None
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.free("a")
    assert_all_free(kv)


def test_prefix_hit_reuses_exact_blocks_and_leaves_last_token():
    kv = KVCacheManager(10, BS)
    tokens = list(range(10))
    kv.allocate_slots("a", 0, 10)
    kv.cache_computed_blocks("a", tokens, 10)
    assert kv.pool.num_cached_blocks == 2
    kv.free("a")
    # Same 10 tokens: 2 full blocks hit (8 tokens).
    hit = kv.find_prefix("b", tokens)
    assert hit.block_ids == [0, 1] and hit.num_tokens == 8
    # Exactly 8 tokens: only 1 block may hit, so the last token is computed.
    assert kv.find_prefix("c", tokens[:8]).block_ids == [0]
    # A different second block: only the first hits.
    assert kv.find_prefix("d", tokens[:4] + [99] * 6).block_ids == [0]
    assert kv.find_prefix("e", [99] + tokens[1:]).block_ids == []
    assert kv.allocate_slots("b", 0, 2, hit) == []
    assert kv.block_table("b")[:2] == [0, 1]
    assert kv.pool.blocks[0].ref_count == 1
    kv.free("b")
    assert_all_free(kv)
    assert kv.num_prefix_hits == 8 + 4 + 4 + 0


def test_eviction_order_is_lru_tail_first():
    kv = KVCacheManager(4, BS)
    a = list(range(8))
    kv.allocate_slots("a", 0, 8)
    kv.cache_computed_blocks("a", a, 8)
    kv.free("a")  # frees block 1 (tail) then block 0
    # New sequence needs 3 blocks: gets uncached 2, 3 first, then evicts block 1 (freed first).
    kv.allocate_slots("x", 0, 12)
    assert kv.block_table("x") == [2, 3, 1]
    assert kv.find_prefix("y", a + [0]).block_ids == [0]  # block 0 survived, block 1 evicted
    kv.free("x")
    assert_all_free(kv)


def test_shared_prefix_blocks_are_refcounted():
    kv = KVCacheManager(10, BS)
    tokens = list(range(9))
    kv.allocate_slots("a", 0, 9)
    kv.cache_computed_blocks("a", tokens, 9)
    hit = kv.find_prefix("b", tokens)
    kv.allocate_slots("b", 0, 1, hit)
    assert [kv.pool.blocks[i].ref_count for i in kv.block_table("b")] == [2, 2, 1]
    kv.free("a")
    assert kv.pool.blocks[0].ref_count == 1 and not kv.pool.is_free(0)
    kv.free("b")
    assert_all_free(kv)


def test_fork_copy_on_write_of_shared_partial_block():
    kv = KVCacheManager(10, BS)
    kv.allocate_slots("p", 0, 6)  # blocks [0, 1]; block 1 half full
    kv.fork("p", "c")
    assert kv.block_table("c") == [0, 1]
    assert kv.pool.blocks[1].ref_count == 2
    # Child writes token 6 into shared block 1 -> copied into a fresh block.
    assert kv.allocate_slots("c", 6, 1) == [(1, 2)]
    assert kv.block_table("c") == [0, 2]
    # Now the parent is the only owner of block 1: writes in place.
    assert kv.allocate_slots("p", 6, 1) == []
    assert kv.block_table("p") == [0, 1]
    assert kv.pool.blocks[0].ref_count == 2  # full block stays shared
    kv.free("p")
    kv.free("c")
    assert_all_free(kv)


def test_fork_with_full_last_block_needs_no_copy():
    kv = KVCacheManager(10, BS)
    kv.allocate_slots("p", 0, 8)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 8, 1) == []
    assert kv.block_table("c") == [0, 1, 2]
    kv.free("c")
    kv.free("p")
    assert_all_free(kv)


def test_copy_on_write_counts_against_free_blocks():
    kv = KVCacheManager(2, BS)
    kv.allocate_slots("p", 0, 6)
    kv.fork("p", "c")
    assert kv.allocate_slots("c", 6, 1) is None  # needs a copy block, none free
    assert kv.block_table("c") == [0, 1]
    kv.free("c")
    kv.free("p")
    assert_all_free(kv)


def test_reviving_free_cached_blocks_counts_against_capacity():
    kv = KVCacheManager(3, BS)
    tokens = list(range(9))
    kv.allocate_slots("a", 0, 9)
    kv.cache_computed_blocks("a", tokens, 9)
    kv.free("a")
    hit = kv.find_prefix("b", tokens)
    assert hit.block_ids == [0, 1]
    # 2 revived + 1 new = all 3 blocks: fits. 2 revived + 2 new does not.
    assert kv.allocate_slots("b", 0, 5, hit) is None
    assert kv.allocate_slots("b", 0, 1, hit) == []
    kv.free("b")
    assert_all_free(kv)


def test_disabled_prefix_caching_never_hits():
    kv = KVCacheManager(4, BS, enable_prefix_caching=False)
    kv.allocate_slots("a", 0, 8)
    kv.cache_computed_blocks("a", list(range(8)), 8)
    kv.free("a")
    assert kv.find_prefix("b", list(range(9))).block_ids == []
    assert kv.pool.num_cached_blocks == 0


def test_prefix_cache_events_follow_store_evict_and_clear():
    from engine.kv_events import AllCleared, BlockRemoved, BlockStored
    kv = KVCacheManager(4, BS)
    kv.pool.events = []
    a = list(range(8))
    h0, h1 = hash_full_blocks(a, BS)
    kv.allocate_slots("a", 0, 8)
    kv.cache_computed_blocks("a", a, 8)
    assert kv.pool.events == [BlockStored(h0, NO_PARENT), BlockStored(h1, h0)]
    # The same prefix again: already cached, no event.
    kv.allocate_slots("b", 0, 8)
    kv.cache_computed_blocks("b", a, 8)
    assert len(kv.pool.events) == 2
    kv.free("a")
    kv.free("b")
    assert sorted(kv.pool.cached_hashes()) == sorted([h0, h1])
    # Three new blocks: the fourth takes cached block 1 (h1) -> its hash leaves the cache.
    kv.pool.events.clear()
    kv.allocate_slots("x", 0, 12)
    assert kv.pool.events == [BlockRemoved(h1)]
    assert kv.pool.cached_hashes() == [h0]
    kv.free("x")
    kv.pool.events.clear()
    assert kv.pool.reset_prefix_cache()
    assert kv.pool.events == [AllCleared()] and kv.pool.cached_hashes() == []


def test_a_cache_salt_changes_every_hash_and_only_the_same_salt_hits():
    tokens = list(range(10))
    plain, a, b = (hash_full_blocks(tokens, BS, salt=s) for s in ("", "tenant-a", "tenant-b"))
    assert plain == hash_full_blocks(tokens, BS)  # the empty salt is no salt
    assert not set(plain) & set(a) and not set(a) & set(b) and not set(plain) & set(b)
    assert a == hash_full_blocks(tokens, BS, salt="tenant-a")
    assert hash_full_blocks(tokens + [10, 11], BS, known=a, salt="tenant-a") == hash_full_blocks(
        tokens + [10, 11], BS, salt="tenant-a")
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    kv.allocate_slots("a", 0, 10)
    kv.cache_computed_blocks("a", tokens, 10, salt="tenant-a")
    kv.free("a")
    assert kv.find_prefix("b", tokens, salt="tenant-b").block_ids == []
    assert kv.find_prefix("plain", tokens).block_ids == []
    assert kv.find_prefix("a2", tokens, salt="tenant-a").block_ids == [0, 1]
