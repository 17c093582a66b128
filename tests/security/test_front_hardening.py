"""Front hardening (issue 35, rows 6-8), against a real `pdserve router` with API keys over a real decode
worker, with real sockets, HTTP and gRPC:
- slowloris on the OpenAI front: clients trickling their headers, or their body, are cut off within
  the router's deadlines (plus a stated slack), strangers beyond the pending cap at once, while an
  authenticated request is served;
- idle connections to a worker's metrics port: its thread count stays bounded, /metrics answers
  while they are open, and they are closed after the metrics server's request timeout;
- sampling parameters and text: temperature inf / nan / over the range is INVALID_ARGUMENT or 400
  naming it, 1e-320 is exactly greedy, a lone surrogate (JSON's "\\ud800") is 400 naming the field,
  and invalid UTF-8 in a gRPC string field is INVALID_ARGUMENT (not UNKNOWN).
"""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from common import metrics_http
from common.protocol import generate_pb2, generate_pb2_grpc
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import free_port, start_router, start_workers

KEY = "sk-front-0123456789abcdef"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 2.0
MAX_PENDING = 64
SLACK_S = 6.0
"""Allowed lateness of a deadline on a busy 2-core machine (the loop is shared with the router's work)."""
GRPC_AUTH = (("authorization", f"Bearer {KEY}"),)


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_dir, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "api-keys"
    key_file.write_text(f"front:{KEY}\n")
    metrics_port, http_port = free_port(), free_port()
    procs = start_workers([["decode", "--metrics-port", str(metrics_port), "--model", str(tiny_qwen2_dir)]])
    try:
        procs.append(start_router([], procs, "--http-port", str(http_port), "--api-key-file", str(key_file),
                                  "--http-header-timeout-s", str(HEADER_TIMEOUT_S),
                                  "--http-body-timeout-s", str(BODY_TIMEOUT_S),
                                  "--http-max-pending-connections", str(MAX_PENDING)))
        yield {"worker": procs[0], "router": procs[1], "metrics_port": metrics_port, "http_port": http_port}
    finally:
        stop_all(procs)


def post(cluster, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{cluster['http_port']}{path}", data=data, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def is_closed(sock: socket.socket) -> bool:
    """Whether the peer closed `sock` (FIN or RST); never blocks."""
    sock.setblocking(False)
    try:
        return sock.recv(4096) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def wait_closed(socks: list[socket.socket], opened_at: float, deadline_s: float, trickle: bytes = b"") -> list[float]:
    """Poll until every socket is closed by the server (sending `trickle` to the open ones now and then);
    returns each one's lifetime in seconds. Fails past `deadline_s` after `opened_at`."""
    lifetimes: dict[int, float] = {}
    while len(lifetimes) < len(socks):
        now = time.monotonic()
        assert now - opened_at < deadline_s, f"{len(socks) - len(lifetimes)} still open after {deadline_s} s"
        for i, sock in enumerate(socks):
            if i not in lifetimes and is_closed(sock):
                lifetimes[i] = now - opened_at
            elif i not in lifetimes and trickle:
                try:
                    sock.send(trickle)
                except OSError:
                    lifetimes[i] = now - opened_at
        time.sleep(0.2)
    for sock in socks:
        sock.close()
    return list(lifetimes.values())


def completion_text(cluster, **params) -> str:
    status, body = post(cluster, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                                     "ignore_eos": True, **params})
    assert status == 200, body
    return body["choices"][0]["text"]


# ---- row 6: slowloris on the OpenAI front -------------------------------------------------------------
def test_slowloris_headers_are_cut_off_and_a_real_client_is_served(cluster):
    port = cluster["http_port"]
    opened_at = time.monotonic()
    attackers = []
    for _ in range(200):  # over the pending cap: the oldest go at once, the rest at the header deadline
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        attackers.append(sock)
    status, body = post(cluster, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert status == 200 and body["usage"]["completion_tokens"] == 2
    lifetimes = wait_closed(attackers, opened_at, HEADER_TIMEOUT_S + SLACK_S + 30, trickle=b"X-Slow: 1\r\n")
    assert max(lifetimes) <= HEADER_TIMEOUT_S + SLACK_S, sorted(lifetimes)[-5:]
    assert sum(t < HEADER_TIMEOUT_S for t in lifetimes) >= 200 - MAX_PENDING - 1  # evicted over the cap


def test_a_trickled_body_is_cut_off_after_the_body_deadline(cluster):
    sock = socket.create_connection(("127.0.0.1", cluster["http_port"]), timeout=10)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 100000\r\n\r\n{")
    headers_sent_at = time.monotonic()
    [lifetime] = wait_closed([sock], headers_sent_at, BODY_TIMEOUT_S + SLACK_S + 30, trickle=b" ")
    assert BODY_TIMEOUT_S - 0.5 <= lifetime <= BODY_TIMEOUT_S + SLACK_S


# ---- row 7: idle connections to a worker's metrics port ---------------------------------------------------
def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def test_idle_metrics_connections_take_no_threads_and_time_out(cluster):
    pid, port = cluster["worker"].popen.pid, cluster["metrics_port"]
    url = f"http://127.0.0.1:{port}/metrics"
    assert urllib.request.urlopen(url, timeout=30).status == 200
    before = threads_of(pid)
    opened_at = time.monotonic()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(400)]
    with urllib.request.urlopen(url, timeout=30) as response:
        assert response.status == 200 and b"pdserve:" in response.read()
    still_open = sum(not is_closed(sock) for sock in idle)
    during = threads_of(pid)
    assert during <= before + 4, (before, during)  # one thread per connection was 40 -> 353+
    assert still_open >= metrics_http.MAX_CONNECTIONS - 2  # /metrics answered while they were open
    lifetimes = wait_closed(idle, opened_at, metrics_http.REQUEST_TIMEOUT_S + SLACK_S + 30)
    assert max(lifetimes) <= metrics_http.REQUEST_TIMEOUT_S + SLACK_S
    assert threads_of(pid) <= before + 4


# ---- row 8: sampling parameters and text ---------------------------------------------------------------
@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 1e300, -1e-320])
def test_http_refuses_a_temperature_that_is_not_finite_or_out_of_range(cluster, temperature):
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        status, reply = post(cluster, path, json.dumps({**body, "temperature": temperature}).encode())
        assert status == 400 and reply["error"]["param"] == "temperature", reply


@pytest.mark.parametrize("temperature", [float("inf"), float("nan"), 1e300])
def test_grpc_refuses_a_temperature_that_is_not_finite_or_out_of_range(cluster, temperature):
    request = generate_pb2.GenerateRequest(text="Hi", params=generate_pb2.SamplingParams(temperature=temperature))
    with grpc.insecure_channel(cluster["router"].address) as channel:
        with pytest.raises(grpc.RpcError) as exc:
            list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=GRPC_AUTH, timeout=60))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.details().startswith("params.temperature:")


def test_a_denormal_temperature_is_exactly_greedy(cluster):
    greedy = completion_text(cluster, temperature=0)
    assert completion_text(cluster, temperature=1e-320) == greedy
    assert completion_text(cluster, temperature=1e-6, seed=7) == greedy
    request = generate_pb2.GenerateRequest(text="The capital of France is", params=generate_pb2.SamplingParams(
        temperature=1e-320, max_tokens=8, ignore_eos=True))
    with grpc.insecure_channel(cluster["router"].address) as channel:
        messages = list(generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=GRPC_AUTH, timeout=120))
    assert "".join(m.chunk.text for m in messages if m.HasField("chunk")) == greedy


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "Hello \ud800 world"}, "prompt"),
    ("/v1/completions", {"prompt": ["ok \udfff"]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "Hello", "stop": ["\ud800"]}, "stop[0]"),
    ("/v1/completions", {"prompt": "Hello", "model": "\ud800"}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     "messages[0].content[0].text"),
])
def test_http_refuses_text_utf8_cannot_encode_with_400_naming_the_field(cluster, path, body, param):
    raw = json.dumps(body).encode()  # ensure_ascii: the lone surrogate travels as the JSON escape "\ud800"
    assert b"\\ud" in raw or b"\\udc" in raw or b"\\udf" in raw
    status, reply = post(cluster, path, raw)
    assert status == 400, reply
    assert reply["error"]["param"] == param and "UTF-8" in reply["error"]["message"]


def test_grpc_invalid_utf8_in_a_string_field_is_invalid_argument(cluster):
    """A protobuf client cannot send a lone surrogate (it refuses to encode it); a raw client can send its
    UTF-8-style bytes (ED A0 80), which the parser refuses before any handler runs: INVALID_ARGUMENT, not
    grpc's UNKNOWN, and the router serves on."""
    good = generate_pb2.GenerateRequest(text="Hi SURROGATE", params=generate_pb2.SamplingParams(max_tokens=2))
    raw = good.SerializeToString().replace(b"SURROGATE", b"\xed\xa0\x80xxxxxx")
    with grpc.insecure_channel(cluster["router"].address) as channel:
        call = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=None,
                                    response_deserializer=None)
        with pytest.raises(grpc.RpcError) as exc:
            list(call(raw, metadata=GRPC_AUTH, timeout=60))
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.value.code(), exc.value.details())
    assert "UTF-8" in exc.value.details()
    with grpc.insecure_channel(cluster["router"].address) as channel:
        messages = list(generate_pb2_grpc.GenerationStub(channel).Generate(
            generate_pb2.GenerateRequest(text="Hi", params=generate_pb2.SamplingParams(max_tokens=2)),
            metadata=GRPC_AUTH, timeout=120))
    assert messages[-1].complete.usage.completion_tokens == 2
