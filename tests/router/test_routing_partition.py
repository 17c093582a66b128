"""The prefix policy on synthetic pools: rendezvous partitioning, holder hysteresis, decode affinity,
determinism, learnt prefill speed. Pure Python, no network."""
import asyncio
import random

import pytest

from engine.block_hash import hash_full_blocks
from router.routing_policy import Candidate, PrefillSpeed, RoutingPolicy, routing_key

BS = 16


def on_device(hashes: list[int]) -> list[tuple[int, str]]:
    return [(h, "device") for h in hashes]


def prompt_hashes(i: int, blocks: int = 40) -> list[int]:
    return hash_full_blocks([7000 + i] + list(range(1, blocks * BS)), BS)


def test_ties_spread_by_rendezvous_hash_and_homes_survive_churn():
    policy = RoutingPolicy("prefix")
    pool = [Candidate(f"10.0.0.{i}:7000") for i in range(1, 4)]
    homes = {}
    for i in range(300):
        hashes = prompt_hashes(i)
        chosen = policy.pick_prefill(pool, len(hashes), routing_key(hashes))
        assert policy.pick_prefill(pool[::-1], len(hashes), routing_key(hashes)) is chosen  # order-free
        homes[i] = chosen.address
    counts = [list(homes.values()).count(c.address) for c in pool]
    assert all(70 <= n <= 130 for n in counts), counts  # ~100 each, not all on the smallest address
    # A worker leaves: only the prefixes homed on it move; the others keep their home.
    gone, rest = pool[0], pool[1:]
    for i in range(300):
        hashes = prompt_hashes(i)
        new = policy.pick_prefill(rest, len(hashes), routing_key(hashes)).address
        if homes[i] != gone.address:
            assert new == homes[i]


def full_cache(address: str, cached: int = 0, queued: float = 0.0) -> Candidate:
    return Candidate(address, cached_blocks=cached, queued_blocks=queued, kv_blocks_total=100, kv_blocks_cached=100)


def test_prefix_sticks_to_its_holder_under_small_imbalance_and_moves_past_the_bound():
    policy = RoutingPolicy("prefix")
    hashes = prompt_hashes(1)  # 40 blocks
    key = routing_key(hashes)
    # Under cache pressure a copy costs the miss (40 blocks) plus the 40 hot blocks it evicts: the
    # holder keeps the prefix until 80 blocks of work wait ahead of it (x 1.2 near-tie tolerance).
    for queued, stays in ((30, True), (70, True), (90, True), (120, False)):
        holder, idle = full_cache("b:1", cached=40, queued=queued), full_cache("a:1")
        assert (policy.pick_prefill([idle, holder], 40, key) is holder) is stays, queued
    # Without pressure a copy evicts nothing, so the prefix moves as soon as the queue outweighs the miss.
    holder, idle = Candidate("b:1", cached_blocks=40, queued_blocks=60), Candidate("a:1")
    assert policy.pick_prefill([idle, holder], 40, key) is idle
    holder.queued_blocks = 20
    assert policy.pick_prefill([idle, holder], 40, key) is holder


def test_near_ties_prefer_the_holder_then_the_home():
    policy = RoutingPolicy("prefix")
    hashes = prompt_hashes(3)
    key = routing_key(hashes)
    a, b = Candidate("a:1"), Candidate("b:1")
    home = policy.pick_prefill([a, b], 40, key)
    other = b if home is a else a
    other.cached_blocks = 4  # holds the key blocks: a slightly cheaper near-tie, and the holder
    assert policy.pick_prefill([a, b], 40, key) is other
    other.cached_blocks, home.queued_blocks = 0, 2  # the home is 2 blocks busier: still a near-tie
    assert policy.pick_prefill([a, b], 40, key) is home


def test_a_shared_header_block_does_not_make_a_holder():
    # Every prompt starts with the same 2-block preamble; whoever served the first one holds it.
    # New prefixes must still spread by their own key, not all follow the preamble's holder.
    policy = RoutingPolicy("prefix")
    pool = [Candidate("a:1", cached_blocks=2), Candidate("b:1")]
    chosen = set()
    for i in range(40):
        hashes = hash_full_blocks([5] * 2 * BS + [9000 + i] + list(range(1, 38 * BS)), BS)
        chosen.add(policy.pick_prefill(pool, len(hashes), routing_key(hashes)).address)
    assert chosen == {"a:1", "b:1"}


def test_decode_choice_prefers_the_worker_holding_the_context():
    policy = RoutingPolicy("prefix")
    hashes = prompt_hashes(5)
    key = routing_key(hashes)
    a, b = Candidate("a:1"), Candidate("b:1")
    home = policy.pick_decode([a, b], len(hashes), key)
    holder = b if home is a else a
    holder.cached_blocks = 38
    assert policy.pick_decode([a, b], len(hashes), key) is holder
    holder.running = 1  # 1 + 0.1 < 2: the context is worth more than one running request
    assert policy.pick_decode([a, b], len(hashes), key) is holder
    holder.running = 3
    assert policy.pick_decode([a, b], len(hashes), key) is home


def test_two_policies_with_the_same_view_choose_identically():
    rng = random.Random(4)
    p1, p2 = RoutingPolicy("prefix"), RoutingPolicy("prefix")
    for i in range(500):
        def view(seed=i):
            r = random.Random(seed)
            return [Candidate(f"10.0.{w}.1:7000", queued_blocks=r.randrange(0, 60), running=r.randrange(3),
                              cached_blocks=r.choice([0, 0, 4, 20, 40]), kv_blocks_used=r.randrange(50),
                              kv_blocks_total=100, kv_blocks_cached=r.randrange(100),
                              token_s=0.001, request_s=0.1) for w in range(6)]
        hashes = prompt_hashes(rng.randrange(50))
        v1, v2 = view(), view()
        rng.shuffle(v2)
        assert p1.pick_prefill(v1, 40, routing_key(hashes)).address == \
            p2.pick_prefill(v2, 40, routing_key(hashes)).address
        assert p1.pick_decode(v1, 40, routing_key(hashes)).address == \
            p2.pick_decode(v2, 40, routing_key(hashes)).address


def test_prefill_speed_is_learnt_from_observed_calls():
    speed = PrefillSpeed()
    assert speed.estimate() == (speed.prior_token_s, speed.prior_request_s)
    for i in range(40):  # 2 ms per token + 50 ms per request, misses and hits mixed
        tokens = 600 if i % 3 == 0 else 20
        speed.observe(tokens, 0.05 + 0.002 * tokens)
    token_s, request_s = speed.estimate()
    assert token_s == pytest.approx(0.002, rel=0.02) and request_s == pytest.approx(0.05, rel=0.05)
    one_size = PrefillSpeed()
    for _ in range(5):
        one_size.observe(600, 1.2)
    token_s, request_s = one_size.estimate()
    assert 600 * token_s + request_s == pytest.approx(1.2)  # the total is right; split by the prior
    # A slower machine: the estimate follows within a few calls.
    for _ in range(20):
        speed.observe(600, 0.1 + 0.004 * 600)
        speed.observe(20, 0.1 + 0.004 * 20)
    assert speed.estimate()[0] == pytest.approx(0.004, rel=0.1)


def test_selector_sends_a_returning_prompt_to_the_decode_worker_holding_it_and_skips_prefill():
    from common.protocol import worker_pb2
    from router.admission import AdmissionQueue
    from router.kv_index import KvIndex
    from router.worker_pool import WorkerPool
    from router.worker_selector import WorkerSelector

    prompt = list(range(100, 200))  # 6 blocks
    hashes = hash_full_blocks(prompt, BS)

    async def scenario():
        pool = WorkerPool(["p1:1", "p2:1"], ["d1:1", "d2:1"])
        index = KvIndex()
        for w in pool.workers:
            w.healthy = True
            w.stats = worker_pb2.WorkerStats(role=w.role, block_size=BS, max_num_requests=8, kv_blocks_total=100)
            index.load_snapshot(w.address, 0, [])
        selector = WorkerSelector(pool, index, RoutingPolicy("prefix"), AdmissionQueue(0, 1.0), 32)
        home = (await selector.route(prompt, hashes)).decode.address
        other = "d2:1" if home == "d1:1" else "d1:1"
        index.load_snapshot(other, 1, on_device(hashes[:5]))  # 20 of 100 tokens uncached there
        route = await selector.route(prompt, hashes)
        assert route.decode.address == other and not route.remote_prefill
    asyncio.run(scenario())
