"""Sliding-window block release: a pure-window model's sequences let go of the blocks no later query reads.

Pure Python first (KVCacheManager and Scheduler, no model): the exact moment a block leaves the window,
never a block a query can still see, chunked prefill, prefix hits, speculative rollback, preemption,
prefill-role requests, decode reservations and a failed tier load, and no block left at the end.
Then end to end: a tiny Mistral with sliding_window 16 and block size 16 against transformers (greedy,
float32) with chunked prefill, prefix caching and preemption, holding fewer blocks than full attention;
and a prefill -> decode KV transfer of a windowed prompt, pulling only its last window.
"""
import random

import pytest

from engine.block_pool import NULL_BLOCK, BlockPool
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager, PrefixHit
from engine.request import FinishReason, Request, RequestStatus
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


# ---- the scheduler ---------------------------------------------------------------------------------


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


# ---- end to end: a tiny windowed Mistral ------------------------------------------------------------

E2E_WINDOW = 16
E2E_BLOCK = 16


@pytest.fixture(scope="module")
def windowed_mistral_dir(tmp_path_factory, tokenizer_dir):
    """A tiny random Mistral whose every layer slides over 16 tokens (GQA, odd sizes)."""
    from tests.engine.test_mistral import tiny_mistral
    return tiny_mistral(tmp_path_factory.mktemp("tiny-mistral-window"), tokenizer_dir, E2E_WINDOW)


@pytest.fixture(scope="module")
def full_attention_dir(windowed_mistral_dir, tmp_path_factory):
    """The same weights with the window off (every layer attends to everything): the block-count baseline."""
    import json
    path = tmp_path_factory.mktemp("tiny-mistral-full")
    for item in windowed_mistral_dir.iterdir():
        if item.name != "config.json":
            (path / item.name).symlink_to(item)
    raw = json.loads((windowed_mistral_dir / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    return path


def e2e_prompts(seed: int, lengths) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 49152) for _ in range(40)]  # a common prefix: prefix-cache hits
    return [(shared if i % 2 else []) + [rng.randrange(3, 49152) for _ in range(n - (40 if i % 2 else 0))]
            for i, n in enumerate(lengths)]


def generate_tracking_blocks(engine, prompts, params) -> tuple[list[list[int]], int, list]:
    """Greedy outputs, the most blocks in use after any step, and the outputs (cached token counts)."""
    from engine.outputs import CompletionCollector, RequestOutput
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    collector, peak = CompletionCollector(), 0
    while engine.has_unfinished():
        for delta in engine.step():
            collector.add(delta)
        peak = max(peak, engine.num_kv_blocks_used)
        for request in engine.scheduler.running:  # never a visible key in a released block
            assert engine.kv.window_intact(request.request_id, request.num_computed_tokens)
    outputs = [RequestOutput(rid, list(p), collector.completions(rid), collector.cached_tokens.get(rid, 0))
               for rid, p in zip(ids, prompts, strict=True)]
    return [o.completions[0].token_ids for o in outputs], peak, outputs


def test_windowed_mistral_equals_transformers_and_holds_fewer_blocks(windowed_mistral_dir, full_attention_dir):
    """Chunked prefill (32-token budget), prefix caching on: greedy tokens equal transformers' (whose Mistral
    masks by the window) in a cache of 8 usable blocks that forces preemptions, and in a roomy cache twice
    (the second time from prefix hits), where the prompts hold fewer blocks at their peak than the same
    weights under full attention."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from tests.conftest import hf_greedy
    from tests.engine.test_hf_equivalence import GREEDY, NEW_TOKENS
    prompts = e2e_prompts(5, [70, 90, 48, 85, 60])  # 3 to 6 windows long
    expected = hf_greedy(windowed_mistral_dir, prompts, NEW_TOKENS)

    def engine_for(path, num_blocks):
        return LLMEngine(EngineConfig(model=str(path), dtype="float32",
                                      scheduler=SchedulerConfig(max_num_batched_tokens=32),
                                      cache=CacheConfig(block_size=E2E_BLOCK, num_blocks=num_blocks)))

    engine = engine_for(windowed_mistral_dir, 9)
    assert engine.kv.sliding_window == E2E_WINDOW and engine.max_model_len == 8 * E2E_BLOCK
    got, _, _ = generate_tracking_blocks(engine, prompts, GREEDY)
    assert got == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.num_window_released > 0
    assert engine.kv.pool.num_used_blocks == 0 and not engine.kv.block_tables and not engine.has_unfinished()

    roomy, full = engine_for(windowed_mistral_dir, 64), engine_for(full_attention_dir, 64)
    assert full.kv.sliding_window is None
    got, peak, _ = generate_tracking_blocks(roomy, prompts, GREEDY)
    _, full_peak, _ = generate_tracking_blocks(full, prompts, GREEDY)
    assert got == expected and roomy.scheduler.num_preemptions == full.scheduler.num_preemptions == 0
    assert peak < full_peak
    again, _, outputs = generate_tracking_blocks(roomy, prompts, GREEDY)
    assert again == expected
    assert all(o.num_cached_tokens >= E2E_BLOCK * ((len(p) - 1) // E2E_BLOCK) for o, p in zip(outputs, prompts,
                                                                                             strict=True))
    assert roomy.kv.pool.num_used_blocks == 0 and not roomy.kv.block_tables


def test_prefill_to_decode_transfer_of_a_windowed_prompt_pulls_only_the_last_window(windowed_mistral_dir):
    """The prefill engine keeps and ships the prompt's whole table; the decode engine reserves only the
    blocks inside the first token's window (the rest stay the null block), pulls those, and continues as
    one engine would."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams as Params
    from kv_transfer import KVLayout, KVTransferConfig, TransferState, make_receiver, make_sender
    from tests.engine.test_engine_kv_transfer import finish_on_decode
    config = EngineConfig(model=str(windowed_mistral_dir), dtype="float32",
                          cache=CacheConfig(block_size=E2E_BLOCK, num_blocks=32),
                          scheduler=SchedulerConfig(max_num_batched_tokens=32))
    prefill, decode = LLMEngine(config), LLMEngine(config)
    prompt = e2e_prompts(9, [83])[0]
    params = Params(temperature=0, max_tokens=20, ignore_eos=True)
    expected = prefill.generate([prompt], params)[0].completions[0].token_ids

    prefill.add_request("p", prompt, Params(temperature=0, max_tokens=2), prefill_only=True)
    while True:
        deltas = prefill.step()
        if deltas:
            break
    first_token, src_table = deltas[0].token_ids[0], deltas[0].kv_block_ids
    assert len(src_table) == 6 and NULL_BLOCK not in src_table  # the prefill side shipped everything
    dst_table, num_local = decode.reserve_kv("d", prompt)
    # the first token's query (83) sees keys 68..83: only blocks 4 and 5 are needed
    assert num_local == 4 and dst_table[:4] == [NULL_BLOCK] * 4 and NULL_BLOCK not in dst_table[4:]
    assert decode.num_kv_blocks_used == 2

    layout = KVLayout.of_kv_cache(prefill.runner.kv_cache, "tiny-mistral-window")
    cfg = KVTransferConfig(backend="tcp", host="127.0.0.1")
    with make_sender(prefill.runner.kv_cache, layout, cfg) as sender, \
            make_receiver(decode.runner.kv_cache, layout, cfg) as receiver:
        lease = sender.expect("p", src_table, timeout_s=30)
        pull = receiver.read(sender.peer_info(), "p", src_table[num_local:], dst_table[num_local:], timeout_s=30,
                             capability=lease.capability)
        assert pull.wait(30) == TransferState.DONE
        assert lease.wait(10) == TransferState.DONE
        assert pull.bytes_moved == 2 * layout.block_nbytes
    prefill.release_kv("p")
    finish_on_decode(prefill, decode, prompt, params, first_token, expected)
