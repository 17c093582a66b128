"""Sliding-window block release in the scheduler (no model): chunked prefill, capacity against full
attention, preemption, prefix hits, speculative rollback, prefill-role requests, decode reservations, a
failed tier load, random workloads; no block left at the end. Helpers: tests/engine/test_kv_window.py."""
import random

import pytest

from engine.block_pool import NULL_BLOCK
from engine.kv_cache_manager import PrefixHit
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from tests.engine.test_kv_window import (
    BS,
    WINDOW,
    assert_no_leak,
    assert_refcounts,
    assert_window,
    make,
    req,
    run_step,
)


def test_chunked_prefill_releases_behind_each_chunk():
    s = make(budget=16)
    s.add_request(req("a", 40, max_tokens=20))
    out = run_step(s)
    assert [i.num_new_tokens for i in out.scheduled] == [16]
    assert s.kv.num_released("a") == 0
    run_step(s)  # the chunk from 16 sees keys 9..: blocks 0 and 1 go before it is scheduled
    table = s.kv.block_table("a")
    assert table[:2] == [NULL_BLOCK] * 2 and table[2] != NULL_BLOCK
    run_step(s)  # the last chunk (32..39): the window 25..31 (blocks 6, 7) and the chunk's blocks 8, 9
    assert s.kv.num_held_blocks("a") == 4
    while s.has_unfinished():
        run_step(s)
        if s.has_unfinished():
            assert s.kv.num_held_blocks("a") <= WINDOW // BS + 1  # decoding: the window's blocks
    assert s.kv.num_window_released == 12  # the last query (58) sees keys 51..58: blocks 0..11 were released
    assert_no_leak(s)


def test_windowed_sequences_fit_where_full_attention_preempts():
    """The free-block checks see released blocks: 4 sequences of 60 tokens fit in 24 blocks."""
    runs = {}
    for window in (WINDOW, None):
        s = make(num_blocks=24, budget=64, window=window)
        for i in range(4):
            s.add_request(req(str(i), 40, max_tokens=20, first=1000 * i))
        peak = 0
        while s.has_unfinished():
            run_step(s)
            peak = max(peak, s.kv.pool.num_used_blocks)
        assert_no_leak(s)
        runs[window] = (s.num_preemptions, peak)
    assert runs[WINDOW][0] == 0 and runs[None][0] > 0
    assert runs[WINDOW][1] < runs[None][1]


def test_preemption_recomputes_and_leaks_nothing():
    """Three sequences need up to 3 blocks each inside their windows; 5 blocks force preemptions."""
    s = make(num_blocks=6, budget=32)
    for i in range(3):
        s.add_request(req(str(i), 6, max_tokens=20, first=1000 * i))
    while s.has_unfinished():
        run_step(s)
    assert s.num_preemptions > 0
    assert_no_leak(s)


def test_a_prefix_hit_takes_only_the_blocks_inside_the_window():
    s = make(num_blocks=32, budget=64)
    s.add_request(req("a", 40, max_tokens=1))
    run_step(s)
    kv = s.kv
    assert not s.has_unfinished() and kv.pool.num_cached_blocks == 10 and kv.pool.num_used_blocks == 0
    b = req("b", 40, max_tokens=3)
    hit = kv.find_prefix("b", b.all_token_ids)
    assert len(hit.block_ids) == 9  # the whole chain is still cached
    s.add_request(b)
    run_step(s)
    table = kv.block_table("b")
    # the query at 36 sees keys 29..36: hit blocks 7 and 8 are adopted, 0..6 are left behind
    assert table[:7] == [NULL_BLOCK] * 7 and table[7:9] == hit.block_ids[7:9]
    assert all(kv.pool.is_free(block_id) for block_id in hit.block_ids[:7])  # not revived for nothing
    assert b.num_cached_tokens == 36
    while s.has_unfinished():
        run_step(s)
    assert_no_leak(s)


def test_a_prefix_hit_ends_at_the_first_evicted_block():
    """A hit needs the chain from the first block: one evicted block ends it, and the hit's blocks inside the
    new query's window are adopted, whatever is cached after it is not."""
    s = make(num_blocks=11, budget=64)  # 10 usable blocks
    kv = s.kv
    kv.allocate_slots("a", 0, 40)
    kv.cache_computed_blocks("a", list(range(40)), 40)
    chain = list(kv.block_table("a"))
    kv.release_outside_window("a", 40)
    evicted = kv.pool.allocate()  # the released block nearest the window goes first
    assert evicted == chain[7]
    kv.pool.release(evicted)
    kv.free("a")
    b = req("b", 40, max_tokens=2)
    s.add_request(b)
    run_step(s)
    assert b.num_cached_tokens == 28  # blocks 0..6; 8 and 9 are still cached but follow the gap
    table = kv.block_table("b")
    assert table[:5] == [NULL_BLOCK] * 5 and table[5:7] == chain[5:7]  # the query at 28 sees keys 21..28
    while s.has_unfinished():
        run_step(s)
    assert_no_leak(s)


def test_a_speculative_rollback_never_reaches_a_released_block():
    s = make(num_blocks=32, budget=64)
    r = req("a", 20, max_tokens=30)
    s.add_request(r)
    run_step(s)
    assert r.num_computed_tokens == 20 and r.num_tokens == 21
    r.spec_token_ids = [1, 2, 3, 4]
    out = s.schedule()
    assert out.scheduled[0].num_new_tokens == 5  # KV of positions 20..24 is written
    assert s.kv.num_released("a") == (20 - WINDOW + 1) // BS
    s.finish_step(out)
    r.append_token(9)  # every proposal rejected: only the bonus token
    s.accept_spec(r, 0)
    assert r.num_computed_tokens == 21
    s.schedule()
    # released by the next query (21), not by the proposals' end (25): keys 14..20 stay
    assert_window(s.kv, "a", 21)
    assert s.kv.num_released("a") == 3
    assert len(s.kv.block_table("a")) == 6  # the rejected proposals' block was dropped
    s.finish(r, FinishReason.ABORT)
    assert_no_leak(s)


def test_prefill_role_requests_keep_every_block_for_the_transfer():
    s = make(num_blocks=32, budget=16)
    r = req("p", 40, max_tokens=8, prefill_only=True)
    s.add_request(r)
    while r.num_output_tokens == 0:
        run_step(s)
    s.finish(r, None, keep_blocks=True)
    table = s.kv.block_table("p")
    assert len(table) == 10 and NULL_BLOCK not in table
    s.kv.free("p")
    assert_no_leak(s)


def test_a_decode_reservation_takes_only_the_last_window():
    s = make(num_blocks=32, budget=16)
    prompt = list(range(40))
    # reserve_kv's call: the first query comes at 40 (the first token), it sees keys 33..40
    assert s.kv.allocate_slots("d", 0, 40, PrefixHit(), first_query=40) == []
    table = s.kv.block_table("d")
    assert table[:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in table[8:] and len(table) == 10
    assert s.kv.pool.num_used_blocks == 2
    r = Request("d", prompt, SamplingParams(max_tokens=6))
    s.add_request(r)
    r.num_computed_tokens = 40
    r.append_token(5)
    while s.has_unfinished():
        run_step(s)
    assert_no_leak(s)


class FakeTiers:
    """The scheduler's side of KV tiers (engine/kv_offload/offloader.py): holds the blocks with `hashes`;
    a load ends when the test puts (key, blocks loaded) in `done`."""

    def __init__(self, hashes: list[int]) -> None:
        self.hashes = set(hashes)
        self.loads: dict[str, list[int]] = {}
        self.done: list[tuple[str, int]] = []

    @property
    def busy(self) -> bool:
        return bool(self.loads)

    def lookup(self, hashes, token_ids, start, end):
        found = []
        for i in range(start, end):
            if hashes[i] not in self.hashes:
                break
            found.append((None, hashes[i]))
        return found

    def count_lookup(self, found, missed) -> None:
        pass

    def can_load(self, num_blocks: int) -> bool:
        return True

    def start_load(self, key, found, block_ids, missed) -> None:
        self.loads[key] = list(block_ids)

    def poll(self):
        done, self.done = self.done, []
        for key, _ in done:
            self.loads.pop(key)
        return done

    def after_step(self) -> None:
        pass

    def wait(self, timeout: float) -> None:
        pass


def test_a_windowed_reservation_whose_tier_load_fails_recomputes_the_whole_prompt():
    """The reservation has no blocks behind the prompt's last window; a load refused part way would leave a
    recompute reading them, so the prompt is computed again from the start."""
    s = make(num_blocks=32, budget=16)
    prompt = list(range(40))
    hashes = s.kv.block_hashes("d", prompt)
    s.offload = FakeTiers(hashes[8:10])
    s.kv.allocate_slots("d", 0, 40, PrefixHit(), first_query=40)
    start = s.kv.num_released("d")
    assert start == 8 and s.load_reserved("d", prompt, "", start) == 1  # block 8 (block 9, the last, is pulled)
    (key, targets), = s.offload.loads.items()
    assert targets == s.kv.block_table("d")[8:9] and NULL_BLOCK not in targets  # never loaded into the null block
    r = Request("d", prompt, SamplingParams(max_tokens=4))
    s.add_request(r)
    r.num_computed_tokens = 40
    r.append_token(5)
    s.hold_for_load(r)
    assert r.status == RequestStatus.LOADING
    s.offload.done.append((key, 0))  # block 8 failed its check: a recompute from 32 would read keys 25..31
    out = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("d", 16)]
    assert r.num_computed_tokens == 0 and r.num_cached_tokens == 0
    s.finish_step(out)
    while s.has_unfinished():
        run_step(s)
    assert r.output_token_ids[0] == 5 and r.num_output_tokens == 4
    assert_no_leak(s)


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_hold_exactly_the_window(seed):
    """Random prompts (some sharing prefixes), budgets, a tight pool, speculative proposals accepted at
    random, aborts: after every schedule each request holds exactly the blocks its next query can read,
    ref counts match the tables, and nothing is left at the end."""
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(24, 40), budget=rng.choice([8, 16, 32]), max_seqs=4)
    base = [rng.randrange(50, 60) for _ in range(40)]
    pending = []
    for i in range(10):
        shared = base[:rng.choice([0, 12, 24, 40])]
        prompt = shared + [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
        pending.append(Request(str(i), prompt, SamplingParams(max_tokens=rng.randint(1, 25)),
                               prefill_only=rng.random() < 0.15))
    kept = []
    for _ in range(5000):
        if not (pending or s.has_unfinished()):
            break
        if pending and rng.random() < 0.4:
            s.add_request(pending.pop(0))
        for r in s.running:
            room = r.params.max_tokens - r.num_output_tokens - 1
            if r.num_tokens - r.num_computed_tokens == 1 and not r.prefill_only and room > 0:
                r.spec_token_ids = [rng.randrange(1000) for _ in range(rng.randint(0, min(3, room)))]
        out = s.schedule()
        for r in s.running:
            if r.prefill_only:
                assert s.kv.num_released(r.request_id) == 0
            else:
                assert_window(s.kv, r.request_id, r.num_computed_tokens)
        assert_refcounts(s.kv)
        sampling = [item for item in out.scheduled if item.samples]
        s.finish_step(out)
        for item in sampling:
            r = item.request
            accepted = rng.randint(0, len(item.spec_token_ids))
            num_taken = 0
            for token_id in item.spec_token_ids[:accepted] + [rng.randrange(1000)]:
                r.append_token(token_id)
                num_taken += 1
                if r.num_output_tokens >= r.params.max_tokens:
                    s.finish(r, FinishReason.LENGTH)
                    break
                if r.prefill_only:
                    s.finish(r, None, keep_blocks=True)
                    kept.append(r.request_id)
                    break
            if item.spec_token_ids:
                s.accept_spec(r, num_taken - 1)
        if s.running and rng.random() < 0.05:
            s.finish(rng.choice(s.running), FinishReason.ABORT)
        if not out.scheduled and not s.running and s.waiting:  # kept prefills fill the pool: let them go
            assert kept, "no progress with nothing kept"
            for rid in kept:
                s.kv.free(rid)
            kept.clear()
    else:
        raise AssertionError("the workload did not finish")
    for rid in kept:
        s.kv.free(rid)
    assert_no_leak(s)
