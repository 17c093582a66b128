"""Overload: when every decode worker is full and the queue too, RESOURCE_EXHAUSTED with retry advice.

Real processes: one prefill and one decode worker that holds at most 2
requests, a router that lets 2 more wait. Ten concurrent long requests: 2 run,
2 wait and then run, 6 are refused at once; nothing else breaks and nothing leaks.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2

from common.client import build_request
from common.protocol import generate_pb2_grpc
from engine.sampling_params import SamplingParams
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import assert_no_leaks, free_port, metric_value, start, start_workers

MAX_TOKENS = 48


@pytest.fixture(scope="module")
def small_cluster(smollm2_dir):
    procs = []
    try:
        procs += start_workers(["prefill", ["decode", "--max-num-requests", "2"]])
        prefill, decode = procs
        port = free_port()
        router = start("router", ["router", "--port", "0", "--prefill-workers", prefill.address,
                                  "--decode-workers", decode.address, "--max-queue-len", "2",
                                  "--queue-timeout-s", "120", "--retry-after-s", "2.5", "--metrics-port", str(port)])
        router.metrics_url = f"http://127.0.0.1:{port}/metrics"
        procs.append(router)
        yield router, [prefill, decode]
    finally:
        stop_all(procs)


async def run_one(stub, i: int):
    request = build_request(f"load-{i}", SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0),
                            token_ids=[5 + i, 17, 300, 42, 7, 9])
    try:
        tokens = 0
        async for msg in stub.Generate(request, timeout=300):
            tokens += len(msg.chunk.token_ids)
        return tokens
    except grpc.aio.AioRpcError as exc:
        return exc


def retry_delay_s(exc: grpc.aio.AioRpcError) -> float:
    details = dict(exc.trailing_metadata())["grpc-status-details-bin"]
    status = status_pb2.Status.FromString(details)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    return info.retry_delay.seconds + info.retry_delay.nanos / 1e9


def test_overload_is_refused_with_retry_advice_and_nothing_breaks(small_cluster):
    router, workers = small_cluster

    async def scenario():
        async with grpc.aio.insecure_channel(router.address) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            results = await asyncio.gather(*(run_one(stub, i) for i in range(10)))
            after = await run_one(stub, 99)
        return results, after

    results, after = asyncio.run(scenario())
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    served = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    assert served == [MAX_TOKENS] * 4, results
    assert len(refused) == 6
    for exc in refused:
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "saturated" in exc.details()
        assert retry_delay_s(exc) == 2.5
    assert after == MAX_TOKENS, "the router serves again once load drops"
    assert metric_value(router.metrics_url, "pdserve:request_rejected_total", reason="queue_full") == 6
    assert metric_value(router.metrics_url, "pdserve:router_queue_length") == 0
    assert_no_leaks(workers)
