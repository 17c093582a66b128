"""A relay posing as a worker, against real processes: real redis-server (no password), real workers and
routers with a cluster secret, and an attacker without it who can write to Redis.

The relay registers its own address as a prefill and as a decode worker and forwards every call, the
router's token and challenge included, to a real worker, handing back the real worker's answers (its
proof among them). Neither of the two things it needs holds: an unsigned registration is never
dialled, and a router that dials the relay anyway (its address given on the command line) sends it
tokens addressed to the relay, which no real worker accepts, so the relay never proves itself and is
sent no prompt.
"""
from __future__ import annotations

import time
from concurrent import futures

import grpc
import pytest

from common import redis_keys
from common.cluster_auth import write_secret_file
from common.protocol import generate_pb2
from tests.cluster.harness import free_port, generation_stub, start, start_router, start_workers
from tests.redis_server import RedisServer
from tests.security.test_internal_grpc_auth import params

PROMPT = list(range(2000, 2040))
STREAMING = ("/Decode", "/SubscribeKvEvents")


class Relay(grpc.GenericRpcHandler):
    """Forwards every Worker call (bytes and the x-pdserve-* metadata) to `target`; records what it saw."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.insecure_channel(target)
        self.calls: list[tuple[str, str]] = []
        """(method, how the real worker answered) of each call the relay got."""
        self.server = grpc.server(futures.ThreadPoolExecutor(8), handlers=[self])
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def service(self, details):
        method = details.method
        metadata = [(k, v) for k, v in details.invocation_metadata if k.startswith("x-pdserve")]

        def forward_unary(request, context):
            try:
                response, call = self.channel.unary_unary(method).with_call(request, metadata=metadata, timeout=30)
            except grpc.RpcError as exc:
                self.calls.append((method, exc.code().name))
                context.abort(exc.code(), exc.details())
            self.calls.append((method, "OK"))
            context.send_initial_metadata(call.initial_metadata())  # the real worker's proof
            return response

        def forward_stream(request, context):
            call = self.channel.unary_stream(method)(request, metadata=metadata, timeout=60)
            try:
                context.send_initial_metadata(call.initial_metadata())
                yield from call
            except grpc.RpcError as exc:
                self.calls.append((method, exc.code().name))
                context.abort(exc.code(), exc.details())
            self.calls.append((method, "OK"))

        if method.endswith(STREAMING):
            return grpc.unary_stream_rpc_method_handler(forward_stream)
        return grpc.unary_unary_rpc_method_handler(forward_unary)

    def methods(self) -> set[str]:
        return {method.rsplit("/", 1)[1] for method, _ in self.calls}

    def stop(self) -> None:
        self.server.stop(0)
        self.channel.close()


@pytest.fixture(scope="module")
def cluster(tiny_qwen2_dir, tmp_path_factory):
    redis_server = RedisServer(free_port()).start()
    secret = write_secret_file(str(tmp_path_factory.mktemp("secret")))
    registry = ["--redis-url", redis_server.url, "--registry-ttl-s", "2", "--cluster-secret-file", secret]
    procs = []
    try:
        procs += start_workers(["prefill", "decode"], *registry, "--model", str(tiny_qwen2_dir))
        yield {"redis": redis_server, "prefill": procs[0], "decode": procs[1], "registry": registry,
               "secret": secret}
    finally:
        for proc in procs:
            proc.stop()
        redis_server.stop()


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout} s"
        time.sleep(0.1)


def generate_all(router_address: str, count: int) -> list[int]:
    """`count` greedy requests (two tenants' salts); the number of tokens each got."""
    out = []
    for i in range(count):
        request = generate_pb2.GenerateRequest(request_id=f"relay-{i}", tokens=generate_pb2.TokenIds(ids=PROMPT),
                                               cache_salt=f"tenant-{i % 2}",
                                               params=params(max_tokens=4, ignore_eos=True))
        responses = list(generation_stub(router_address).Generate(request, timeout=120))
        out.append(sum(len(r.chunk.token_ids) for r in responses if r.HasField("chunk")))
    return out


def test_a_relay_registered_in_redis_is_never_dialled(cluster):
    client = cluster["redis"].client()
    real = {k: v for k, v in client.hgetall(redis_keys.worker_key(cluster["decode"].address)).items()}
    assert real.get(b"signature"), "workers sign their registrations"
    relays = {"prefill": Relay(cluster["prefill"].address), "decode": Relay(cluster["decode"].address)}
    router = None
    try:
        for role, relay in relays.items():  # unsigned, and a real worker's signature over its own address
            client.hset(redis_keys.worker_key(relay.address), mapping={"role": role, "address": relay.address,
                                                                       "epoch": 1, "events": "x"})
            copied = {**real, b"role": role.encode(), b"address": relay.address.encode()}
            client.hset(redis_keys.worker_key(relay.address + "0"), mapping=copied)  # bound to another address
        metrics_port = free_port()
        router = start("router-relay", ["router", "--port", "0", "--health-interval-s", "0.5",
                                        "--metrics-port", str(metrics_port), *cluster["registry"]])
        ignored = [redis_keys.worker_key(r.address + suffix) for r in relays.values() for suffix in ("", "0")]
        wait_for(lambda: all(f"ignoring the worker registration {key}" in "".join(router.output) for key in ignored))
        assert generate_all(router.address, 8) == [4] * 8
    finally:
        if router is not None:
            router.stop()
        for relay in relays.values():
            relay.stop()
    for relay in relays.values():
        assert relay.calls == [], relay.calls  # never dialled: it saw no token, no challenge, no prompt


def test_a_relay_the_router_dials_gets_no_work(cluster):
    """Even when the router is pointed at the relay, the relay cannot prove itself with a real worker's help."""
    relay = Relay(cluster["decode"].address)
    router = start_router([cluster["prefill"]], [relay, cluster["decode"]], "--cluster-secret-file",
                          cluster["secret"], "--health-interval-s", "0.5")
    try:
        wait_for(lambda: sum(m.endswith("GetStats") for m, _ in relay.calls) >= 3)
        assert generate_all(router.address, 8) == [4] * 8  # all on the real decode worker
    finally:
        router.stop()
        relay.stop()
    assert relay.methods() <= {"GetStats", "SubscribeKvEvents"}, relay.calls  # no Decode: it never saw a prompt
    assert {how for _, how in relay.calls} == {"UNAUTHENTICATED"}, relay.calls  # the real worker refused it
