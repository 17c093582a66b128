"""Worker gRPC (requests and the KV event feed) with a cluster secret, real processes and real gRPC:
a caller without a valid cluster token is refused (UNAUTHENTICATED) on every method but health;
a router holding the secret serves requests; a decode worker refuses a KV handle a router did not
sign for that prompt (INVALID_ARGUMENT), without dialing it, failing others or leaking blocks."""
from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from common.cluster_auth import ClusterAuthConfig, handles, tokens, write_secret_file
from common.cluster_auth.grpc_auth import METADATA_KEY
from common.grpc_common import WORKER_MAX_REQUEST_BYTES
from common.protocol import generate_pb2, worker_pb2, worker_pb2_grpc
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import generation_stub, start_router, start_workers

PROMPT = list(range(1000, 1040))
SERVICE = "/pdserve.v1.Worker/"


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    return write_secret_file(str(tmp_path_factory.mktemp("secret")))


@pytest.fixture(scope="module")
def keys(secret_file):
    return ClusterAuthConfig(secret_file).load()


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_dir, secret_file):
    procs = []
    try:
        procs += start_workers(["prefill", "decode"], "--cluster-secret-file", secret_file,
                               "--model", str(tiny_qwen2_dir))  # who may call is the point, not the tokens
        procs.append(start_router(procs[:1], procs[1:2], "--cluster-secret-file", secret_file))
        yield {"prefill": procs[0], "decode": procs[1], "router": procs[2]}
    finally:
        stop_all(procs)


def token_for(key: bytes, method: str, address: str, request) -> str:
    return tokens.mint(key, SERVICE + method, address, request.SerializeToString())


def call(address: str, method: str, request, key: bytes | None = None, stream: bool = False, token: str = ""):
    """Call a Worker method, with `token` or a cluster token made from `key` (none when neither)."""
    token = token or (token_for(key, method, address, request) if key else "")
    metadata = [(METADATA_KEY, token)] if token else None
    with grpc.insecure_channel(address) as channel:
        rpc = getattr(worker_pb2_grpc.WorkerStub(channel), method)
        if stream:
            return list(rpc(request, metadata=metadata, timeout=60))
        return rpc(request, metadata=metadata, timeout=60)


def params(**kwargs) -> generate_pb2.SamplingParams:
    return generate_pb2.SamplingParams(temperature=0.0, **kwargs)


STRANGER_CALLS = [
    ("GetStats", worker_pb2.StatsRequest(), False),
    ("Prefill", worker_pb2.PrefillRequest(request_id="x", prompt_token_ids=PROMPT, params=params(max_tokens=4)), False),
    ("Decode", worker_pb2.DecodeRequest(request_id="y", prompt_token_ids=PROMPT, params=params(max_tokens=4)), True),
    ("Abort", generate_pb2.AbortRequest(request_id="x"), False),
    ("SubscribeKvEvents", worker_pb2.KvEventsRequest(), True),  # the event feed
    ("GetKvSnapshot", worker_pb2.KvEventsRequest(), False),
]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_stranger_is_refused_on_every_method_but_health(role, cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    address = cluster[role].address
    wrong = b"x" * 32  # a token made with another secret
    for method, request, stream in STRANGER_CALLS:
        for key in (None, wrong):
            with pytest.raises(grpc.RpcError) as info:
                call(address, method, request, key, stream)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, info.value)
            assert "num_" not in info.value.details() and "kv" not in info.value.details()
    with grpc.insecure_channel(address) as channel:  # probes stay open, and say only SERVING
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_token_is_bound_to_its_method(cluster, keys):
    token = token_for(keys.grpc, "GetStats", cluster["prefill"].address, worker_pb2.StatsRequest())
    with grpc.insecure_channel(cluster["prefill"].address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert stub.GetStats(worker_pb2.StatsRequest(), metadata=[(METADATA_KEY, token)], timeout=10).role == "prefill"
        with pytest.raises(grpc.RpcError) as info:
            stub.GetKvSnapshot(worker_pb2.KvEventsRequest(), metadata=[(METADATA_KEY, token)], timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_captured_token_cannot_be_replayed(cluster, keys):
    token = token_for(keys.grpc, "GetStats", cluster["decode"].address, worker_pb2.StatsRequest())
    with grpc.insecure_channel(cluster["decode"].address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        assert stub.GetStats(worker_pb2.StatsRequest(), metadata=[(METADATA_KEY, token)], timeout=10).role == "decode"
        with pytest.raises(grpc.RpcError) as info:  # the same token again, as an eavesdropper would send it
            stub.GetStats(worker_pb2.StatsRequest(), metadata=[(METADATA_KEY, token)], timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_token_is_bound_to_its_worker_and_body(cluster, keys):
    """A token seen on the way to one worker opens no other worker and carries no other request."""
    prefill, decode = cluster["prefill"].address, cluster["decode"].address
    request = worker_pb2.PrefillRequest(request_id="aud-1", prompt_token_ids=PROMPT, params=params(max_tokens=1),
                                        cache_salt="tenant-a")
    probe = worker_pb2.PrefillRequest(request_id="aud-2", prompt_token_ids=PROMPT, params=params(max_tokens=1),
                                      cache_salt="tenant-b")  # what an attacker would rather send
    sniffed = token_for(keys.grpc, "Prefill", prefill, request)
    assert call(prefill, "Prefill", request, token=sniffed).finished  # the router's own call (1 token)
    for name, address, body, token in [
            ("another worker", decode, request, sniffed),
            ("another worker, fresh", decode, request, token_for(keys.grpc, "Prefill", prefill, request)),
            ("another body", prefill, probe, token_for(keys.grpc, "Prefill", prefill, request))]:
        with pytest.raises(grpc.RpcError) as info:
            call(address, "Prefill", body, token=token)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
    with pytest.raises(grpc.RpcError) as info:  # control: a token for the decode worker passes its check
        call(decode, "Prefill", probe, keys.grpc)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # ...and meets the role check
    decode_probe = worker_pb2.DecodeRequest(request_id="aud-3", prompt_token_ids=PROMPT, cache_salt="tenant-b",
                                            params=params(max_tokens=1))
    assert call(decode, "Decode", decode_probe, keys.grpc, stream=True)[-1].HasField("complete")
    wait_until_idle([prefill, decode], keys.grpc)


def wait_until_idle(addresses: list[str], key: bytes, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for address in addresses:
        while True:
            stats = call(address, "GetStats", worker_pb2.StatsRequest(), key)
            if (stats.kv_blocks_used, stats.num_requests, stats.num_leases) == (0, 0, 0):
                break
            assert time.monotonic() < deadline, (address, stats)
            time.sleep(0.1)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def big_call(address: str, nbytes: int, token: str = "") -> grpc.RpcError:
    """A Prefill call whose body is `nbytes` long (one huge request id), refused; returns the error."""
    body = b"\x0a" + _varint(nbytes) + b"x" * nbytes
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", -1)]) as channel:
        rpc = channel.unary_unary(SERVICE + "Prefill", request_serializer=None, response_deserializer=None)
        with pytest.raises(grpc.RpcError) as info:
            rpc(body, metadata=[(METADATA_KEY, token)] if token else None, timeout=60)
    return info.value


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


@pytest.mark.parametrize("nbytes", [60 << 20, 12 << 20])
def test_a_large_unauthenticated_call_is_refused_unread(cluster, keys, nbytes):
    """Four unauthenticated calls of 60 MiB (over the workers' request limit) or 12 MiB (under it) are
    refused before their bodies are buffered: the worker's RSS grows by less than 16 MiB."""
    worker = cluster["decode"]
    wrong = tokens.mint(b"y" * 32, SERVICE + "Prefill", worker.address, b"")
    big_call(worker.address, 1 << 20)  # warm the paths a refusal takes
    before = rss_bytes(worker.popen.pid)
    with ThreadPoolExecutor(4) as pool:
        errors = list(pool.map(lambda token: big_call(worker.address, nbytes, token), ["", wrong, "", wrong]))
    grown = rss_bytes(worker.popen.pid) - before
    expected = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert all(e.code() in expected for e in errors), errors
    if nbytes < WORKER_MAX_REQUEST_BYTES:
        assert all(e.code() == grpc.StatusCode.UNAUTHENTICATED for e in errors), errors
    assert grown < 16 << 20, f"worker RSS grew {grown / 2**20:.1f} MiB"
    assert call(worker.address, "GetStats", worker_pb2.StatsRequest(), keys.grpc).role == "decode"


def test_the_router_with_the_secret_serves(cluster):
    request = generate_pb2.GenerateRequest(request_id="auth-1", tokens=generate_pb2.TokenIds(ids=PROMPT),
                                           params=params(max_tokens=8, ignore_eos=True))
    tokens_out, finish = [], None
    for msg in generation_stub(cluster["router"].address).Generate(request, timeout=120):
        if msg.HasField("chunk"):
            tokens_out.extend(msg.chunk.token_ids)
        elif msg.HasField("complete"):
            finish = msg.complete.finish_reason
    assert len(tokens_out) == 8 and finish == generate_pb2.FINISH_REASON_LENGTH


def test_a_router_without_the_secret_gets_no_worker(cluster):
    router = start_router([cluster["prefill"]], [cluster["decode"]])
    try:
        request = generate_pb2.GenerateRequest(request_id="auth-2", tokens=generate_pb2.TokenIds(ids=PROMPT),
                                               params=params(max_tokens=2))
        with pytest.raises(grpc.RpcError) as info:
            list(generation_stub(router.address).Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.stop()


def test_decode_refuses_handles_no_router_signed(cluster, keys):
    prefill, decode = cluster["prefill"].address, cluster["decode"].address
    first = call(prefill, "Prefill", worker_pb2.PrefillRequest(request_id="h1", prompt_token_ids=PROMPT,
                                                               params=params(max_tokens=6, ignore_eos=True)),
                 keys.grpc)
    handle = first.kv
    assert len(handle.capability) == 32 and handle.capability not in str(handle.peer)
    bait = socket.create_server(("127.0.0.1", 0))  # where a forged handle points: nobody may dial it
    bait.settimeout(0.5)

    def run_decode(kv: worker_pb2.KVHandle, prompt=PROMPT) -> list:
        request = worker_pb2.DecodeRequest(request_id="h1", prompt_token_ids=prompt, first_token_id=7,
                                           params=params(max_tokens=6, ignore_eos=True), kv=kv)
        return call(decode, "Decode", request, keys.grpc, stream=True)

    signed = worker_pb2.KVHandle()
    signed.CopyFrom(handle)
    handles.sign(keys.handle, signed, PROMPT)
    forged = worker_pb2.KVHandle()
    forged.CopyFrom(signed)
    forged.peer.port = bait.getsockname()[1]
    wrong_key = worker_pb2.KVHandle()
    wrong_key.CopyFrom(handle)
    handles.sign(b"x" * 32, wrong_key, PROMPT)
    for name, kv, prompt in [("unsigned", handle, PROMPT), ("other secret", wrong_key, PROMPT),
                             ("redirected", forged, PROMPT), ("other prompt", signed, PROMPT[:-1] + [5])]:
        with pytest.raises(grpc.RpcError) as info:
            run_decode(kv, prompt)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (name, info.value)
        assert "not signed by a router" in info.value.details()
        assert handle.capability not in info.value.details() and "port" not in info.value.details()
    with pytest.raises(TimeoutError):
        bait.accept()  # the decode worker never dialed the forged address
    bait.close()
    stats = call(decode, "GetStats", worker_pb2.StatsRequest(), keys.grpc)
    assert stats.kv_blocks_used == 0 and stats.num_requests == 0
    # the genuine signed handle still works: the lease survived the refused attempts
    out = run_decode(signed)
    assert out[-1].HasField("complete")
    assert sum(len(m.chunk.token_ids) for m in out if m.HasField("chunk")) == 5


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    """A stranger's process posing as a decode worker (e.g. its address registered in Redis)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def GetStats(self, request, context):
        self.calls.append("GetStats")
        return worker_pb2.WorkerStats(role="decode", max_num_requests=8, block_size=16)

    def Decode(self, request, context):
        self.calls.append("Decode")  # the prompt would be the stranger's now
        context.abort(grpc.StatusCode.INTERNAL, "fake worker")


@pytest.fixture
def fake_worker():
    from concurrent import futures
    fake = FakeWorker()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    fake.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    yield fake
    server.stop(0)


def test_a_worker_that_cannot_prove_the_secret_gets_no_request(fake_worker, secret_file, smollm2_dir):
    request = generate_pb2.GenerateRequest(request_id="fake-1", tokens=generate_pb2.TokenIds(ids=PROMPT),
                                           params=params(max_tokens=2))
    # Both routers start side by side; the control (no secret) gets its request only after the check.
    with ThreadPoolExecutor(2) as pool:
        routers = [pool.submit(start_router, [], [fake_worker], *flags)
                   for flags in (("--cluster-secret-file", secret_file), ())]
    if any(r.exception() for r in routers):
        stop_all(r.result() for r in routers if r.exception() is None)
        raise next(r.exception() for r in routers if r.exception())
    router, control = [r.result() for r in routers]
    try:
        with pytest.raises(grpc.RpcError) as info:
            list(generation_stub(router.address).Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        router.stop()
        assert fake_worker.calls and set(fake_worker.calls) == {"GetStats"}, fake_worker.calls
        # control: a router without the secret trusts the same fake and hands it the prompt
        with pytest.raises(grpc.RpcError):
            list(generation_stub(control.address).Generate(request, timeout=30))
    finally:
        stop_all([router, control])
