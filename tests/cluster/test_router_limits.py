"""The public API bounds what one request may cost before doing any work for it: n, prompt size
(checked before tokenizing; gRPC message and HTTP body limits), seeds, stop lists. Each attack is
refused within a second while health checks keep answering (a real router process)."""
from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.protocol import generate_pb2
from tests.cluster.harness import free_port, generation_stub, start_router

MAX_N = 16


@pytest.fixture(scope="module")
def router(smollm2_dir):
    port = free_port()
    proc = start_router([], [], "--http-port", str(port), "--max-n", str(MAX_N))
    proc.http_url = f"http://127.0.0.1:{port}"
    yield proc
    proc.stop()


class HealthProbe(threading.Thread):
    """Asks grpc.health.v1 every 50 ms; records the slowest answer and any failure."""

    def __init__(self, address: str) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.stop = threading.Event()
        self.slowest = 0.0
        self.failures: list[str] = []
        self.answers = 0

    def run(self) -> None:
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while not self.stop.is_set():
                started = time.monotonic()
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
                    if status != health_pb2.HealthCheckResponse.SERVING:
                        self.failures.append(str(status))
                except grpc.RpcError as exc:
                    self.failures.append(str(exc.code()))
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.answers += 1
                time.sleep(0.05)


@pytest.fixture
def probe(router):
    probe = HealthProbe(router.address)
    probe.start()
    yield probe
    probe.stop.set()
    probe.join(10)
    assert not probe.failures and probe.answers > 0
    assert probe.slowest < 1.0, f"a health check took {probe.slowest:.2f} s"


def refused(router, within_s: float = 1.0, **fields) -> grpc.RpcError:
    params = fields.pop("params", {})
    msg = generate_pb2.GenerateRequest(params=generate_pb2.SamplingParams(max_tokens=4, **params), **fields)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as e:
        list(generation_stub(router.address).Generate(msg, timeout=60))
    assert time.monotonic() - started < within_s
    return e.value


def test_grpc_attacks_refused_fast(router, probe):
    e = refused(router, text="Hi", params={"n": 2**31 - 1})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("params.n:")
    e = refused(router, text="x" * (3 << 20))  # under the message limit: refused before tokenizing
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("text:")
    e = refused(router, text="x" * (50 << 20), within_s=2.0)  # over the message limit
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    e = refused(router, chat=generate_pb2.Chat(messages=[generate_pb2.ChatMessage(role="user",
                                                                                  content="y" * (3 << 20))]))
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("chat.messages:")
    e = refused(router, text="Hi", params={"n": 2, "seed": 2**63 - 1})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("params.seed:")
    e = refused(router, text="Hi", params={"stop_token_ids": list(range(1000))})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("params.stop_token_ids:")
    e = refused(router, text="Hi", params={"stop": ["z" * 100_000]})
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("params.stop:")


def post(router, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(router.http_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_http_attacks_refused_fast(router, probe):
    started = time.monotonic()
    host, port = router.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # announce 50 MB, send a little
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n{\"prompt\": \"xxxx" % (50 << 20))
        reply = b""
        while b"request_too_large" not in reply and (chunk := sock.recv(65536)):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply, reply
    assert time.monotonic() - started < 1.0
    for fields, param in (({"n": 2**31 - 1}, "n"), ({"n": 2, "seed": 2**63 - 1}, "seed"),
                          ({"prompt": "x" * (3 << 20)}, "prompt")):
        started = time.monotonic()
        status, body = post(router, json.dumps({"prompt": "Hi", "max_tokens": 4, **fields}).encode())
        assert status == 400 and body["error"]["param"] == param, body
        assert time.monotonic() - started < 1.0
    with urllib.request.urlopen(router.http_url + "/health", timeout=5) as response:
        assert response.status == 200
