"""WorkerSelector without a network: reservations, skip-prefill, in-progress prefixes, no worker."""
import asyncio

import pytest

from common.protocol import worker_pb2
from engine.block_hash import hash_full_blocks
from router.admission import AdmissionQueue, AdmissionRejected
from router.kv_index import KvIndex
from router.routing_policy import RoutingPolicy
from router.worker_pool import WorkerPool
from router.worker_selector import NoHealthyWorker, WorkerSelector

PROMPT = list(range(100, 200))  # 6 full blocks of 16
HASHES = hash_full_blocks(PROMPT, 16)


def on_device(hashes: list[int]) -> list[tuple[int, str]]:
    return [(h, "device") for h in hashes]


def pick(selector, *args, **kwargs):
    """(prefill worker, blocks it holds) of a pick."""
    chosen = selector.pick_prefill(*args, **kwargs)
    return chosen.worker, chosen.held


def make(prefill=("p1:1", "p2:1"), decode=("d1:1",), max_requests=2, skip=32):
    pool = WorkerPool(list(prefill), list(decode))
    for w in pool.workers:
        w.healthy = True
        w.stats = worker_pb2.WorkerStats(role=w.role, block_size=16, max_num_requests=max_requests,
                                         kv_blocks_total=100)
    index = KvIndex()
    for w in pool.workers:
        index.load_snapshot(w.address, 0, [])
    return pool, index, WorkerSelector(pool, index, RoutingPolicy("prefix"), AdmissionQueue(0, 1.0), skip)


def test_decode_slots_are_reserved_until_released_then_refused():
    async def scenario():
        pool, _, selector = make()
        routes = [await selector.route(PROMPT, HASHES) for _ in range(2)]
        assert pool.get("d1:1").in_flight == 2 and all(r.remote_prefill for r in routes)
        with pytest.raises(AdmissionRejected):  # queue of 0: refused at once
            await selector.route(PROMPT, HASHES)
        selector.release(routes[0])
        assert (await selector.route(PROMPT, HASHES)).decode.address == "d1:1"
    asyncio.run(scenario())


def test_no_healthy_decode_worker_is_unavailable_not_saturated():
    async def scenario():
        pool, _, selector = make()
        pool.get("d1:1").healthy = False
        with pytest.raises(NoHealthyWorker):
            await selector.route(PROMPT, HASHES)
    asyncio.run(scenario())


def test_decode_prefills_itself_when_it_holds_nearly_all_the_prompt():
    async def scenario():
        _, index, selector = make()
        index.load_snapshot("d1:1", 1, on_device(HASHES[:5]))  # 80 of 100 tokens: 20 uncached < 32
        assert not (await selector.route(PROMPT, HASHES)).remote_prefill
        index.load_snapshot("d1:1", 2, on_device(HASHES[:4]))  # 36 uncached
        assert (await selector.route(PROMPT, HASHES)).remote_prefill
    asyncio.run(scenario())


def test_prefill_goes_to_the_holder_or_to_the_worker_already_computing_the_prefix():
    pool, index, selector = make()
    index.load_snapshot("p2:1", 1, on_device(HASHES[:3]))
    assert pick(selector, len(PROMPT), HASHES) == (pool.get("p2:1"), 3)
    # A new prefix: nobody holds it, but p1 is prefilling a prompt that starts with it.
    other = hash_full_blocks(list(range(500, 600)), 16)
    pool.get("p1:1").begin_prefill("x", 4, other)  # almost done: little queued ahead
    assert pick(selector, 100, other) == (pool.get("p1:1"), 6)
    assert pick(selector, 100, other, exclude=(pool.get("p1:1"),))[0] is pool.get("p2:1")
    pool.get("p1:1").end_prefill("x")  # done: the prefix is no longer being computed there
    assert pick(selector, 100, other)[1] == 0


def test_the_ledger_is_balanced_by_its_begin_and_end_calls():
    pool, _, _ = make()
    worker = pool.get("p1:1")
    worker.begin_prefill("a", 40, [1, 2])
    worker.begin_prefill("b", 7, [3])
    assert (worker.in_flight, worker.pending_tokens, set(worker.pending_prompts)) == (2, 47, {"a", "b"})
    worker.end_prefill("a", computed_tokens=40, seconds=0.5)  # ran alone: the speed learns from it
    assert (worker.in_flight, worker.pending_tokens, set(worker.pending_prompts)) == (1, 7, {"b"})
    assert worker.speed.count == 1
    worker.end_prefill("b")
    assert (worker.in_flight, worker.pending_tokens, worker.pending_prompts) == (0, 0, {})
    decode = pool.get("d1:1")
    decode.begin_decode()
    assert decode.in_flight == 1
    decode.end_decode()
    assert decode.in_flight == 0


def test_prefill_leases_are_not_load():
    pool, index, selector = make()
    index.load_snapshot("p2:1", 1, on_device(HASHES[:3]))
    holder = pool.get("p2:1")
    # The last stats poll saw this router's finished request as a lease (its call had returned):
    # that is no prefill work, so the holder of the prefix keeps it.
    holder.stats.num_requests, holder.stats.num_leases = 1, 1
    assert holder.occupancy == 1 and holder.working == 0
    assert pick(selector, len(PROMPT), HASHES) == (holder, 3)
    holder.stats.num_leases = 0  # a queued request of another router's: real work (8 blocks > 3)
    assert pick(selector, len(PROMPT), HASHES)[0] is pool.get("p1:1")


LONG = list(range(1000, 1640))  # 40 full blocks: a lower tier's discount is more than a near-tie
LONG_HASHES = hash_full_blocks(LONG, 16)


def test_a_host_memory_holder_beats_a_miss_and_loses_to_a_device_holder():
    pool, index, selector = make(prefill=("p1:1", "p2:1", "p3:1"))
    index.load_snapshot("p2:1", 1, [(h, "cpu") for h in LONG_HASHES])
    index.load_snapshot("p3:1", 1, on_device(LONG_HASHES))
    cached = {c.address: c.cached_blocks for c in selector._candidates(pool.healthy("prefill"), LONG_HASHES)}
    assert cached == pytest.approx({"p1:1": 0.0, "p2:1": 0.8 * 40, "p3:1": 40.0})
    assert pick(selector, len(LONG), LONG_HASHES, exclude=(pool.get("p3:1"),)) == (pool.get("p2:1"), 40)
    assert pick(selector, len(LONG), LONG_HASHES) == (pool.get("p3:1"), 40)
    # The same with the two holders' media swapped: the cost decides, not the rendezvous home.
    index.load_snapshot("p2:1", 2, on_device(LONG_HASHES))
    index.load_snapshot("p3:1", 2, [(h, "disk") for h in LONG_HASHES])
    assert pick(selector, len(LONG), LONG_HASHES) == (pool.get("p2:1"), 40)
    assert pick(selector, len(LONG), LONG_HASHES, exclude=(pool.get("p2:1"),)) == (pool.get("p3:1"), 40)


def test_decode_holding_the_prompt_in_host_memory_prefills_it_itself():
    async def scenario():
        _, index, selector = make()
        index.load_snapshot("d1:1", 1, [(h, "cpu") for h in HASHES[:5]])  # 20 uncached tokens: loads the rest
        route = await selector.route(PROMPT, HASHES)
        assert not route.remote_prefill and route.skip_reason == "cached"
    asyncio.run(scenario())


def test_device_pool_fullness_counts_device_blocks_only():
    pool, index, selector = make()
    index.load_snapshot("p1:1", 1, [(h, "disk") for h in HASHES] + on_device(HASHES[:2]))
    (candidate,) = selector._candidates([pool.get("p1:1")], HASHES)
    assert candidate.kv_blocks_cached == 2 and candidate.held == 6
