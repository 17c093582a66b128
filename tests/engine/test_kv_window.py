"""Sliding-window block release: a pure-window model's sequences let go of the blocks no later query reads.

Pure Python first (KVCacheManager and Scheduler, no model): the exact moment a block leaves the window,
never a block a query can still see, chunked prefill, prefix hits, speculative rollback, preemption,
prefill-role requests, decode reservations and a failed tier load, and no block left at the end.
The scheduler's side: tests/engine/test_kv_window_scheduler.py; end to end with a model:
tests/engine/test_kv_window_model.py.
"""

import pytest

from engine.block_pool import NULL_BLOCK, BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4
WINDOW = 8


def make(num_blocks=64, budget=16, max_seqs=8, caching=True, window=WINDOW):
    kv = KVCacheManager(num_blocks, BS, caching, sliding_window=window)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)


def req(rid, n_prompt, max_tokens=4, first=0, prefill_only=False):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens),
                   prefill_only=prefill_only)


def visible_keys(first_query: int, window: int = WINDOW) -> range:
    """Key positions a query at `first_query` reads (p - window < j <= p), those already computed."""
    return range(max(0, first_query - window + 1), first_query)


def assert_window(kv: KVCacheManager, rid: str, first_query: int) -> None:
    """Every key a query at `first_query` can see is in a real block, and every block wholly before that
    window is released (nothing held for nothing)."""
    table = kv.block_table(rid)
    assert all(table[j // BS] != NULL_BLOCK for j in visible_keys(first_query)), (rid, first_query, table)
    expected = min(max(0, first_query - WINDOW + 1) // BS, len(table))
    assert kv.num_released(rid) == expected, (rid, first_query, table)
    assert table[:expected] == [NULL_BLOCK] * expected


def assert_refcounts(kv: KVCacheManager) -> None:
    """Each block's ref count is the number of tables holding it; the null block is held by none."""
    held: dict[int, int] = {}
    for table in kv.block_tables.values():
        for block_id in table:
            if block_id != NULL_BLOCK:
                held[block_id] = held.get(block_id, 0) + 1
    assert {b.block_id: b.ref_count for b in kv.pool.blocks if b.ref_count} == held
    assert kv.pool.num_used_blocks == len(held)


def assert_no_leak(s: Scheduler) -> None:
    assert not s.has_unfinished() and not s.requests
    assert s.kv.pool.num_used_blocks == 0
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_usable_blocks
    assert not s.kv.block_tables


def run_step(s: Scheduler, token=7):
    """One fake engine step: every sampling request gets `token`; finish at max_tokens. Checks the window of
    every request it schedules."""
    out = s.schedule()
    for item in out.scheduled:
        if not item.request.prefill_only and s.kv.sliding_window is not None:
            assert_window(s.kv, item.request.request_id, item.request.num_computed_tokens)
    sampling = [i.request for i in out.scheduled if i.samples]
    s.finish_step(out)
    for r in sampling:
        r.append_token(token)
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish(r, FinishReason.LENGTH)
    return out


# ---- the pool and the manager --------------------------------------------------------------------


def test_the_null_block_is_set_aside_and_never_counted():
    pool = BlockPool(4, null_block=True)
    assert pool.num_usable_blocks == 3 and pool.num_used_blocks == 0
    assert [pool.allocate() for _ in range(3)] == [1, 2, 3]
    with pytest.raises(MemoryError):
        pool.allocate()
    for block_id in (1, 2, 3):
        pool.release(block_id)
    assert pool.num_used_blocks == 0 and pool.num_free_blocks == 3
    for misuse in (pool.touch, pool.release, lambda b: pool.register(b, 123, [1, 2])):
        with pytest.raises(RuntimeError, match="null block"):
            misuse(NULL_BLOCK)
    assert BlockPool(4).num_usable_blocks == 4  # no window: nothing set aside


def test_a_block_is_released_exactly_when_it_leaves_every_future_window():
    kv = KVCacheManager(16, BS, sliding_window=WINDOW)
    assert kv.allocate_slots("a", 0, 6) == []
    for q in range(6, 60):  # q: the next query (tokens before it computed)
        kv.release_outside_window("a", q)
        assert_window(kv, "a", q)
        assert kv.num_held_blocks("a") <= WINDOW // BS + 1
        assert kv.pool.num_used_blocks == kv.num_held_blocks("a")
        if q == 10:  # the query at 10 sees keys 3..10: block 0 (tokens 0..3) stays
            assert kv.block_table("a")[0] != NULL_BLOCK
        if q == 11:  # the query at 11 sees keys 4..11: block 0 goes
            assert kv.block_table("a")[0] == NULL_BLOCK and kv.block_table("a")[1] != NULL_BLOCK
        assert kv.allocate_slots("a", q, 1) is not None
    assert len(kv.block_table("a")) == 15  # entries keep their places: token i stays in entry i // BS
    kv.free("a")
    assert kv.pool.num_used_blocks == 0 and not kv.block_tables


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(16, BS)
    kv.allocate_slots("a", 0, 40)
    assert kv.release_outside_window("a", 40) == 0 and kv.num_held_blocks("a") == 10
    assert kv.allocate_slots("b", 0, 8, first_query=8) == [] and kv.num_released("b") == 0


def test_released_blocks_stay_cached_and_the_chain_head_is_evicted_last():
    kv = KVCacheManager(11, BS, sliding_window=WINDOW)  # 10 usable blocks
    tokens = list(range(100, 140))
    kv.allocate_slots("a", 0, 40)
    kv.cache_computed_blocks("a", tokens, 40)
    table = list(kv.block_table("a"))
    assert kv.release_outside_window("a", 40) == 8  # keys 33..39 remain: blocks 8 and 9
    assert kv.pool.num_cached_blocks == 10 and kv.pool.num_used_blocks == 2
    assert kv.release_outside_window("a", 40) == 0  # released once
    # the block nearest the window was released first, so it is evicted first: the chain's head stays longest
    assert [kv.pool.allocate() for _ in range(8)] == table[7::-1]


def test_fork_shares_the_released_entries_and_frees_clean():
    kv = KVCacheManager(32, BS, sliding_window=WINDOW)
    kv.allocate_slots("p", 0, 30)
    kv.release_outside_window("p", 30)
    kv.fork("p", "c")
    assert kv.block_table("c") == kv.block_table("p") and kv.num_released("c") == kv.num_released("p") == 5
    assert kv.block_table("c")[:5] == [NULL_BLOCK] * 5
    assert_refcounts(kv)
    kv.allocate_slots("c", 30, 1)  # copy-on-write of the shared partial block
    kv.release_outside_window("p", 34)
    kv.release_outside_window("c", 31)
    assert_refcounts(kv)
    kv.free("p")
    kv.free("c")
    assert kv.pool.num_used_blocks == 0
