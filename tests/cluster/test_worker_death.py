"""A worker process dies mid-request: its decode streams migrate to the other decode worker (its
prefills are retried), it leaves rotation, everything completes. Kills workers of the shared cluster,
so this file runs last. (Migration itself: test_migration.py.)"""
from __future__ import annotations

import threading
import time

import grpc

from common.protocol import generate_pb2
from tests.cluster.harness import assert_no_leaks, generation_stub, metric_value
from tests.cluster.test_cluster_failures import everyone, long_request


def test_killed_workers_leave_rotation_and_the_rest_complete(router_2p2d, workers):
    """Runs last: kills one decode worker mid-request, then one prefill worker."""
    stub = generation_stub(router_2p2d.address)
    outcomes: dict[str, str] = {}
    started = threading.Semaphore(0)

    def run(rid: str) -> None:
        chunks = 0
        try:
            for msg in stub.Generate(long_request(rid, max_tokens=150), timeout=300):
                chunks += 1
                if chunks == 2:  # a second chunk: the stream is past prefill, decoding on a decode worker
                    started.release()
                if msg.HasField("complete"):
                    outcomes[rid] = "complete"
        except grpc.RpcError as exc:
            outcomes[rid] = exc.code().name
        finally:
            if chunks < 2:
                started.release()

    threads = [threading.Thread(target=run, args=(f"k{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=120)
    victim = workers["decode"][1]
    migrated = metric_value(router_2p2d.metrics_url, "pdserve:request_migrations_total", reason="worker_lost")
    victim.kill()
    for t in threads:
        t.join(300)
    assert outcomes == {f"k{i}": "complete" for i in range(6)}, outcomes  # the victim's streams migrated
    assert metric_value(router_2p2d.metrics_url, "pdserve:request_migrations_total", reason="worker_lost") > migrated
    assert metric_value(router_2p2d.metrics_url, "pdserve:worker_healthy", worker=victim.address) == 0.0

    # a prefill worker dies: calls that reach it are retried on the other one
    dead_prefill = workers["prefill"][1]
    dead_prefill.kill()
    results = []
    for i in range(6):
        msgs = list(stub.Generate(generate_pb2.GenerateRequest(
            request_id=f"after-{i}", text=f"Question {i}: what is {i} plus {i}?",
            params=generate_pb2.SamplingParams(temperature=0, max_tokens=8)), timeout=120))
        results.append(msgs[-1].complete.usage.completion_tokens)
    assert all(n >= 1 for n in results)
    deadline = time.monotonic() + 10
    while metric_value(router_2p2d.metrics_url, "pdserve:worker_healthy", worker=dead_prefill.address) != 0.0:
        assert time.monotonic() < deadline, "the dead prefill worker stayed in rotation"
        time.sleep(0.2)
    assert_no_leaks(everyone(workers))
