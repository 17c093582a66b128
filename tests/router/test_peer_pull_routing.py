"""The prefill choice among compute here, pull then compute here, and wait for the holder, on constructed
views (router/routing_policy.py `prefill_plan`, router/worker_selector.py `pick_prefill`). Pure Python."""
import pytest

from common.protocol import worker_pb2
from engine.block_hash import hash_full_blocks
from router.admission import AdmissionQueue
from router.kv_index import KvIndex
from router.routing_policy import DEFAULT_PULL_S, Candidate, PullOption, RoutingPolicy
from router.worker_pool import WorkerPool
from router.worker_selector import WorkerSelector

BLOCK = 16
TOKEN_S = 0.001  # learnt: 1 ms per prompt token
BLOCK_BYTES = 737_280  # SmolLM2 in float32


def candidate(address, queued_blocks=0.0, cached=0, pull=None, block_s=None):
    return Candidate(address, queued_blocks=queued_blocks, cached_blocks=cached, held_blocks=cached,
                     token_s=TOKEN_S, request_s=0.02, pull=pull, block_s=block_s, block_bytes=BLOCK_BYTES)


def test_the_three_options_each_win_where_they_should():
    policy = RoutingPolicy("prefix")
    prompt = 42
    holder = candidate("h:1", cached=40)
    other = candidate("o:1", pull=PullOption("h:1", 40))
    # Both idle: the holder computes 2 blocks; the other would move 40 first. Wait for the holder.
    assert policy.pick_prefill([holder, other], prompt) is holder
    # The holder has 100 blocks queued (1.6 s): pulling 40 blocks (~30 ms at 1 GB/s) and computing 2 wins.
    holder.queued_blocks = 100
    assert policy.pick_prefill([holder, other], prompt) is other
    plan = policy.prefill_plan(other, prompt)
    assert plan.pull_blocks == 40
    assert plan.seconds == pytest.approx(DEFAULT_PULL_S + 40 * BLOCK_BYTES / 1e9 + 2 * BLOCK * TOKEN_S + 0.02)
    # A link that moves a block slower than it is computed: the other computes everything instead.
    other.block_s = 2 * BLOCK * TOKEN_S
    plan = policy.prefill_plan(other, prompt)
    assert plan.pull_blocks == 0 and plan.seconds == pytest.approx(prompt * BLOCK * TOKEN_S + 0.02)
    assert policy.pick_prefill([holder, other], prompt) is other  # still sooner than the holder's queue
    holder.queued_blocks = 10  # a short queue: waiting for the holder beats computing 42 blocks
    assert policy.pick_prefill([holder, other], prompt) is holder


def test_the_spread_point_follows_the_learnt_speeds_not_a_weight():
    """A hot prefix stays on its holder until the holder's queue costs more than a pull: with a slower link
    (learnt) that point moves out, with no setting changed."""
    policy = RoutingPolicy("prefix")

    def spread_at(block_s):
        for queued in range(0, 400):
            holder = candidate("h:1", queued_blocks=queued, cached=40)
            other = candidate("o:1", pull=PullOption("h:1", 40), block_s=block_s)
            if policy.pick_prefill([holder, other], 41) is other:
                return queued
        return None

    fast, slow = spread_at(0.0001), spread_at(0.0005)
    assert fast is not None and slow is not None and fast < slow


def test_only_blocks_past_the_candidates_own_are_pulled():
    policy = RoutingPolicy("prefix")
    c = candidate("o:1", cached=10, pull=PullOption("h:1", 40))
    assert policy.prefill_plan(c, 42).pull_blocks == 30
    assert policy.prefill_plan(candidate("o:1", cached=40, pull=PullOption("h:1", 40)), 42).pull_blocks == 0


@pytest.mark.parametrize("name", ["least_loaded", "round_robin", "random"])
def test_other_policies_never_pull(name):
    c = candidate("o:1", pull=PullOption("h:1", 40))
    assert RoutingPolicy(name, seed=0).prefill_plan(c, 42).pull_blocks == 0


PROMPT = list(range(100, 100 + 42 * BLOCK + 5))
HASHES = hash_full_blocks(PROMPT, BLOCK)


def make(peer_pulls=True):
    pool = WorkerPool(["h:1", "o:1"], ["d:1"])
    for w in pool.workers:
        w.healthy = True
        w.stats = worker_pb2.WorkerStats(role=w.role, block_size=BLOCK, max_num_requests=8, kv_blocks_total=1000,
                                         kv_block_bytes=BLOCK_BYTES)
        w.speed.token_s, w.speed.request_s = TOKEN_S, 0.02
        w.speed._seen_long = w.speed._seen_short = True  # as if learnt from its calls
    index = KvIndex()
    for w in pool.workers:
        index.load_snapshot(w.address, 0, [])
    selector = WorkerSelector(pool, index, RoutingPolicy("prefix"), AdmissionQueue(0, 1.0), 32,
                              peer_pulls=peer_pulls)
    return pool, index, selector


def test_the_selector_plans_a_pull_from_a_busy_holder():
    pool, index, selector = make()
    index.load_snapshot("h:1", 1, [(h, "device") for h in HASHES[:40]])
    pick = selector.pick_prefill(len(PROMPT), HASHES)
    assert (pick.worker.address, pick.pull) == ("h:1", None)  # idle holder: it computes the rest
    pool.get("h:1").stats.num_waiting_tokens = 100 * BLOCK
    pick = selector.pick_prefill(len(PROMPT), HASHES)
    assert pick.worker.address == "o:1" and pick.pull == PullOption("h:1", 40)
    assert pick.predicted_s == pytest.approx(DEFAULT_PULL_S + 40 * BLOCK_BYTES / 1e9 + 2 * BLOCK * TOKEN_S + 0.02)
    # The link into o:1, learnt from its pulls, is slow: computing there beats pulling.
    pool.get("o:1").link.bytes_per_s = BLOCK_BYTES / (2 * BLOCK * TOKEN_S)
    pick = selector.pick_prefill(len(PROMPT), HASHES)
    assert pick.worker.address == "o:1" and pick.pull is None
    _, _, off = make(peer_pulls=False)
    assert off.pick_prefill(len(PROMPT), HASHES).pull is None


def test_blocks_a_busy_holder_keeps_in_a_lower_tier_are_pulled_too():
    """Host memory, then disk after it: the holder loads them back for the lease."""
    pool, index, selector = make()
    index.load_snapshot("h:1", 1, [(h, "cpu") for h in HASHES[:30]] + [(h, "disk") for h in HASHES[30:40]])
    pool.get("h:1").stats.num_waiting_tokens = 100 * BLOCK
    pick = selector.pick_prefill(len(PROMPT), HASHES)
    assert pick.worker.address == "o:1" and pick.pull == PullOption("h:1", 40)


def test_the_prompts_last_block_is_never_pulled():
    """A prompt of whole blocks computes its last one (its logits): the lease stops a block short."""
    pool, index, selector = make()
    prompt = PROMPT[:42 * BLOCK]
    hashes = hash_full_blocks(prompt, BLOCK)
    index.load_snapshot("h:1", 1, [(h, "device") for h in hashes])
    pool.get("h:1").stats.num_waiting_tokens = 100 * BLOCK
    assert selector.pick_prefill(len(prompt), hashes).pull == PullOption("h:1", 41)


def test_a_polled_queue_is_taken_as_drained_at_the_learnt_speed_since_the_poll():
    """Others' work is seen only in polls: 1,600 tokens waiting 1 s ago at 1 ms per token is 600 now, a
    request seen at work is done after its learnt time, and work that has long drained no longer sends a
    returning prompt away from its idle holder."""
    import asyncio

    from router.worker_selector import _load_now

    async def scenario():
        pool, index, selector = make()
        holder = pool.get("h:1")
        holder.stats.num_waiting_tokens = 1600
        now = asyncio.get_running_loop().time()
        holder.answered_at = now - 1.0
        assert _load_now(holder)[0] == pytest.approx(600, abs=20)
        index.load_snapshot("h:1", 1, [(h, "device") for h in HASHES[:40]])
        holder.stats.num_requests = holder.in_flight_at_poll + 1  # another router's request, seen at work
        assert _load_now(holder)[1] == 1
        holder.answered_at = now - 5.0  # all drained long ago: the holder computes the rest
        assert _load_now(holder) == (0.0, 0)
        pick = selector.pick_prefill(len(PROMPT), HASHES)
        assert pick.worker.address == "h:1" and pick.pull is None
        holder.answered_at = now  # just polled: busy, the other pulls
        assert selector.pick_prefill(len(PROMPT), HASHES).pull == PullOption("h:1", 40)
    asyncio.run(scenario())


def test_an_unmeasured_worker_is_priced_like_its_measured_peers():
    """Not by the prior: a prior slower than the truth would let measured peers take its prefixes for good."""
    pool, index, selector = make()
    fresh = pool.get("o:1")
    fresh.speed = type(fresh.speed)()  # nothing learnt yet: the prior
    speeds = selector._speeds()
    assert speeds(fresh) == pytest.approx((TOKEN_S, 0.02)) and speeds(pool.get("h:1")) == pytest.approx((TOKEN_S, 0.02))
    for w in pool.workers:
        w.speed = type(w.speed)()
    assert selector._speeds()(fresh) == (None, None)  # nobody measured: the policy's defaults


def test_a_decode_worker_holding_the_conversation_is_a_holder_too():
    """The decode worker that served the last turn holds its context (answers included): a prefill worker
    pulls it from there rather than compute it."""
    pool, index, selector = make()
    index.load_snapshot("d:1", 1, [(h, "device") for h in HASHES[:40]])
    pick = selector.pick_prefill(len(PROMPT), HASHES)
    assert pick.worker.address in ("h:1", "o:1") and pick.pull == PullOption("d:1", 40)


def make_local(peer_pulls=True):
    """No prefill pool: the decode workers compute prompts themselves."""
    pool = WorkerPool([], ["d:1", "d:2"])
    for w in pool.workers:
        w.healthy = True
        w.stats = worker_pb2.WorkerStats(role=w.role, block_size=BLOCK, max_num_requests=8, kv_blocks_total=1000,
                                         kv_block_bytes=BLOCK_BYTES)
    index = KvIndex()
    for w in pool.workers:
        index.load_snapshot(w.address, 0, [])
    index.load_snapshot("d:1", 1, [(h, "device") for h in HASHES[:40]])
    selector = WorkerSelector(pool, index, RoutingPolicy("prefix"), AdmissionQueue(0, 1.0), peer_pulls=peer_pulls)
    return pool, index, selector


def test_a_decode_worker_computing_the_prompt_pulls_what_a_busy_peer_holds():
    pool, index, selector = make_local()
    route = selector._reserve(PROMPT, HASHES)
    assert (route.decode.address, route.remote_prefill, route.pull) == ("d:1", False, None)  # the idle holder
    for _ in range(2):  # d:1 is two requests busier
        pool.get("d:1").begin_decode()
    route = selector._reserve(PROMPT, HASHES)
    assert route.decode.address == "d:2" and route.pull == PullOption("d:1", 40)
    # Without pulls the held context outweighs the same load: the choice stays with the holder.
    pool, index, selector = make_local(peer_pulls=False)
    for _ in range(2):
        pool.get("d:1").begin_decode()
    assert selector._reserve(PROMPT, HASHES).decode.address == "d:1"


def test_a_peer_copy_is_worth_to_the_decode_choice_what_its_pull_saves():
    policy = RoutingPolicy("prefix")
    holder = Candidate("d:1", running=1, cached_blocks=40)
    other = Candidate("d:2", pull=PullOption("d:1", 40), block_bytes=BLOCK_BYTES)
    assert policy.pull_worth(other, 42) == pytest.approx(40 * (1 - BLOCK_BYTES / 1e9 / (BLOCK * 0.0009)))
    assert policy.decode_cost(other, 42) < policy.decode_cost(holder, 42)
    other.block_s = 2 * BLOCK * 0.0009  # a link slower than computing: the copy is worth nothing
    assert policy.pull_worth(other, 42) == 0
    assert policy.decode_cost(other, 42) > policy.decode_cost(holder, 42)


def test_hits_are_counted_by_source_and_by_the_medium_holding_them():
    from prometheus_client import CollectorRegistry

    from router.routing_metrics import RoutingMetrics
    pool, index, selector = make()
    selector.metrics = metrics = RoutingMetrics(CollectorRegistry(), index, lambda: 0)
    index.load_snapshot("o:1", 1, [(h, "device") for h in HASHES[:5]])
    index.load_snapshot("h:1", 1, [(h, "device") for h in HASHES[:20]] + [(h, "cpu") for h in HASHES[20:40]])
    pool.get("h:1").stats.num_waiting_tokens = 100 * BLOCK
    assert selector.pick_prefill(len(PROMPT), HASHES).pull == PullOption("h:1", 40)

    def hits(source, medium):
        return metrics.hits_by_source.labels(source, medium)._value.get()
    assert (hits("local", "device"), hits("peer", "device"), hits("peer", "cpu")) == (5, 15, 20)
    pool, index, selector = make_local()
    selector.metrics = metrics = RoutingMetrics(CollectorRegistry(), index, lambda: 0)
    pool.get("d:1").begin_decode()
    pool.get("d:1").begin_decode()
    assert selector._reserve(PROMPT, HASHES).pull == PullOption("d:1", 40)
    assert hits("peer", "device") == 40  # a decode worker computing the prompt: its pull counts too
