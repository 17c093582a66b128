"""Routers sharing one real Redis: same view, same decisions; TTL registry; Redis restarts.

Real processes throughout: redis-server, 2 prefill + 1 decode workers that
register themselves in Redis (no addresses on any router's command line), and
two routers reading the registry and the workers' KV event streams there.
"""
from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.cluster.harness import (
    assert_no_leaks,
    free_port,
    generate_routed,
    metric_value,
    start,
    start_worker,
    start_workers,
)
from tests.redis_server import RedisServer

TTL_S = 2.0
# Long enough that holding the prefix (20 blocks) outweighs a request's load (8 blocks), even when
# a stats poll still counts a finished request's lease on the holder.
SYSTEM_LEN = 320
rng = random.Random(7)
SYSTEM_PROMPTS = [[rng.randrange(3, 49000) for _ in range(SYSTEM_LEN)] for _ in range(4)]


def suffix() -> list[int]:
    return [rng.randrange(3, 49000) for _ in range(5)]


@pytest.fixture(scope="module")
def cluster(smollm2_dir, tmp_path_factory):
    from common.cluster_auth import write_secret_file
    redis_server = RedisServer(free_port()).start()
    secret = write_secret_file(str(tmp_path_factory.mktemp("secret")))  # as in production: events signed
    registry = ["--redis-url", redis_server.url, "--registry-ttl-s", str(TTL_S), "--cluster-secret-file", secret]
    procs = []
    try:
        # The routers find the workers in Redis: all five processes start side by side.
        ports = {name: free_port() for name in ("a", "b")}
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(start, f"router-{name}", ["router", "--port", "0", "--health-interval-s", "0.5",
                                                              "--skip-prefill-tokens", "0", "--metrics-port",
                                                              str(port), "--route-metadata", *registry])
                        for name, port in ports.items()]
            try:
                workers = start_workers(["prefill", "prefill", "decode"], *registry)
                procs += workers
            finally:
                procs += [f.result() for f in starting if f.exception() is None]
        routers = [f.result() for f in starting]
        for router, port in zip(routers, ports.values(), strict=True):
            router.metrics_url = f"http://127.0.0.1:{port}/metrics"
        for router in routers:
            wait_for(lambda router=router: all(healthy(router, w) for w in workers), 30)
        yield {"redis": redis_server, "workers": workers, "routers": routers, "registry": registry, "secret": secret}
    finally:
        for proc in procs:
            proc.stop()
        redis_server.stop()


def wait_for(predicate, timeout: float) -> float:
    start_time = time.monotonic()
    while not predicate():
        if time.monotonic() - start_time > timeout:
            raise AssertionError(f"not within {timeout} s")
        time.sleep(0.1)
    return time.monotonic() - start_time


def healthy(router, worker) -> bool:
    return metric_value(router.metrics_url, "pdserve:worker_healthy", worker=worker.address) == 1.0


def generate(router, token_ids: list[int]) -> dict:
    return generate_routed(router, token_ids, max_tokens=2)


def test_two_routers_route_a_sequence_identically(cluster):
    from concurrent.futures import ThreadPoolExecutor
    router_a, router_b = cluster["routers"]
    # The four prompts arrive together at router A: load spreads them over both prefill workers
    # (at equal cost the smaller address would take all of them).
    with ThreadPoolExecutor(4) as pool:
        first = list(pool.map(lambda p: generate(router_a, p + suffix()), SYSTEM_PROMPTS))
    placement = {p: r["prefill"] for p, r in enumerate(first)}
    assert len(set(placement.values())) == 2, "the four prompts spread over both prefill workers"
    # Then each prompt's requests alternate between the routers: every one lands on the
    # prefill worker holding the prompt, whichever router sends it.
    for i in range(8):
        p = i % 4
        result = generate(router_a if i % 2 else router_b, SYSTEM_PROMPTS[p] + suffix())
        assert result["prefill"] == placement[p], f"request {i} (prompt {p}) left the worker holding it"
        assert result["cached"] >= SYSTEM_LEN
    # The same new request, sent to each router: the same workers.
    for p in range(4):
        tail = suffix()
        a, b = generate(router_a, SYSTEM_PROMPTS[p] + tail), generate(router_b, SYSTEM_PROMPTS[p] + tail)
        assert (a["prefill"], a["decode"]) == (b["prefill"], b["decode"])
    assert_no_leaks(cluster["workers"], secret_file=cluster["secret"])


def test_kv_events_in_redis_are_signed_by_their_worker(cluster):
    import redis

    from common import redis_keys
    from common.cluster_auth import ClusterAuthConfig, events
    key = ClusterAuthConfig(cluster["secret"]).load().events
    client = redis.Redis.from_url(cluster["redis"].url)
    try:
        streams = [k.decode() for k in client.scan_iter(match=f"{redis_keys.PREFIX}:kv_events:*")]
        assert streams
        entries = [(stream, fields) for stream in streams for _, fields in client.xrange(stream)]
        assert entries  # the routing test before this one made the workers cache blocks
        for stream, fields in entries:
            assert events.verify(key, stream, fields[redis_keys.BATCH_FIELD], fields[redis_keys.SIGNATURE_FIELD])
            assert not events.verify(key, stream + "x", fields[redis_keys.BATCH_FIELD],
                                     fields[redis_keys.SIGNATURE_FIELD])  # bound to its own stream
    finally:
        client.close()


def test_worker_joins_then_leaves_within_its_ttl_when_hung(cluster):
    routers = cluster["routers"]
    late = start_worker("prefill", *cluster["registry"])
    try:
        for router in routers:
            wait_for(lambda router=router: healthy(router, late), 10)
        os.kill(late.popen.pid, signal.SIGSTOP)  # hung: no heartbeats, no answers
        took = max(wait_for(lambda r=r: metric_value(r.metrics_url, "pdserve:worker_healthy",
                                                     worker=late.address) is None, TTL_S + 3) for r in routers)
        assert took <= TTL_S + 3
        for i in range(4):  # nothing is routed to the hung worker
            assert generate(routers[i % 2], SYSTEM_PROMPTS[i] + suffix())["prefill"] != late.address
        os.kill(late.popen.pid, signal.SIGCONT)
        for router in routers:
            wait_for(lambda router=router: healthy(router, late), 10)
    finally:
        os.kill(late.popen.pid, signal.SIGCONT)
        late.stop()
    assert_no_leaks(cluster["workers"], secret_file=cluster["secret"])


def test_redis_restart_is_survived_and_routers_resync(cluster):
    routers, workers, redis_server = cluster["routers"], cluster["workers"], cluster["redis"]
    resyncs = [metric_value(r.metrics_url, "pdserve:kv_index_resyncs_total") for r in routers]
    redis_server.stop()
    # Serving on the last view: every worker stays in rotation, requests succeed.
    new_prompt = [rng.randrange(3, 49000) for _ in range(SYSTEM_LEN)]
    for i in range(4):
        generate(routers[i % 2], new_prompt + suffix())
    time.sleep(TTL_S + 1)
    assert all(healthy(r, w) for r in routers for w in workers)
    redis_server.start()
    # Workers re-register; the events lost meanwhile show up as gaps and the routers resync.
    for router in routers:
        wait_for(lambda router=router: all(healthy(router, w) for w in workers), 10)
    other_prompt = [rng.randrange(3, 49000) for _ in range(SYSTEM_LEN)]
    first = generate(routers[0], other_prompt + suffix())
    wait_for(lambda: all(metric_value(r.metrics_url, "pdserve:kv_index_resyncs_total") > before
                         for r, before in zip(routers, resyncs, strict=True)), 15)
    # And the shared view works again: the other router follows the placement.
    time.sleep(0.5)
    again = generate(routers[1], other_prompt + suffix())
    assert again["prefill"] == first["prefill"] and again["cached"] >= SYSTEM_LEN
    assert_no_leaks(workers, secret_file=cluster["secret"])
