"""Scheduler lifecycle without torch: budgets, chunking, preemption, preloaded KV."""
import subprocess
import sys

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.request import FinishReason, Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

BS = 4


def make(num_blocks=32, budget=16, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs), kv)


def req(rid, n_prompt, max_tokens=4, first=0):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, token=7):
    """One fake engine step: every sampling request gets `token`; finish at max_tokens."""
    out = s.schedule()
    sampling = [i.request for i in out.scheduled if i.samples]
    s.finish_step(out)
    for r in sampling:
        r.append_token(token)
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish(r, FinishReason.LENGTH)
    return out


def assert_empty(s: Scheduler):
    assert not s.has_unfinished() and not s.requests
    assert s.kv.pool.num_free_blocks == s.kv.pool.num_blocks
    assert not s.kv.block_tables


def test_core_imports_without_torch():
    code = ("import sys, engine.scheduler, engine.kv_cache_manager, engine.block_pool; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_prompt_is_chunked_by_the_token_budget():
    s = make(budget=16)
    s.add_request(req("a", 40))
    sizes = [[i.num_new_tokens for i in run_step(s).scheduled] for _ in range(3)]
    assert sizes == [[16], [16], [8]]
    r = s.requests["a"]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 40
    while s.has_unfinished():
        run_step(s)
    assert_empty(s)


def test_decode_and_prefill_share_a_step():
    s = make(budget=16)
    s.add_request(req("a", 8))
    run_step(s)
    s.add_request(req("b", 30, first=100))
    out = run_step(s)
    assert [(i.request.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 15)]
    while s.has_unfinished():
        run_step(s)
    assert_empty(s)


def test_max_num_seqs_limits_running():
    s = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), 4, first=10 * i))
    out = run_step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 1
    while s.has_unfinished():
        run_step(s)
    assert_empty(s)


def test_preemption_by_recompute_when_blocks_run_out():
    s = make(num_blocks=6, budget=64, max_seqs=8, caching=False)
    s.add_request(req("a", 8, max_tokens=8))
    s.add_request(req("b", 8, max_tokens=8, first=50))
    run_step(s)  # a, b: 2 blocks each (2 free left)
    preempted = []
    steps = 0
    while s.has_unfinished():
        out = run_step(s)
        preempted += [r.request_id for r in out.preempted]
        steps += 1
        assert steps < 100
    assert preempted and preempted[0] == "b"  # the newest running request goes first
    assert s.num_preemptions >= 1
    assert_empty(s)


def test_prefix_hit_skips_cached_tokens():
    s = make(budget=64)
    s.add_request(req("a", 12, max_tokens=1))
    run_step(s)
    assert_empty(s)
    s.add_request(req("b", 14, max_tokens=1))
    out = run_step(s)
    assert out.scheduled[0].num_new_tokens == 14 - 12
    assert out.scheduled[0].request.num_cached_tokens == 12
    assert_empty(s)


def test_request_with_preloaded_kv_starts_where_kv_ends():
    s = make(budget=64)
    r = req("d", 10, max_tokens=3)
    r.append_token(5)  # first token came with the KV (decode role)
    assert s.kv.allocate_slots("d", 0, 10) == []  # blocks the transferred KV landed in
    r.num_computed_tokens = 10
    s.add_request(r)
    out = run_step(s)
    assert [(i.num_new_tokens, i.samples) for i in out.scheduled] == [(1, True)]
    assert r.output_token_ids == [5, 7]
    # the transferred blocks enter the prefix cache with the first step (the worker's later hits, KV events)
    assert s.kv.find_prefix("probe", list(range(10)) + [5]).num_tokens == 8
    s.kv.free("probe")
    while s.has_unfinished():
        run_step(s)
    assert_empty(s)


def test_abort_frees_waiting_and_running():
    s = make(budget=8)
    s.add_request(req("a", 20))
    s.add_request(req("b", 4, first=40))
    run_step(s)
    assert s.requests["a"].status == RequestStatus.RUNNING
    s.finish(s.requests["a"], FinishReason.ABORT)
    s.finish(s.requests["b"], FinishReason.ABORT)
    assert_empty(s)


def test_micro_batches_skip_requests_in_flight_and_never_preempt_them():
    """A pipeline keeps two steps in flight: the second holds the other requests, at most `max_requests` each, and
    when blocks run short the newest request not in flight is preempted, never one a stage still computes."""
    s = make(num_blocks=5, budget=64, max_seqs=8, caching=False)
    for i, rid in enumerate("abcd"):
        s.add_request(req(rid, 4, max_tokens=8, first=20 * i))
    first = s.schedule(max_requests=2)
    s.finish_step(first)
    in_flight = {i.request.request_id for i in first.scheduled}
    second = s.schedule(in_flight, max_requests=2)
    s.finish_step(second)
    assert in_flight == {"a", "b"} and [i.request.request_id for i in second.scheduled] == ["c", "d"]
    assert s.schedule({"a", "b", "c", "d"}).scheduled == []  # all in flight: nothing to run
    for r in (s.requests[x] for x in "ab"):  # a and b collected: their tokens sampled
        r.append_token(7)
    # One block is free; a and b each need one for their next token. The newest request is d, but c and d are in
    # flight: b (newest of the others) is preempted, not d.
    third = s.schedule({"c", "d"})
    assert [r.request_id for r in third.preempted] == ["b"] and [i.request.request_id for i in third.scheduled] == ["a"]
    assert s.requests["c"].status == RequestStatus.RUNNING and s.requests["d"].status == RequestStatus.RUNNING
