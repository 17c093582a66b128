"""Chaos scenario 4: Redis restarted empty while a router that knows its workers only through Redis
serves a steady load. The router keeps serving on its last view while Redis is gone, the workers
re-register into the empty server, and no request fails."""
from __future__ import annotations

import random
import threading
import time
import uuid

import grpc
import pytest

from common import redis_keys
from common.client import build_request
from engine.sampling_params import SamplingParams
from tests.cluster.harness import assert_no_leaks, generation_stub, metric_value

pytestmark = pytest.mark.usefixtures("workers_restored")

CLIENTS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def in_rotation(router, workers) -> bool:
    return all(metric_value(router.metrics_url, "pdserve:worker_healthy", worker=w.address) == 1.0 for w in workers)


def registered_addresses(redis_server) -> set[str]:
    client = redis_server.client()
    addresses = (client.hget(key, "address") for key in client.keys(redis_keys.WORKER_PATTERN))
    return {a.decode() for a in addresses if a}  # a key may expire between KEYS and HGET


def registered(redis_server, workers) -> bool:
    return {w.address for w in workers} <= registered_addresses(redis_server)


def test_redis_restarted_empty_under_load_fails_no_request(chaos_cluster):
    cluster = chaos_cluster
    router, redis_server = cluster["redis_router"], cluster["redis"]
    workers = cluster["prefill"] + cluster["decode"]
    stop = threading.Event()
    results: list[str] = []

    def client(seed: int) -> None:
        rng, stub = random.Random(seed), generation_stub(router.address)
        while not stop.is_set():
            prompt = [rng.randrange(3, 49000) for _ in range(rng.randrange(8, 64))]
            try:
                tokens = [t for m in stub.Generate(build_request(uuid.uuid4().hex, GREEDY, token_ids=prompt),
                                                   timeout=60) if m.HasField("chunk") for t in m.chunk.token_ids]
                results.append("OK" if len(tokens) == GREEDY.max_tokens else f"{len(tokens)} tokens")
            except grpc.RpcError as exc:
                results.append(f"{exc.code().name}: {exc.details()}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 30
        while len(results) < CLIENTS:  # the load is flowing (a loaded machine may take seconds for the first ones)
            assert time.monotonic() < deadline, f"no load before the outage: {results}"
            time.sleep(0.2)
        served_before = len(results)
        redis_server.stop()
        time.sleep(4)  # past the registry TTL (2 s): the router must not drop workers it cannot re-read
        redis_server.start()  # empty: no registrations, no KV events
        # The router kept every worker through the outage, so rotation alone proves nothing here: wait for
        # each worker's own registration in the restarted server, then for the router's view of them.
        deadline = time.monotonic() + 20
        while not (registered(redis_server, workers) and in_rotation(router, workers)):
            assert time.monotonic() < deadline, (
                f"workers did not come back through the restarted Redis: registered "
                f"{sorted(registered_addresses(redis_server))}, expected {sorted(w.address for w in workers)}")
            time.sleep(0.2)
        back = len(results)
        deadline = time.monotonic() + 60
        while len(results) < back + CLIENTS:  # requests keep completing after the recovery too
            assert time.monotonic() < deadline, f"no load after the recovery: {results[back:]}"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join(90)
    failed = [r for r in results if r != "OK"]
    assert not failed, failed[:5]
    assert len(results) > served_before + CLIENTS  # load went on throughout
    assert_no_leaks(workers, secret_file=cluster["secret"])
