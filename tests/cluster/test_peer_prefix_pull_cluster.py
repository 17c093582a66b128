"""Peer prefix pulls between real prefill worker processes (SmolLM2), over real gRPC and kv_transfer.

One cluster for the module: prefill workers A and B, one decode worker, a router. Checked: the router
sends a returning prompt to B with a pull when its holder A is busy (B computes only the rest, the output
is the one A alone gives); called directly, B pulls a prefix A holds and computes the uncached rest with
the first token A would give, and pulls a finished turn's context (its answer included) from the decode
worker that served it; the decode worker, computing a prompt itself, pulls A's prefix too; a lease under
another tenant's salt finds nothing; an expired lease, and a holder killed after its lease was granted, fall
back to computing with the same first token; nothing is leaked on any live worker.
"""
import time

import grpc
import pytest

from common.protocol import generate_pb2, worker_pb2, worker_pb2_grpc
from tests.cluster.harness import assert_no_leaks, generate_routed, metric_value, start_cluster, stop_all

BLOCK = 16
PREFIX = list(range(2000, 2000 + 24 * BLOCK))  # 24 blocks A computes
PROMPT = PREFIX + list(range(7000, 7000 + 20))


@pytest.fixture(scope="module")
def cluster():
    procs = start_cluster(["prefill", "prefill", "decode"], router_flags=("--skip-prefill-tokens", "0"))
    yield procs
    stop_all(procs)


def stub(proc):
    return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(proc.address))


def prefill(proc, rid, prompt, **fields):
    """A greedy Prefill call; its lease (no decode worker here) is dropped at once."""
    greedy = generate_pb2.SamplingParams(max_tokens=4, temperature=0.0)
    response = stub(proc).Prefill(worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, params=greedy,
                                                            **fields), timeout=120)
    stub(proc).Abort(generate_pb2.AbortRequest(request_id=rid), timeout=10)
    return response


def lease(proc, lease_id, tokens, salt="", lease_s=10.0):
    return stub(proc).LeasePrefix(worker_pb2.PrefixLeaseRequest(lease_id=lease_id, token_ids=tokens, cache_salt=salt,
                                                                lease_s=lease_s), timeout=10)


def stats(proc):
    return stub(proc).GetStats(worker_pb2.StatsRequest(), timeout=10)


def test_the_router_pulls_from_a_busy_holder(cluster):
    *_, router = cluster
    prompt = list(range(30000, 30000 + 30 * BLOCK))
    first = generate_routed(router, prompt + [5, 6, 7])
    holder = next(p for p in cluster[:2] if p.address == first["prefill"])
    other = next(p for p in cluster[:2] if p is not holder)
    reference = generate_routed(router, prompt + [9, 9, 9])  # the idle holder answers it from its cache
    assert reference["prefill"] == holder.address and reference["cached"] == 30 * BLOCK
    # Keep the holder busy: prompts queued on it directly (the router sees them in its stats polls).
    busy = [stub(holder).Prefill.future(worker_pb2.PrefillRequest(
        request_id=f"busy-{i}", prompt_token_ids=list(range(40000 + 500 * i, 40000 + 500 * i + 480)),
        params=generate_pb2.SamplingParams(max_tokens=1)), timeout=300) for i in range(6)]
    deadline = time.monotonic() + 60
    while (metric_value(router.metrics_url, "pdserve:worker_num_requests", worker=holder.address) or 0) < 4:
        assert time.monotonic() < deadline, "the router never saw the holder busy"
        time.sleep(0.05)
    moved = generate_routed(router, prompt + [9, 9, 9])
    for f in busy:
        f.result()
    assert moved["prefill"] == other.address
    assert moved["cached"] == 30 * BLOCK  # pulled, not computed
    assert moved["tokens"] == reference["tokens"]
    assert metric_value(router.metrics_url, "pdserve:router_peer_pulls_total", outcome="leased") >= 1
    assert stats(other).peer_pulls >= 1
    assert_no_leaks(cluster[:3])


def test_b_pulls_what_a_holds_and_computes_the_rest(cluster):
    a, b = cluster[0], cluster[1]
    prefill(a, "warm", PREFIX + [1])
    expected = prefill(a, "ref", PROMPT)  # A's own answer (its cache holds the prefix)
    before = stats(b)
    answer = lease(a, "p~pull0", PREFIX)
    assert answer.num_tokens == len(PREFIX) and len(answer.kv.block_ids) == 24
    got = prefill(b, "p", PROMPT, prefix_kv=answer.kv)
    assert list(got.first.token_ids) == list(expected.first.token_ids)
    assert got.cached_tokens == len(PREFIX)  # B computed only the 20 tokens after it
    after = stats(b)
    assert (after.peer_pulls - before.peer_pulls, after.peer_pull_tokens - before.peer_pull_tokens) == (1, 24 * BLOCK)
    assert after.peer_pull_bytes - before.peer_pull_bytes == 24 * after.kv_block_bytes
    assert_no_leaks(cluster[:3])


def test_b_pulls_a_conversation_from_the_decode_worker_that_served_it(cluster):
    """The decode worker holds a finished turn's context, its answer included, which no prefill worker
    computed: the next turn's prefill pulls it from there."""
    a, b, decode, router = cluster
    prompt = list(range(20000, 20000 + 8 * BLOCK + 5))
    context = prompt + generate_routed(router, prompt, max_tokens=40)["tokens"]
    follow = context + list(range(25000, 25010))  # the next turn
    answer = lease(decode, "c~pull0", context[:(len(context) - 1) // BLOCK * BLOCK])
    assert answer.num_tokens > len(prompt)  # blocks of the answer too
    expected = prefill(a, "ref-c", follow)
    got = prefill(b, "c", follow, prefix_kv=answer.kv)
    assert list(got.first.token_ids) == list(expected.first.token_ids)
    assert got.cached_tokens >= answer.num_tokens
    assert_no_leaks(cluster[:3])


def test_a_decode_worker_computing_the_prompt_pulls_the_prefix_a_holds(cluster):
    """A Decode call with no first token (the decode worker prefills itself) carrying A's lease."""
    a, decode = cluster[0], cluster[2]
    prompt = list(range(40000, 40000 + 12 * BLOCK + 7))
    prefill(a, "warm-d", prompt[:12 * BLOCK] + [1])
    expected = prefill(a, "ref-d", prompt)
    answer = lease(a, "d~pull0", prompt[:12 * BLOCK])
    before = stats(decode)
    greedy = generate_pb2.SamplingParams(max_tokens=3, temperature=0.0)
    stream = stub(decode).Decode(worker_pb2.DecodeRequest(request_id="d", prompt_token_ids=prompt, params=greedy,
                                                          prefix_kv=answer.kv), timeout=120)
    msgs = list(stream)
    tokens = [t for m in msgs if m.HasField("chunk") for t in m.chunk.token_ids]
    assert tokens[0] == expected.first.token_ids[0]
    assert msgs[-1].complete.usage.cached_tokens == 12 * BLOCK  # pulled, not computed
    after = stats(decode)
    assert (after.peer_pulls - before.peer_pulls, after.peer_pull_tokens - before.peer_pull_tokens) == (1, 12 * BLOCK)
    assert_no_leaks(cluster[:3])


def test_a_lease_never_crosses_tenants(cluster):
    a = cluster[0]
    prefill(a, "salted", PREFIX + [2], cache_salt="tenant-a")
    assert lease(a, "x~pull0", PREFIX, salt="tenant-b").num_tokens == 0
    answer = lease(a, "y~pull0", PREFIX, salt="tenant-a")
    assert answer.num_tokens == len(PREFIX)
    stub(a).Abort(generate_pb2.AbortRequest(request_id="y~pull0"), timeout=10)
    assert_no_leaks(cluster[:3])


def assert_falls_back(cluster, name, blocks, break_lease, lease_s=10.0):
    """A holds `blocks` blocks of a prompt and leases them; `break_lease(a, lease)` breaks the lease; B, given
    the broken lease, computes the whole prompt with the first token A gives, and counts a fallback."""
    a, b = cluster[0], cluster[1]
    prompt = list(range(9000 + 1000 * blocks, 9000 + 1000 * blocks + blocks * BLOCK + 5))
    prefill(a, f"warm-{name}", prompt[:blocks * BLOCK] + [1])
    expected = prefill(a, f"ref-{name}", prompt)
    answer = lease(a, f"{name}~pull0", prompt[:blocks * BLOCK], lease_s=lease_s)
    break_lease(a)
    before = stats(b)
    got = prefill(b, name, prompt, prefix_kv=answer.kv)
    assert list(got.first.token_ids) == list(expected.first.token_ids) and got.cached_tokens == 0
    assert stats(b).peer_pull_fallbacks == before.peer_pull_fallbacks + 1
    assert_no_leaks([w for w in cluster[:3] if w.alive])


def test_an_expired_lease_falls_back_to_computing(cluster):
    def expire(a):
        deadline = time.monotonic() + 30
        while stats(a).num_leases:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert_falls_back(cluster, "e", 10, expire, lease_s=0.2)


def test_a_killed_holder_falls_back_to_computing(cluster):
    """Last: it kills worker A."""
    assert_falls_back(cluster, "k", 12, lambda a: a.kill())
