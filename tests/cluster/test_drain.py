"""SIGTERM drains a router and a decode worker during one long generation: readiness
(grpc.health.v1 "") turns NOT_SERVING while liveness stays SERVING, new requests get
UNAVAILABLE, the generation finishes with every token, and each process exits soon after
its last request, inside its drain timeout (a pod's grace period is longer still). A
router whose drain timeout is shorter than its requests exits at the timeout anyway.
Starts and stops its own processes, not the shared cluster."""
from __future__ import annotations

import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_common import LIVENESS_SERVICE
from common.protocol import generate_pb2, worker_pb2, worker_pb2_grpc
from loadtest.chaos.processes import stop_all
from tests.cluster.harness import Proc, free_port, generation_stub, start_router, start_worker
from tests.cluster.test_cluster_failures import long_request

DRAIN_TIMEOUT_S = 120.0  # far above the drain a long generation needs, even on a loaded machine
SHORT_DRAIN_TIMEOUT_S = 2.0
MAX_TOKENS = 300


def health(address: str, service: str = "") -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def refused_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as refused:
        list(call())
    return refused.value.code()


class LongGeneration(threading.Thread):
    """Streams one long greedy generation; records when each token arrived."""

    def __init__(self, address: str, max_tokens: int = MAX_TOKENS) -> None:
        super().__init__(daemon=True)
        self.address = address
        self.max_tokens = max_tokens
        self.token_times: list[float] = []
        self.completion_tokens = -1
        self.error: grpc.RpcError | None = None

    def run(self) -> None:
        try:
            for msg in generation_stub(self.address).Generate(long_request("long", self.max_tokens), timeout=300):
                if msg.HasField("chunk"):
                    self.token_times += [time.monotonic()] * len(msg.chunk.token_ids)
                else:
                    self.completion_tokens = msg.complete.usage.completion_tokens
        except grpc.RpcError as exc:
            self.error = exc

    def wait_for_tokens(self, count: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.token_times) < count:
            assert self.is_alive() and time.monotonic() < deadline, f"generation stalled: {self.error}"
            time.sleep(0.02)


def http_probe(proc: Proc, path: str) -> int:
    """Status of a worker's HTTP probe on its metrics port (what the chart probes under internal TLS)."""
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}{path}", timeout=5).status
    except urllib.error.HTTPError as exc:
        return exc.code


def sigterm_and_wait_not_serving(proc: Proc) -> float:
    signalled = time.monotonic()
    proc.popen.terminate()
    while health(proc.address) != "NOT_SERVING":
        assert time.monotonic() < signalled + 15, f"{proc.name} still reports SERVING after SIGTERM"
        time.sleep(0.05)
    assert health(proc.address, LIVENESS_SERVICE) == "SERVING", "draining is not dead: liveness must hold"
    return signalled


@pytest.fixture
def cluster(smollm2_dir):
    started: list[Proc] = []
    try:
        with ThreadPoolExecutor(2) as pool:
            metrics_port = free_port()
            prefill, decode = pool.map(lambda role: start_worker(role, "--drain-timeout-s", str(DRAIN_TIMEOUT_S),
                                                                 *(["--metrics-port", str(metrics_port)]
                                                                   if role == "decode" else [])),
                                       ["prefill", "decode"])
            decode.metrics_port = metrics_port
            started += [prefill, decode]
            started += pool.map(lambda timeout: start_router([prefill], [decode], "--router-drain-timeout-s",
                                                             str(timeout)), [DRAIN_TIMEOUT_S, SHORT_DRAIN_TIMEOUT_S])
        yield started
    finally:
        stop_all(started)


@pytest.mark.slow  # a long scenario: `make test-fast` leaves it out
def test_sigterm_drains_router_and_decode_worker_during_a_long_generation(cluster):
    prefill, decode, router, impatient = cluster
    cut_short = LongGeneration(impatient.address)
    cut_short.start()
    cut_short.wait_for_tokens(5)
    signalled = sigterm_and_wait_not_serving(impatient)
    # after the drain come the server's 1 s stop grace and the workers' aborts (<= 5 s), a few
    # seconds here (the chart's grace period leaves 15 s); loaded machines are slower still
    impatient.popen.wait(SHORT_DRAIN_TIMEOUT_S + 20)
    assert time.monotonic() - signalled >= SHORT_DRAIN_TIMEOUT_S and impatient.popen.returncode == 0
    cut_short.join(30)
    assert cut_short.error is not None and len(cut_short.token_times) < MAX_TOKENS

    generation = LongGeneration(router.address)
    generation.start()
    generation.wait_for_tokens(5)

    router_signalled = sigterm_and_wait_not_serving(router)
    late = generate_pb2.GenerateRequest(request_id="late", text="Hi", params=generate_pb2.SamplingParams(max_tokens=4))
    assert refused_code(lambda: generation_stub(router.address).Generate(late, timeout=30)) == \
        grpc.StatusCode.UNAVAILABLE

    generation.wait_for_tokens(len(generation.token_times) + 10)
    assert http_probe(decode, "/ready") == 200 and http_probe(decode, "/health") == 200
    decode_signalled = sigterm_and_wait_not_serving(decode)
    assert http_probe(decode, "/ready") == 503 and http_probe(decode, "/health") == 200  # draining, alive
    with grpc.insecure_channel(decode.address) as channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        direct = worker_pb2.DecodeRequest(request_id="late", prompt_token_ids=[1, 2, 3])
        assert refused_code(lambda: worker.Decode(direct, timeout=30)) == grpc.StatusCode.UNAVAILABLE

    generation.join(300)
    assert generation.error is None, f"the in-flight generation failed: {generation.error}"
    assert generation.completion_tokens == MAX_TOKENS == len(generation.token_times)
    last_token = generation.token_times[-1]
    assert sum(t > decode_signalled for t in generation.token_times) > 10, "nothing was in flight during the drain"
    for proc, signalled in ((router, router_signalled), (decode, decode_signalled)):
        proc.popen.wait(DRAIN_TIMEOUT_S)
        exited = time.monotonic()
        assert proc.popen.returncode == 0, "".join(proc.output[-20:])
        assert exited - last_token < 30.0, f"{proc.name} lingered after its last request"
        assert exited - signalled < DRAIN_TIMEOUT_S
    assert prefill.popen.poll() is None
