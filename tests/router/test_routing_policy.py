"""The routing cost formulas and tie-breaks, without workers."""
import pytest

from router.routing_policy import Candidate, RoutingPolicy, RoutingWeights


def test_prefix_prefers_cached_worker_until_load_outweighs_it():
    policy = RoutingPolicy("prefix")
    cached = Candidate("b:1", cached_blocks=60)
    idle = Candidate("a:1")
    assert policy.pick_prefill([idle, cached], 64) is cached
    cached.queued_blocks = 59  # 4 + 59 < 64 + 0
    assert policy.pick_prefill([idle, cached], 64) is cached
    cached.queued_blocks = 61  # 4 + 61 > 64
    assert policy.pick_prefill([idle, cached], 64) is idle
    cached.queued_blocks, cached.running = 0, 8  # 4 + 8 requests x 8 blocks > 64
    assert policy.pick_prefill([idle, cached], 64) is idle
    # overlap_weight scales the cache term against load.
    heavy = RoutingPolicy("prefix", RoutingWeights(overlap_weight=2.0))
    assert heavy.pick_prefill([idle, cached], 64) is cached


def test_ties_break_by_address_in_any_order():
    policy = RoutingPolicy("prefix")
    c = [Candidate("10.0.0.2:5"), Candidate("10.0.0.1:5"), Candidate("10.0.0.3:5")]
    assert policy.pick_prefill(c, 8).address == "10.0.0.1:5"
    assert policy.pick_prefill(c[::-1], 8).address == "10.0.0.1:5"
    assert policy.pick_decode(c).address == "10.0.0.1:5"


def test_least_loaded_ignores_the_cache_and_decode_weighs_kv():
    policy = RoutingPolicy("least_loaded")
    cached = Candidate("a:1", cached_blocks=60, queued_blocks=1)
    idle = Candidate("b:1")
    assert policy.pick_prefill([cached, idle], 64) is idle
    full = Candidate("a:1", running=1, kv_blocks_used=90, kv_blocks_total=100)
    busy = Candidate("b:1", running=3, kv_blocks_used=10, kv_blocks_total=100)
    assert policy.pick_decode([full, busy]) is busy  # 1 + 4 * 0.9 > 3 + 4 * 0.1
    assert RoutingPolicy("prefix", RoutingWeights(kv_weight=1)).pick_decode([full, busy]) is full  # 1.9 < 3.1


def test_round_robin_cycles_by_address_and_random_covers_all():
    policy = RoutingPolicy("round_robin")
    c = [Candidate("b:1"), Candidate("a:1")]
    assert [policy.pick_prefill(c, 1).address for _ in range(4)] == ["a:1", "b:1", "a:1", "b:1"]
    rnd = RoutingPolicy("random", seed=1)
    assert {rnd.pick_decode(c).address for _ in range(50)} == {"a:1", "b:1"}
    assert policy.pick_decode([]) is None


def test_bad_policy_and_weights_are_refused():
    with pytest.raises(ValueError, match="routing policy"):
        RoutingPolicy("fastest")
    with pytest.raises(ValueError, match="weights"):
        RoutingWeights(overlap_weight=-1)
