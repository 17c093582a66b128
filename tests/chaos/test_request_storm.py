"""Chaos scenario 6: 400 requests against 2 prefill + 2 decode workers, half over gRPC and half over
the OpenAI HTTP front, most of them ended early by the client: cancelled, past a deadline, aborted by
id, disconnected mid-stream. Every request ends with a status a caller can act on (never INTERNAL,
UNKNOWN or a 5xx), the ones left alone finish complete, and no worker or router holds anything after."""
from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections import Counter

import grpc
import httpx2 as httpx
import pytest

from common.client import build_request
from common.protocol import generate_pb2, generate_pb2_grpc
from engine.sampling_params import SamplingParams
from tests.cluster.harness import assert_no_leaks, metric_value

pytestmark = pytest.mark.usefixtures("workers_restored")

NUM_REQUESTS = 400  # every way of ending is drawn dozens of times over each front
CONCURRENCY = 32
ACTIONS = ("complete", "cancel", "deadline", "disconnect", "abort")
WEIGHTS = (35, 20, 20, 15, 10)
LONG = 256  # tokens asked of requests the client ends early: only an abort frees them in time
GRPC_OK = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
HTTP_OK = {"200", "429", "client-timeout", "client-disconnect"}
FRESH = httpx.Limits(max_keepalive_connections=0)
"""A new connection per HTTP request: a pooled one can be closed by the server's keep-alive timeout
just as the client reuses it, a reset that says nothing about the server."""


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 49000) for _ in range(rng.randrange(4, 48))]


async def grpc_request(stub, rng: random.Random, action: str) -> str:
    max_tokens = rng.randrange(1, 7) if action == "complete" else LONG
    request_id = uuid.uuid4().hex
    msg = build_request(request_id, SamplingParams(temperature=rng.choice([0.0, 0.8]), max_tokens=max_tokens,
                                                   ignore_eos=True), token_ids=prompt(rng))
    timeout = rng.uniform(0.05, 1.0) if action == "deadline" else 120
    call = stub.Generate(msg, timeout=timeout)
    tokens, finish = 0, None
    try:
        async for m in call:
            if m.HasField("chunk"):
                tokens += len(m.chunk.token_ids)
                if action == "disconnect" or action == "cancel" and tokens >= rng.randrange(1, 8):
                    call.cancel()
                elif action == "abort" and tokens >= 1:
                    await stub.Abort(generate_pb2.AbortRequest(request_id=request_id), timeout=10)
            else:
                finish = m.complete.finish_reason
    except asyncio.CancelledError:
        return "CANCELLED"
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    if action == "complete" and tokens != max_tokens:
        return f"OK with {tokens} of {max_tokens} tokens (finish {finish}, id {request_id})"
    if action == "abort" and finish != generate_pb2.FINISH_REASON_ABORT and tokens < max_tokens:
        return f"aborted stream ended with finish reason {finish}"
    return "OK"


async def http_request(http: httpx.AsyncClient, url: str, rng: random.Random, action: str) -> str:
    """One HTTP request; a deadline is the whole request's (httpx's own timeout is per read, which a
    stream sending a token every few hundred milliseconds never trips)."""
    deadline = rng.uniform(0.05, 1.0) if action in ("deadline", "abort") else 120
    try:
        return await asyncio.wait_for(http_exchange(http, url, rng, action), deadline)
    except (TimeoutError, httpx.TimeoutException):
        return "client-timeout"


async def http_exchange(http: httpx.AsyncClient, url: str, rng: random.Random, action: str) -> str:
    max_tokens = rng.randrange(1, 7) if action == "complete" else LONG
    body = {"model": "default", "prompt": prompt(rng), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8]), "stream": action != "complete" or rng.random() < 0.5}
    async with http.stream("POST", url, json=body, timeout=120) as response:
        if response.status_code != 200:
            body_text = (await response.aread()).decode(errors="replace")
            return str(response.status_code) + ("" if response.status_code < 500 else f" {body_text[:300]}")
        if not body["stream"]:
            data = json.loads(await response.aread())
            return "200" if data["usage"]["completion_tokens"] == max_tokens else f"200 with {data['usage']}"
        events = 0
        async for line in response.aiter_lines():
            events += line.startswith("data: {")
            if action in ("disconnect", "cancel") and events >= rng.randrange(1, 4):
                return "client-disconnect"  # leaving the block closes the connection
    return "200"


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_four_hundred_requests_ended_every_which_way_all_end_with_a_status(chaos_cluster):
    cluster = chaos_cluster
    router = cluster["front"]
    rng = random.Random(2026)
    plan = [(i % 2 == 0, rng.choices(ACTIONS, WEIGHTS)[0], random.Random(rng.random())) for i in range(NUM_REQUESTS)]

    async def run() -> list[tuple[str, str, str]]:
        slots = asyncio.Semaphore(CONCURRENCY)
        async with grpc.aio.insecure_channel(router.address) as channel, httpx.AsyncClient(limits=FRESH) as http:
            stub = generate_pb2_grpc.GenerationStub(channel)
            url = router.http_url + "/v1/completions"

            async def one(over_grpc: bool, action: str, r: random.Random) -> tuple[str, str, str]:
                async with slots:
                    if over_grpc:
                        return "grpc", action, await grpc_request(stub, r, action)
                    return "http", action, await http_request(http, url, r, action)

            return await asyncio.gather(*(one(*p) for p in plan))

    outcomes = asyncio.run(run())
    counts = Counter(outcomes)
    bad = {k: v for k, v in counts.items() if k[2] not in (GRPC_OK if k[0] == "grpc" else HTTP_OK)}
    assert not bad, (bad, "".join(router.output[-60:]))
    assert len(outcomes) == NUM_REQUESTS
    completed = sum(v for (front, action, status), v in counts.items() if action == "complete" and status in
                    ("OK", "200"))
    assert completed >= 0.9 * sum(v for (_, action, _), v in counts.items() if action == "complete"), counts
    # 10 s: far less than what a request left running would take (~250 more tokens) had its abort been lost
    assert_no_leaks(cluster["prefill"] + cluster["decode"][:2], timeout=10, secret_file=cluster["secret"])
    assert metric_value(router.metrics_url, "pdserve:router_queue_length") == 0
